"""The synchronized layer: the module, its autograd Functions and the statistics they share.

Read top-down, as a forward runs:

- :mod:`.batchnorm`: the modules (:class:`SyncBatchNorm`, 1d/2d/3d): check the input, choose the transport, update
  the running statistics;
- :mod:`.functions`: the autograd Function of the process-group path and :func:`sync_batch_norm`, the entry point of
  every synchronized forward; it hands the DataParallel path to :mod:`.exchange_functions` (two Functions around the
  replicas' differentiable exchange);
- :mod:`.statistics`: the global statistics of a summed payload, the count check, the running-statistics update;
- :mod:`.replay`: what a DataParallel replica's checkpoint recomputation replays.

The per-element work is :mod:`syncbn_dist.kernels`' and the communication :mod:`syncbn_dist.comm`'s; neither imports
this package.
"""
