"""A 2-process CPU fit in which one rank sleeps forever inside its training step, used by the hang watchdog tests.

    python tests/helpers/hang_fit.py --out /tmp/x --hang-rank 1 --hang-step 7 --hang-timeout 15
    python tests/helpers/hang_fit.py --out /tmp/x --strategy ddp --pg-timeout 20   # stock Lightning

The hanging rank writes ``<out>/hanging_rank<r>`` just before it sleeps; reports land in ``<out>`` (the run's log
directory).
"""

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy as StockDDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_mgpu import MultiGPUStrategy


def sleeping_forever_in_training_step(out: Path, rank: int) -> None:
    (out / f"hanging_rank{rank}").write_text(str(time.time()))
    while True:
        time.sleep(3600)


class HangingModel(pl.LightningModule):
    def __init__(self, out: Path, hang_rank: int, hang_step: int) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.out = out
        self.hang_rank = hang_rank
        self.hang_step = hang_step

    def training_step(self, batch, batch_idx: int):
        # hang_step counts optimizer steps from 1, as the report does: the step in progress is global_step + 1
        if self.trainer.global_rank == self.hang_rank and self.trainer.global_step + 1 == self.hang_step:
            sleeping_forever_in_training_step(self.out, self.trainer.global_rank)
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", default="mgpu", choices=["mgpu", "fsdp", "ddp"])
    parser.add_argument("--hang-rank", type=int, default=1)
    parser.add_argument("--hang-step", type=int, default=7)
    parser.add_argument("--hang-timeout", type=float, default=15)
    parser.add_argument("--pg-timeout", type=float, default=1800)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    timeout = timedelta(seconds=args.pg_timeout)
    if args.strategy in ("mgpu", "fsdp"):
        mode = "fsdp" if args.strategy == "fsdp" else "auto"
        strategy = MultiGPUStrategy(mode=mode, hang_timeout=args.hang_timeout, timeout=timeout)
    else:
        strategy = StockDDPStrategy(timeout=timeout)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=20,
        default_root_dir=args.out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(HangingModel(args.out, args.hang_rank, args.hang_step), DataLoader(data, batch_size=2))


if __name__ == "__main__":
    main()
