"""The layer's per-element work: one math, run two ways.

:mod:`.native` runs torch's batch-norm ops in every eager call; :mod:`.compiled` is the one source a user's
``torch.compile`` traces into its graph, which inductor fuses. The other files, and what this package imports:
docs/design.md, "The package".
"""
