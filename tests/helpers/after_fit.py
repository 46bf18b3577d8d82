"""A 2-process CPU fit run as a script, then ``save_checkpoint``, ``validate`` and ``test`` on the same Trainer.

What a user does after ``trainer.fit`` returns. Under ``spawn`` and ``fork`` this runs in the main process, which
started the workers and trained in none of them; under ``popen`` (``mgpu_ddp``, stock ``ddp``) Lightning re-runs the
script for rank 1, and every rank runs it. The main process (rank 0 under ``popen``) writes ``<out>/record.pt``: the
checkpoint it saved, the module's parameters after the fit, what ``validate`` and ``test`` returned, and the traceback
of the first call that raised (``None`` when none did).

    python tests/helpers/after_fit.py --out /tmp/x --strategy mgpu_ddp_spawn
"""

import argparse
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  (registers the mgpu_* strategy names)
from tests.helpers.trainer import QUIET


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        generator = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=2)

    val_dataloader = test_dataloader = train_dataloader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", required=True, help="a registered name: mgpu_ddp_spawn, ddp_fork, ddp...")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    model = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_steps=2,
        limit_val_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        **QUIET,
    )
    record: dict = {"strategy": type(trainer.strategy).__name__, "error": None}
    try:
        trainer.fit(model)
        record["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        path = args.out / "after_fit.ckpt"
        trainer.save_checkpoint(path)
        record["checkpoint"] = torch.load(path, weights_only=False) if trainer.global_rank == 0 else None
        record["validate"] = trainer.validate(model, verbose=False)
        record["test"] = trainer.test(model, verbose=False)
    except Exception:
        record["error"] = traceback.format_exc()
    if trainer.global_rank == 0:
        torch.save(record, args.out / "record.pt")


if __name__ == "__main__":
    main()
