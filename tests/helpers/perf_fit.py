"""A 2-process CPU fit with ``PerformanceMonitor``, run as a script (Lightning re-runs it for rank 1).

One rank can be slowed in its training step (``--slow-rank R --slow-ms MS``) or in its loader (``--slow-loader-rank R
--loader-ms MS``). Counts the Python-level ``torch.distributed`` calls made while training and writes per rank
``<out>/rank<r>.json`` (the monitor's last logged metrics on rank 0, this rank's own last figures, the ranks named
as stragglers); rank 0's CSV logger writes ``<out>/logs/metrics.csv``.

    python tests/helpers/perf_fit.py --out /tmp/x --steps 40 --log-every 5 --slow-rank 1 --slow-ms 30
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_mgpu import GPUMemoryMonitor, MultiGPUStrategy, PerformanceMonitor
from tests.helpers.monitor_fit import CollectiveCounter
from tests.helpers.sigterm_fit import MLP


class Record(CollectiveCounter):
    """Count ``torch.distributed`` calls from the first training batch to the end of training; write the record."""

    def on_train_end(self, trainer, pl_module):
        self.counting = False
        monitor = next((c for c in trainer.callbacks if isinstance(c, PerformanceMonitor)), None)
        record = {
            "rank": trainer.global_rank,
            "calls": self.calls,
            "global_step": trainer.global_step,
            "last_logged": monitor.last_logged if monitor else None,
            "last_window": monitor.last_window if monitor else None,
            "stragglers": monitor.stragglers if monitor else None,
            "flops_per_sample": monitor.flops_per_sample if monitor else None,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class SlowMLP(MLP):
    def __init__(self, slow_rank: int, slow_ms: float):
        super().__init__()
        self.slow_rank = slow_rank
        self.slow_ms = slow_ms

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.slow_rank:
            time.sleep(self.slow_ms / 1e3)
        return super().training_step(batch, batch_idx)


def slow_collate(rank: int, ms: float):
    def collate(samples):
        if torch.distributed.get_rank() == rank:
            time.sleep(ms / 1e3)
        return default_collate(samples)

    return collate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--monitors", choices=["none", "perf", "both"], default="perf")
    parser.add_argument("--no-comm-timing", action="store_true")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--slow-loader-rank", type=int, default=-1)
    parser.add_argument("--loader-ms", type=float, default=0.0)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--comm-hook", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)

    callbacks: list[pl.Callback] = [Record(args.out)]
    if args.monitors == "both":
        callbacks.append(GPUMemoryMonitor(sample_hz=20, timeline_dir=str(args.out / "timeline")))
    if args.monitors != "none":
        callbacks.append(PerformanceMonitor(comm_timing=not args.no_comm_timing, straggler_windows=2))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))
    loader = DataLoader(data, batch_size=16, collate_fn=slow_collate(args.slow_loader_rank, args.loader_ms))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=MultiGPUStrategy(mode="ddp", bucket_cap_mb=None, comm_hook=args.comm_hook),
        max_steps=args.steps,
        log_every_n_steps=args.log_every,
        logger=CSVLogger(args.out / "logs", name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(SlowMLP(args.slow_rank, args.slow_ms), loader)


if __name__ == "__main__":
    main()
