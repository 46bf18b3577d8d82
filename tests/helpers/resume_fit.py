"""A 2-process CPU fit with dropout and a shuffled loader that checkpoints, can be killed, and can resume.

Every rank appends the sample indices of each training batch to ``<out>/seen_rank<r>.jsonl`` (one line per step,
flushed, so a killed attempt keeps what it trained); at the end rank 0 writes every rank's final parameters and
optimizer state, and its own optimizer ``state_dict``, to ``<out>/result.pt``. The training step draws from torch,
numpy and Python's ``random``, seeded per rank, so each rank's streams differ. Run as a script (Lightning re-runs it
for rank 1) or under ``torchrun``:

    python tests/helpers/resume_fit.py --out /tmp/x --kill-rank 1 --kill-step 22
    python tests/helpers/resume_fit.py --out /tmp/x --resume
    torchrun --nproc-per-node 2 --max-restarts 1 tests/helpers/resume_fit.py --out /tmp/x --resume --kill-once ...

Under a (faked) SLURM environment the test starts both processes itself; ``--requeue-signal`` sends SLURM's requeue
signal (SIGUSR1) instead of SIGKILL, and a requeued run resumes with ``fit(ckpt_path=None)``, as a SLURM job script
does, from Lightning's ``hpc_ckpt_<n>.ckpt`` in ``--out``.
"""

import argparse
import atexit
import contextlib
import glob
import json
import os
import random
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_mgpu import MultiGPUStrategy

SAMPLES = 40


class Indexed(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=generator)
        self.y = torch.randn(SAMPLES, 1, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return index, self.x[index], self.y[index]


class DropoutModel(pl.LightningModule):
    def __init__(self, out: Path, kill_rank: int | None, kill_step: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
        self.out = out
        self.kill_rank = kill_rank
        self.kill_step = kill_step
        self.kill_signal = signal.SIGKILL
        self._seen = None

    def setup(self, stage: str) -> None:
        # each rank its own streams; a resumed fit seeds the same way and has them restored from the checkpoint
        rank = self.trainer.global_rank
        torch.manual_seed(100 + rank)
        np.random.seed(200 + rank)
        random.seed(300 + rank)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.trainer.global_rank == self.kill_rank and self.trainer.global_step == self.kill_step:
            os.kill(os.getpid(), self.kill_signal)

    def training_step(self, batch, batch_idx: int):
        index, x, y = batch
        if self._seen is None:
            self._seen = open(self.out / f"seen_rank{self.trainer.global_rank}.jsonl", "a")  # noqa: SIM115
        self._seen.write(json.dumps({"step": self.trainer.global_step + 1, "indices": index.tolist()}) + "\n")
        self._seen.flush()
        x = x + torch.randn_like(x) * 0.1 + float(np.random.rand()) * 0.1 + random.random() * 0.1
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: FSDP's parameters and optimizer states are shards (DTensors)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def record_threads_at_exit(out: Path) -> None:
    """At interpreter exit, after every exit handler registered later (Lightning's, the pack's), write down the names
    of this process's native threads to ``<out>/exit_threads_<pid>.json`` (Linux)."""

    def record() -> None:
        names = []
        for name in glob.glob("/proc/self/task/*/comm"):
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                names.append(Path(name).read_text().strip())
        (out / f"exit_threads_{os.getpid()}.json").write_text(json.dumps(names))

    atexit.register(record)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", default="mgpu", choices=["mgpu", "ddp", "fsdp"])
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--kill-once", action="store_true", help="kill only in torchrun's first attempt")
    parser.add_argument("--sigterm", action="store_true", help="send SIGTERM, not SIGKILL; OnExceptionCheckpoint saves")
    parser.add_argument("--requeue-signal", action="store_true", help="send SIGUSR1, SLURM's requeue signal")
    parser.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=15)
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--record-exit-threads", action="store_true", help="see record_threads_at_exit")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.record_exit_threads:
        record_threads_at_exit(args.out)
    if args.kill_once and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        args.kill_rank = None

    pl.seed_everything(0, verbose=False)
    model = DropoutModel(args.out, args.kill_rank, args.kill_step)
    strategy = {"mgpu": MultiGPUStrategy(), "fsdp": MultiGPUStrategy(mode="fsdp"), "ddp": "ddp"}[args.strategy]
    callbacks = [ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.every, save_last=True)]
    if args.requeue_signal:
        model.kill_signal = signal.SIGUSR1
    if args.sigterm:
        model.kill_signal = signal.SIGTERM
        callbacks.append(OnExceptionCheckpoint(dirpath=args.out / "ckpt", filename="on_exception"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        default_root_dir=args.out,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(Indexed(), batch_size=2, shuffle=True)
    trainer.fit(model, loader, ckpt_path="last" if args.resume else None)
    parameters = {name: full(p).detach().clone() for name, p in model.named_parameters()}
    gathered = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, parameters)
    optimizer = trainer.optimizers[0].state_dict()
    optimizer["state"] = {
        index: {key: full(value) for key, value in state.items()} for index, state in optimizer["state"].items()
    }
    optimizers = [None] * trainer.world_size
    torch.distributed.all_gather_object(optimizers, optimizer["state"])
    if trainer.global_rank == 0:
        record = {"parameters": gathered, "optimizer": optimizer, "optimizers": optimizers, "step": trainer.global_step}
        torch.save(record, args.out / "result.pt")


if __name__ == "__main__":
    main()
