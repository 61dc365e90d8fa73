"""syncbn_dist beside other code: converting models (:mod:`.convert`, :mod:`.registry`, :mod:`.families`),
DataParallel (:mod:`.data_parallel`), torch's ``Join`` (:mod:`.torch_join`), torch's own ``nn.SyncBatchNorm``
(:mod:`.torch_patch`), Lightning (:mod:`.lightning`), ``python -m syncbn_dist.run`` (:mod:`.run`, ``_bootstrap/``)
and aligning running statistics (:mod:`.running_stats`): docs/design.md, "The package".
"""
