"""``python -m syncbn_dist.run (SCRIPT | -m MODULE) [ARGS...]``: the target run with ``torch.nn.SyncBatchNorm``
synchronized through syncbn_dist; the code is :mod:`syncbn_dist.integrations.run`."""

import sys

from .integrations.run import ENV_VAR, main

__all__ = ["ENV_VAR", "main"]

if __name__ == "__main__":
    sys.exit(main())
