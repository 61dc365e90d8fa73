"""The layer's per-element work: two kernel sets with one math.

:mod:`.native` runs torch's batch-norm ops (the default); :mod:`.compiled` is one source that ``torch.compile`` fuses
and a user's ``torch.compile`` traces. The other files, and what this package imports: docs/design.md, "The package".
"""
