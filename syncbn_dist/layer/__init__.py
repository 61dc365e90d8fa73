"""The synchronized layer, read top-down as a forward runs: :mod:`.batchnorm` (the modules: input check, transport,
running statistics), :mod:`.functions` (the process-group Function, :func:`sync_batch_norm`), :mod:`.exchange_functions`
(the DataParallel replicas' two Functions), :mod:`.statistics` (global and running statistics), :mod:`.replay` (a
replica's checkpoint recomputation). It imports :mod:`syncbn_dist.kernels` and :mod:`syncbn_dist.comm`, never the
reverse.
"""
