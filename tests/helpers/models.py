"""Small models and data for strategy tests, with exact single-process references."""

import contextlib
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.multiprocessing.spawn import ProcessExitedException
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu.long_runs.exact_resume import KeepsRankState

IN_FEATURES, HIDDEN, CLASSES = 12, 16, 4


def global_data(num_samples: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, IN_FEATURES, generator=generator) * 2 + 0.5
    y = torch.randint(0, CLASSES, (num_samples,), generator=generator)
    return x, y


def rank_slices(per_rank_batch: tuple[int, ...], steps: int) -> list[list[tuple[int, int]]]:
    """For each rank, the [start, stop) index ranges into the global data of its batches, step by step."""
    global_batch = sum(per_rank_batch)
    slices: list[list[tuple[int, int]]] = [[] for _ in per_rank_batch]
    for step in range(steps):
        offset = step * global_batch
        for rank, size in enumerate(per_rank_batch):
            slices[rank].append((offset, offset + size))
            offset += size
    return slices


class BatchNormClassifier(pl.LightningModule):
    """Linear -> BatchNorm1d -> ReLU -> Linear; rank r trains on its own slice of one global data set.

    ``per_rank_batch`` gives each rank's batch size (uneven sizes allowed); step s of rank r uses
    ``rank_slices(per_rank_batch, steps)[r][s]``, so a single process can rebuild every global batch.
    """

    def __init__(
        self,
        per_rank_batch: tuple[int, ...] = (8, 8),
        steps: int = 4,
        lr: float = 0.1,
        optimizer: str = "sgd",
        inject: tuple[str, int, int] | None = None,
        drop_step: int | tuple[int, ...] | None = None,
        lr_decay: float | None = None,
    ) -> None:
        super().__init__()
        self.per_rank_batch = tuple(per_rank_batch)
        self.steps = steps
        self.lr = lr
        self.optimizer_name = optimizer
        # (kind, rank, batch_idx): "loss_nan" adds NaN to the loss, "loss_spike" multiplies it by 1000, "grad_inf"
        # puts an Inf in a gradient
        self.inject = inject
        # reference runs: this step's batch (or these steps') is left out of the data stream
        self.drop_step = drop_step
        self.lr_decay = lr_decay  # an ExponentialLR stepped every optimizer step
        self._grad_hook = None
        torch.manual_seed(7)
        self.net = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _injecting(self, kind: str, batch_idx: int) -> bool:
        if self.inject is None:
            return False
        inject_kind, rank, step = self.inject
        return (
            inject_kind == kind and self.global_rank == rank and (batch_idx == step or (step == -1 and batch_idx >= 1))
        )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._injecting("grad_inf", batch_idx):
            # before DDP's all-reduce: this rank's local gradient of one weight gets an Inf
            def add_inf(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
                return grad

            self._grad_hook = self.net[3].weight.register_hook(add_inf)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self._injecting("loss_nan", batch_idx):
            loss = loss + float("nan")  # the gradients stay finite: only the loss says something is wrong
        if self._injecting("loss_spike", batch_idx):
            loss = loss * 1000.0  # finite: a spike of the loss and of this rank's gradients
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self) -> None:
        if self._grad_hook is not None:
            self._grad_hook.remove()
            self._grad_hook = None

    @property
    def _dropped(self) -> set[int]:
        if self.drop_step is None:
            return set()
        return {self.drop_step} if isinstance(self.drop_step, int) else set(self.drop_step)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam_fused":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)
        elif self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "adam_foreach":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr, foreach=True)
        elif self.optimizer_name == "adamw_forloop":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=False)
        elif self.optimizer_name == "sgd_foreach":
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, foreach=True)
        elif self.optimizer_name == "rmsprop":
            optimizer = torch.optim.RMSprop(self.parameters(), lr=self.lr, momentum=0.5)
        elif self.optimizer_name == "adagrad":
            optimizer = torch.optim.Adagrad(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.lr_decay is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=self.lr_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        rank = self.global_rank if self._trainer is not None else 0
        x, y = global_data(sum(self.per_rank_batch) * self.steps)
        dropped = self._dropped
        slices = [
            sl for step, sl in enumerate(rank_slices(self.per_rank_batch, self.steps)[rank]) if step not in dropped
        ]
        indices = [i for start, stop in slices for i in range(start, stop)]
        dataset = TensorDataset(x[indices], y[indices])
        return DataLoader(dataset, batch_size=self.per_rank_batch[rank], shuffle=False)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = global_data(sum(self.per_rank_batch) * self.steps)
        start = step * sum(self.per_rank_batch)
        stop = start + sum(self.per_rank_batch)
        return x[start:stop], y[start:stop]


class RankStateDump(pl.Callback):
    """Saves, per rank, the first step's gradients and the final parameters and buffers to ``rank{r}.pt``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = str(directory)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.first_grads: dict[str, torch.Tensor] = {}
        self.layer_classes: list[str] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 0 and not self.first_grads:
            self.first_grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}
            self.layer_classes = [type(m).__name__ for m in pl_module.modules()]

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "choice": getattr(trainer.strategy, "choice", None),
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in pl_module.named_buffers()},
            "first_grads": self.first_grads,
            "layer_classes_during_fit": self.layer_classes,
            "global_step": trainer.global_step,
            "optimizer_state": {
                key: {name: v.clone() for name, v in state.items() if isinstance(v, torch.Tensor)}
                for key, state in trainer.optimizers[0].state_dict()["state"].items()
            },
            "skipped_steps": next((c.skipped_steps for c in trainer.callbacks if hasattr(c, "skipped_steps")), None),
            "spiked_steps": next((c.spiked_steps for c in trainer.callbacks if hasattr(c, "spiked_steps")), None),
            "rollbacks": next((c.rollbacks for c in trainer.callbacks if hasattr(c, "rollbacks")), None),
            "rank_state": next((c.rank_state() for c in trainer.callbacks if isinstance(c, KeepsRankState)), None),
            "events": [
                (e.step, e.kind, e.detail) for c in trainer.callbacks if hasattr(c, "events") for e in c.events.since(0)
            ],
        }
        torch.save(state, Path(self.directory) / f"rank{trainer.global_rank}.pt")


@contextlib.contextmanager
def finished_fits_survive_exit_aborts(directory: str | Path, world_size: int = 2) -> Iterator[None]:
    """Let a ``ddp_spawn`` fit through when a worker aborted in interpreter teardown after every rank finished.

    gloo occasionally aborts a spawned worker as it exits ("terminate called without an active exception", a
    background thread destroyed while joinable), after ``on_fit_end`` wrote the rank's dump. The run's results are
    in the dumps, which the test still checks; any other failure, or an abort before every dump exists, is raised.
    """
    started = time.time()
    try:
        yield
    except ProcessExitedException as err:
        dumps = [Path(directory) / f"rank{r}.pt" for r in range(world_size)]
        finished = all(dump.is_file() and dump.stat().st_mtime >= started - 1 for dump in dumps)
        if err.signal_name != "SIGABRT" or not finished:
            raise
        warnings.warn(f"ignored a worker abort at exit after every rank finished: {err}", RuntimeWarning, stacklevel=2)


def load_rank_dumps(directory: str | Path, world_size: int = 2) -> list[dict[str, Any]]:
    return [torch.load(Path(directory) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
