"""A 2-process CPU fit run as a script, with the DDP bucket size fixed or ``"auto"``.

Timings are steered for real: ``--slow-unless 5MB:60`` sleeps 60 ms in every training step whose DDP wrap is not
the ``5MB`` setting, so the tuner measures that setting as the fastest. Each rank saves to ``<out>/rank<r>.pt`` its
parameters, the tuning result, and the setting each training step ran with (read from the DDP module itself).

    python tests/helpers/bucket_fit.py --out /tmp/x --bucket auto --slow-unless 5MB:60 --max-steps 240
    python tests/helpers/bucket_fit.py --out /tmp/ref --bucket 5 --max-steps 240

``--step-flag`` asks the strategy for a :class:`~lightning_mgpu.ddp.step_flag.StepFlag` and saves, per
optimizer step, the sums the ranks' contributions came to (``<out>/flag_rank<r>.pt``).
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MultiGPUStrategy, PerformanceMonitor
from lightning_mgpu.ddp.bucket_tuning import Trial
from lightning_mgpu.ddp.step_flag import StepFlag
from tests.helpers.trainer import QUIET, RecordingLogger


def running_setting(trainer: Trainer) -> str:
    """The label of the bucket size the DDP wrap really uses, and the hook the strategy registered on it."""
    ddp = trainer.strategy.model
    assert isinstance(ddp, DistributedDataParallel)
    size = None if ddp.bucket_bytes_cap_default else ddp.bucket_bytes_cap / 2**20
    return Trial(size, trainer.strategy._active_comm_hook).label


class WideRegression(LightningModule):
    """Two 1024x1024 layers: about 8 MB of gradients, so 1, 5 and 25 MB buckets all differ."""

    def __init__(self, slow_unless: str | None, slow_ms: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024))
        self.slow_unless, self.slow_ms = slow_unless, slow_ms
        self.settings: list[str] = []

    def training_step(self, batch, batch_idx):
        setting = running_setting(self.trainer)
        self.settings.append(setting)
        if self.slow_unless is not None and setting != self.slow_unless:
            time.sleep(self.slow_ms / 1000)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self._data(), batch_size=4)

    def val_dataloader(self):
        return DataLoader(self._data(), batch_size=4)

    def _data(self) -> TensorDataset:
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(256, 1024, generator=generator)
        return TensorDataset(x, torch.tanh(x.flip(1)))


class SaveRankState(Callback):
    def __init__(self, out: Path, logger: RecordingLogger) -> None:
        self.out, self.logger = out, logger

    def on_train_end(self, trainer, pl_module):
        self.final_setting = running_setting(trainer)  # the strategy unwraps DDP before on_fit_end

    def on_fit_end(self, trainer, pl_module):
        tuning = trainer.strategy.bucket_tuning
        state = {
            "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "tuning": None if tuning is None else {**tuning.state_dict(), "reason": tuning.reason},
            "settings": pl_module.settings,
            "final_setting": self.final_setting,
            "global_step": trainer.global_step,
            "logged": [metrics for _, metrics in self.logger.calls if any(k.startswith("ddp/") for k in metrics)],
        }
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


def flag_contributions(step: int, rank: int) -> dict[int, int]:
    """What ``rank`` contributes at optimizer step ``step``: slot -> value."""
    contributions = {0: rank + 1} if step % 7 == 0 else {}
    if step == 3 and rank == 1:
        contributions[1] = 1
    return contributions


class FlagProbe(Callback):
    """Asks the strategy for a StepFlag, contributes by :func:`flag_contributions`, records the sums every step."""

    def __init__(self, out: Path) -> None:
        self.out, self.flag = out, StepFlag(slots=2)
        self.sums: list[list[float]] = []
        self.registered: list[bool] = []
        self.timed: list[bool] = []

    def setup(self, trainer, pl_module, stage):
        trainer.strategy.step_service.carry_flag(self.flag)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for slot, value in flag_contributions(trainer.global_step, trainer.global_rank).items():
            self.flag.set(slot, value)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.sums.append(self.flag.reduced.tolist())
        self.registered.append(trainer.strategy.step_service.flag_carried)
        self.timed.append(trainer.strategy.comm_timed)

    def on_fit_end(self, trainer, pl_module):
        state = {"sums": self.sums, "registered": self.registered, "timed": self.timed}
        torch.save(state, self.out / f"flag_rank{trainer.global_rank}.pt")


class StopAfter(Callback):
    """Stop at an optimizer step, while ``max_steps`` still tells the tuning how long the fit is."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bucket", default="auto", help="'auto', 'default' or a size in MB")
    parser.add_argument("--comm-hook", default="none", choices=["none", "auto", "fp16", "bf16"])
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--max-steps", type=int, default=240)
    parser.add_argument("--slow-unless", default=None, help="LABEL:MS, e.g. 5MB:60")
    parser.add_argument("--save-ckpt", type=Path, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--val-every", type=int, default=0, help="validate 2 batches every N training batches")
    parser.add_argument("--stop-after", type=int, default=0, help="stop at this step (max_steps still sets the plan)")
    parser.add_argument("--step-flag", action="store_true", help="carry a StepFlag in the gradient reduction")
    parser.add_argument("--monitor", action="store_true", help="add a PerformanceMonitor (it times the reductions)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bucket = (
        {"auto": "auto", "default": None}.get(args.bucket) if args.bucket in ("auto", "default") else float(args.bucket)
    )
    slow_unless, slow_ms = (
        (args.slow_unless.rsplit(":", 1)[0], float(args.slow_unless.rsplit(":", 1)[1]))
        if args.slow_unless
        else (None, 0.0)
    )
    strategy = MultiGPUStrategy(
        mode="ddp",
        bucket_cap_mb=bucket,
        bucket_tuning_steps=args.budget,
        comm_hook=None if args.comm_hook == "none" else args.comm_hook,
    )
    logger = RecordingLogger()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=-1,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        limit_val_batches=2 if args.val_every else 0,
        val_check_interval=args.val_every or None,
        callbacks=[
            SaveRankState(args.out, logger),
            *([StopAfter(args.stop_after)] if args.stop_after else []),
            *([FlagProbe(args.out)] if args.step_flag else []),
            *([PerformanceMonitor(count_flops=False, progress_bar=False)] if args.monitor else []),
        ],
        **{**QUIET, "logger": logger},
    )
    trainer.fit(WideRegression(slow_unless, slow_ms), ckpt_path=args.resume)
    if args.save_ckpt is not None:
        trainer.save_checkpoint(args.save_ckpt)


if __name__ == "__main__":
    main()
