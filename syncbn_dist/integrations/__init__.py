"""syncbn_dist beside other code: converting models, DataParallel, torch's ``Join``, torch's own
``nn.SyncBatchNorm``, Lightning, the ``syncbn_dist.run`` launcher, and aligning running statistics.

- :mod:`.convert`, :mod:`.registry`, :mod:`.families`: ``convert_model``/``revert_model`` and which BatchNorm classes
  they synchronize (model zoos' included);
- :mod:`.data_parallel`: ``DataParallelWithCallback`` and the replication callbacks (``nn.DataParallel``);
- :mod:`.torch_join`: ``join_layers``, the layers' ``Joinable`` for ``torch.distributed.algorithms.Join``;
- :mod:`.torch_patch`: ``patch_torch_sync_batchnorm``, ``torch.nn.SyncBatchNorm`` synchronizing through syncbn_dist;
- :mod:`.lightning`: the Lightning plugin (imports Lightning; public as ``syncbn_dist.lightning``);
- :mod:`.run` and ``_bootstrap/``: ``python -m syncbn_dist.run``;
- :mod:`.running_stats`: ``sync_running_stats`` for models trained with plain BatchNorm.

Each one builds on :mod:`syncbn_dist.layer`; none of them is imported by it.
"""
