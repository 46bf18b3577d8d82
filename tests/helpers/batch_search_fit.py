"""A 2-process CPU fit whose rank 1 runs out of memory (a real ``torch.OutOfMemoryError``) above a micro-batch size.

Rank 0 writes ``<out>/result.pt``: the parameters and BatchNorm statistics after the fit, and per rank the batch size
attribute, ``accumulate_grad_batches`` and the optimizer steps taken, read at the end of training.

    python tests/helpers/batch_search_fit.py --out /tmp/x --search --batch 8 --limit-rank1 3
    python tests/helpers/batch_search_fit.py --out /tmp/y --batch 2 --accumulate 4
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import BatchSizeSearch, MultiGPUStrategy
from tests.helpers.oom_models import raise_oom
from tests.helpers.trainer import QUIET


class Regression(pl.LightningModule):
    """Linear -> BatchNorm -> dropout -> Linear; rank 1 fails in the forward (after BatchNorm) above ``limit``."""

    def __init__(self, batch_size: int, limit_rank1: int | None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.limit_rank1 = limit_rank1
        self.net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Dropout(0.2))
        self.out = nn.Linear(16, 1)
        self.sizes_seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.net(x)
        if self.global_rank == 1 and self.limit_rank1 is not None and len(x) > self.limit_rank1:
            raise_oom()
        loss = nn.functional.mse_loss(self.out(hidden), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.sizes_seen.append(len(batch[0]))  # the loop's batches, not the search's trials

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(96, 4, generator=generator)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(96, 1, generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True)


class Record(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        mine = {
            "batch_size": pl_module.batch_size,
            "accumulate": trainer.accumulate_grad_batches,
            "steps": trainer.global_step,
            "sizes_seen": sorted(set(pl_module.sizes_seen)),
        }
        every = [None] * trainer.world_size
        dist.all_gather_object(every, mine)
        if trainer.global_rank == 0:
            state = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}
            torch.save({"state": state, "ranks": every}, self.out / "result.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--search", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--limit-rank1", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    callbacks = [Record(args.out)] + ([BatchSizeSearch()] if args.search else [])
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MultiGPUStrategy(mode="ddp", bucket_cap_mb=None, sync_batchnorm=False),
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        **QUIET,
    )
    trainer.fit(Regression(args.batch, args.limit_rank1))


if __name__ == "__main__":
    main()
