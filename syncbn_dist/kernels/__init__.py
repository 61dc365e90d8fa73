"""The layer's per-element work: two kernel sets with one math.

- :mod:`.native`: torch's own batch-norm ops (the default): nothing to compile;
- :mod:`.compiled`: one Python source of the four passes over the activation, compiled by ``torch.compile``
  (inductor) into fused kernels, and what a user's ``torch.compile`` traces; :mod:`.compiled_kernel` compiles a
  region once per signature and :mod:`.direct_call` calls its inductor graph directly afterwards;
- :mod:`.tracing`: whether the running code is traced (per thread), or under a forward-AD or ``torch.func``
  transform: what decides which of them runs.

This package imports :mod:`syncbn_dist.comm` (the compiled regions' collective) and nothing else of syncbn_dist.
"""
