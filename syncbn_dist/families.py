"""The model zoos' synchronized layers at their public path; the code is :mod:`syncbn_dist.integrations.families`."""

from .integrations.families import SynchronizedBatchNormAct, SynchronizedBatchNormAct2d

__all__ = ["SynchronizedBatchNormAct", "SynchronizedBatchNormAct2d"]
