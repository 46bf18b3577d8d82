"""The main example: an ordinary LightningModule with BatchNorm, ``strategy="mgpu"`` and every callback of the pack.

Run with no arguments: 2 CPU processes (DDP over gloo), synthetic data, about 10 seconds on 2 cores:

    python examples/train.py
    python examples/train.py --accelerator cuda --devices 4       # the same on GPUs
    python examples/train.py --no-faults                          # without the injected faults

So that the summary has something to show, the last rank meets two faults on purpose (``--no-faults`` removes
them): its loss is NaN at one step (``NaNSkip`` skips that step on every rank), and from a later step its "device"
holds only 48 samples' activations, so a full batch raises ``torch.OutOfMemoryError`` (``OOMBackoff`` re-runs the
batch as micro-batches, and training goes on with the same samples per optimizer step). On rank 0 it ends with:

    strategy         MultiGPUStrategy -> ddp (2 cpu devices from a script: ...)
    skipped steps    1 (NaNSkip)
    OOM recoveries   1; micro-batch size 32 of 64 (OOMBackoff)
    peak memory      ...
    memory timeline  runs/main_example/.../memory_fit_rank0.csv, ....png (the PNG with the plot extra)
"""

import argparse
import os
import time

import lightning.pytorch as pl
import torch
from blobs import BlobClassifier, SyntheticBlobs
from lightning.pytorch.loggers import CSVLogger

from lightning_mgpu import GPUMemoryMonitor, GradientClipping, NaNSkip, OOMBackoff

# one thread per process: 2 processes on 2 cores must not fight over them
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


class ClassifierWithFaults(BlobClassifier):
    """``BlobClassifier`` whose last rank sees a NaN loss once and, later, a memory limit.

    Args:
        nan_at_step: the optimizer step whose loss is NaN on the last rank (``None``: never).
        memory_limit_from_step: from this step on, a forward pass over more than ``memory_limit_samples`` samples
            raises ``torch.OutOfMemoryError`` on the last rank (``None``: never).
        memory_limit_samples: samples the last rank can hold once the limit applies.
        **kwargs: ``BlobClassifier``'s arguments.
    """

    def __init__(
        self,
        nan_at_step: int | None = 5,
        memory_limit_from_step: int | None = 10,
        memory_limit_samples: int = 48,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.nan_at_step = nan_at_step
        self.memory_limit_from_step = memory_limit_from_step
        self.memory_limit_samples = memory_limit_samples

    def training_step(self, batch, batch_idx):
        faulty_rank = self.global_rank == self.trainer.world_size - 1
        step = self.trainer.global_step
        x, _ = batch
        limited = self.memory_limit_from_step is not None and step >= self.memory_limit_from_step
        if faulty_rank and limited and x.shape[0] > self.memory_limit_samples:
            raise torch.OutOfMemoryError(
                f"example fault: rank {self.global_rank} holds {self.memory_limit_samples} samples, got {x.shape[0]}"
            )
        loss = super().training_step(batch, batch_idx)
        if faulty_rank and step == self.nan_at_step:
            loss = loss * float("nan")
        return loss


def peak_memory(monitor: GPUMemoryMonitor, world_size: int) -> str:
    if monitor.training_peak_mb is None:
        return "not measured (no training step was logged)"
    over = f" (max over {world_size} ranks)" if world_size > 1 else ""
    return f"{monitor.training_peak_source} {monitor.training_peak_mb:.0f} MiB{over}"


def summary(trainer: pl.Trainer, seconds: float) -> str:
    """What the pack did in this run, from the strategy's and the callbacks' own records."""
    nan_skip = next(cb for cb in trainer.callbacks if isinstance(cb, NaNSkip))
    oom = next(cb for cb in trainer.callbacks if isinstance(cb, OOMBackoff))
    monitor = next(cb for cb in trainer.callbacks if isinstance(cb, GPUMemoryMonitor))
    choice = trainer.strategy.choice
    batch = trainer.datamodule.batch_size
    micro = oom.micro_batch_size if oom.micro_batch_size is not None else batch
    files = (monitor.timeline_path, monitor.plot_path)
    metrics = ", ".join(f"{k} {float(v):.3f}" for k, v in trainer.callback_metrics.items() if k.startswith("val_"))
    rows = [
        ("strategy", f"{type(trainer.strategy).__name__} -> {choice.mode} ({choice.reason})"),
        ("processes", str(trainer.world_size)),
        ("skipped steps", f"{nan_skip.skipped_steps} (NaNSkip)"),
        ("OOM recoveries", f"{oom.recoveries}; micro-batch size {micro} of {batch} (OOMBackoff)"),
        ("peak memory", peak_memory(monitor, trainer.world_size)),
        ("memory timeline", ", ".join(str(p) for p in files if p) or "not written"),
        ("validation", metrics or "not run"),
        ("time", f"{seconds:.1f} s"),
    ]
    return "\n".join(f"  {name:<16} {value}" for name, value in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu", help="cpu, cuda, auto (default: cpu)")
    parser.add_argument("--devices", default="2", help="processes or GPUs (default: 2)")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096, help="synthetic samples (90%% train)")
    parser.add_argument("--no-faults", action="store_true", help="no injected NaN loss or out-of-memory error")
    parser.add_argument("--out", default="runs", help="logs, checkpoints and the memory timeline go here")
    args = parser.parse_args()

    pl.seed_everything(42, verbose=False)
    faults = {"nan_at_step": None, "memory_limit_from_step": None} if args.no_faults else {}
    model = ClassifierWithFaults(**faults)
    data = SyntheticBlobs(num_samples=args.samples, batch_size=64)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=int(args.devices) if args.devices.lstrip("-").isdigit() else args.devices,
        strategy="mgpu",
        max_epochs=args.max_epochs,
        callbacks=[
            NaNSkip(),
            GradientClipping(mode="norm", max_norm=1.0),
            GPUMemoryMonitor(),
            OOMBackoff(),
        ],
        logger=CSVLogger(args.out, name="main_example"),
        log_every_n_steps=10,
        enable_model_summary=False,
    )
    started = time.perf_counter()
    trainer.fit(model, data)
    if trainer.is_global_zero:
        print("\nlightning_mgpu main example: summary\n" + summary(trainer, time.perf_counter() - started), flush=True)


if __name__ == "__main__":
    main()
