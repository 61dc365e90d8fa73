"""The start-up hook of ``python -m syncbn_dist.run``: this directory, first on the children's PYTHONPATH, holds only
``sitecustomize.py`` (see :mod:`syncbn_dist.run`). A package only so that the wheel ships it; never imported as one."""
