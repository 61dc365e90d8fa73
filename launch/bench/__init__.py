"""The benchmark: DDP step time per BatchNorm variant against the in-step synchronization floor, and the
one-layer microbenchmark. Run ``python -m launch.bench.run --config configs/bench.yaml`` (see :mod:`.run`).
"""
