"""The main example: an ordinary LightningModule with BatchNorm, ``strategy="mgpu"`` and every callback of the pack.

Run with no arguments: 2 CPU processes (DDP over gloo), synthetic data, 19-22 seconds on 2 idle cores (the fit
itself 10-12):

    python examples/train.py
    python examples/train.py --accelerator cuda --devices 4       # the same on GPUs
    python examples/train.py --no-faults                          # without the injected faults

So that the summary has something to show, the last rank meets two faults on purpose, and says so when it
injects each one (``--no-faults`` removes them): its loss is NaN at step 5 (``NaNSkip`` skips that step on every
rank), and from step 10 its "device" holds only 48 samples' activations, so a full batch raises
``torch.OutOfMemoryError`` (``OOMBackoff`` re-runs the batch as micro-batches, and training goes on with the same
samples per optimizer step). When the output is not a terminal (a file, a pipe, CI), the progress is one line per
epoch instead of tqdm's bar. On rank 0 it ends with:

    strategy         MultiGPUStrategy -> ddp (2 cpu devices from a script: ...)
    processes        2
    skipped steps    1 (NaNSkip)
    OOM recoveries   1; micro-batch size 32 of 64 (OOMBackoff)
    peak memory      ...
    memory timeline  runs/main_example/.../memory_fit_rank0.csv, ....png (the PNG with the plot extra)
    validation       val_loss ..., val_acc ...
    injected faults  on purpose, on rank 1: a NaN loss at step 5 and an OOM from step 10 (batches over 48); ...
    time             ...
"""

import argparse
import os
import time

import lightning.pytorch as pl
import torch
from blobs import BlobClassifier, SyntheticBlobs
from lightning.pytorch.loggers import CSVLogger
from progress import progress_callbacks
from summary import fit_summary

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
            print(
                f"injecting an out-of-memory error on rank {self.global_rank} at step {step} (a batch of "
                f"{x.shape[0]} samples, the rank holds {self.memory_limit_samples}), on purpose: OOMBackoff should "
                "re-run the batch as micro-batches",
                flush=True,
            )
            raise torch.OutOfMemoryError(
                f"example fault: rank {self.global_rank} holds {self.memory_limit_samples} samples, got {x.shape[0]}"
            )
        loss = super().training_step(batch, batch_idx)
        if faulty_rank and step == self.nan_at_step:
            print(
                f"injecting a NaN loss on rank {self.global_rank} at step {step}, on purpose: NaNSkip should skip "
                "this step on every rank",
                flush=True,
            )
            loss = loss * float("nan")
        return loss

    def injected_faults(self) -> str:
        """The summary's row: which faults this model injects, and where."""
        rank = f"rank {self.trainer.world_size - 1}"
        faults = []
        if self.nan_at_step is not None:
            faults.append(f"a NaN loss at step {self.nan_at_step}")
        if self.memory_limit_from_step is not None:
            faults.append(f"an OOM from step {self.memory_limit_from_step} (batches over {self.memory_limit_samples})")
        if not faults:
            return "none (--no-faults)"
        return f"on purpose, on {rank}: {' and '.join(faults)}; --no-faults removes them"


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
            *progress_callbacks(),  # one line per epoch instead of tqdm's bar when the output is a file or a pipe
        ],
        logger=CSVLogger(args.out, name="main_example"),
        log_every_n_steps=10,
        enable_model_summary=False,
    )
    started = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - started
    if trainer.is_global_zero:
        faults = [("injected faults", model.injected_faults())]
        print("\n" + fit_summary(trainer, seconds, "lightning_mgpu main example: summary", faults), flush=True)


if __name__ == "__main__":
    main()
