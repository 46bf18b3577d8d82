"""A 2-process CPU fit with ``GPUMemoryMonitor``, run as a script (Lightning re-runs it for rank 1).

Counts the Python-level ``torch.distributed`` calls made while training, can make one rank hold extra host memory,
and writes per rank ``<out>/rank<r>.json``; rank 0's CSV logger writes under ``<out>/logs``. ``--progress-bar`` draws
Lightning's bar and adds ``NaNSkip`` and ``GradientClipping``, so that every rank logs their bar fields and rank 0
alone the monitor's; each rank's ``progress_bar_metrics`` go into its record.

    python tests/helpers/monitor_fit.py --out /tmp/x --steps 20 --log-every 5 --extra-mb 1 256
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_mgpu import GPUMemoryMonitor, GradientClipping, MultiGPUStrategy, NaNSkip
from tests.helpers.collectives import count_collectives
from tests.helpers.sigterm_fit import MLP


class CollectiveCounter(pl.Callback):
    """Count ``torch.distributed`` calls from the first training batch to the end of training."""

    def __init__(self, out: Path):
        self.out = out
        self.counting = False
        self.calls: dict[str, int] = {}

    def setup(self, trainer, pl_module, stage):
        count_collectives(self.calls, lambda: self.counting)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counting = True

    def on_train_end(self, trainer, pl_module):
        self.counting = False
        monitor = next((c for c in trainer.callbacks if isinstance(c, GPUMemoryMonitor)), None)
        record = {
            "rank": trainer.global_rank,
            "calls": self.calls,
            "global_step": trainer.global_step,
            "last_logged": monitor.last_logged if monitor else None,
            "timeline": str(monitor.timeline_path) if monitor else None,
            "progress_bar_metrics": {key: float(value) for key, value in trainer.progress_bar_metrics.items()},
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class BallastMLP(MLP):
    """The preemption tests' MLP; one rank can hold extra memory."""

    def __init__(self, extra_mb: list[int] | None):
        super().__init__()
        self.extra_mb = extra_mb
        self.ballast = None

    def on_train_start(self):
        if self.extra_mb and self.extra_mb[0] == self.global_rank:
            # touched pages, so the resident set of this rank really grows
            self.ballast = torch.ones(self.extra_mb[1] * 2**20 // 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--no-monitor", action="store_true")
    parser.add_argument("--extra-mb", type=int, nargs=2, default=None, help="RANK MB: that rank holds MB more")
    parser.add_argument("--progress-bar", action="store_true", help="draw the bar; add NaNSkip and GradientClipping")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    callbacks: list[pl.Callback] = [CollectiveCounter(args.out)]
    if not args.no_monitor:
        callbacks.append(GPUMemoryMonitor(sample_hz=20, timeline_dir=str(args.out / "timeline")))
    if args.progress_bar:
        callbacks += [NaNSkip(), GradientClipping(mode="norm", max_norm=1.0)]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MultiGPUStrategy(mode="ddp"),
        max_steps=args.steps,
        log_every_n_steps=args.log_every,
        logger=CSVLogger(args.out / "logs", name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=args.progress_bar,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(BallastMLP(args.extra_mb), DataLoader(data, batch_size=16))


if __name__ == "__main__":
    main()
