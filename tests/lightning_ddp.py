"""Fits a small BatchNorm model for one step under Lightning's DDP on 2 CPU processes with synchronized BatchNorm.

Run by tests/test_lightning.py as ``python tests/lightning_ddp.py OUT_DIR PACKAGE`` (``pytorch_lightning`` or
``lightning.pytorch``), with ``SyncBatchNormPlugin``; and as ``python -m syncbn_dist.run tests/lightning_ddp.py
OUT_DIR PACKAGE torch``, with Lightning's own ``sync_batchnorm=True`` (``torch.nn.SyncBatchNorm``, patched).
Lightning's ``strategy="ddp"`` starts rank 1 by re-running the command (``python tests/lightning_ddp.py ...``), so
the Trainer must run from a script, not inside pytest. Each rank trains on its own rows of the global batch
(``ROWS``, uneven) and writes ``OUT_DIR/rank{r}.pt``: the state_dict after fit, the layer classes seen in training
and after fit, the transports used, and the module of ``torch.nn.SyncBatchNorm.forward``.
"""

from __future__ import annotations

import gc
import importlib
import sys
from datetime import timedelta

import torch
import torch.nn.functional as F
from conv_bn_model import batch, build
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from syncbn_dist.integrations.lightning import SyncBatchNormPlugin

# The Lightning package the script runs: PACKAGE when run as a script; whichever imports when the test imports it.
if __name__ == "__main__":
    pl = importlib.import_module(sys.argv[2])
else:
    try:
        import pytorch_lightning as pl
    except ImportError:
        import lightning.pytorch as pl
DDPStrategy = importlib.import_module(f"{pl.__name__}.strategies").DDPStrategy

ROWS = [3, 6]  # rows of the global batch on rank 0 and rank 1
LR = 0.5


def global_batch() -> tuple[Tensor, Tensor]:
    return batch(sum(ROWS))


def loss_of(output: Tensor, target: Tensor, world_size: int) -> Tensor:
    """Summed squared error × world_size / global batch: DDP's average over ranks is the global mean loss."""
    return F.mse_loss(output, target, reduction="sum") * world_size / sum(ROWS)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build()
        self.seen: dict[str, object] = {}

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = loss_of(self.net(x), y, self.trainer.world_size)
        self.seen["classes"] = [type(m).__name__ for m in self.net]
        self.seen["transports"] = [getattr(m, "last_transport", None) for m in self.net]
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        x, y = global_batch()
        rows = slice(sum(ROWS[: self.global_rank]), sum(ROWS[: self.global_rank + 1]))
        return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=ROWS[self.global_rank])


def main(out_dir: str, sync: str = "plugin") -> None:
    """``sync``: ``"plugin"`` (SyncBatchNormPlugin) or ``"torch"`` (``sync_batchnorm=True``, torch's class)."""
    model = Model()
    layer_sync = dict(plugins=[SyncBatchNormPlugin()]) if sync == "plugin" else dict(sync_batchnorm=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        **layer_sync,
        max_steps=1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out_dir,
    )
    trainer.fit(model)
    result = {
        "state": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
        "seen": model.seen,
        "after_fit": [type(m).__name__ for m in model.net],
        "after_fit_types_are_torch": [type(m) in (nn.BatchNorm1d, nn.BatchNorm2d) for m in model.net[1::4]],
        "trainer_module": type(trainer).__module__,
        "forward_module": nn.SyncBatchNorm.forward.__module__,
    }
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:2], *sys.argv[3:4])
    # The Trainer and DDP end in reference cycles: collect them while the interpreter is
    # alive, before Lightning's atexit destroys the group (docs/compile.md, "Exiting a compiled job").
    gc.collect()
