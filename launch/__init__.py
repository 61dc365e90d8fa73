"""Recipes over syncbn_dist: digits training, the plain-vs-synchronized comparison, and the benchmark.

Run them as modules from the repository root (``torchrun -m launch.digits.train --config ...``). The library
never imports from here; :mod:`launch.common` holds what the recipes and the tests share.
"""
