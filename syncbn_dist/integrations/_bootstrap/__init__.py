"""The start-up hook of ``python -m syncbn_dist.run``: a directory put first on the children's PYTHONPATH.

It holds ``sitecustomize.py`` only, which Python imports at start-up (see :mod:`syncbn_dist.run`). Never imported as a
package; it is one so that the wheel ships it.
"""
