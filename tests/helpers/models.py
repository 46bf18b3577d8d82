"""Small models and data for strategy tests, with exact single-process references."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

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

    def __init__(self, per_rank_batch: tuple[int, ...] = (8, 8), steps: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.per_rank_batch = tuple(per_rank_batch)
        self.steps = steps
        self.lr = lr
        torch.manual_seed(7)
        self.net = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        rank = self.global_rank if self._trainer is not None else 0
        x, y = global_data(sum(self.per_rank_batch) * self.steps)
        indices = [i for start, stop in rank_slices(self.per_rank_batch, self.steps)[rank] for i in range(start, stop)]
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
        }
        torch.save(state, Path(self.directory) / f"rank{trainer.global_rank}.pt")


def load_rank_dumps(directory: str | Path, world_size: int = 2) -> list[dict[str, Any]]:
    return [torch.load(Path(directory) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
