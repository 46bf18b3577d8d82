"""A regression model that runs out of memory on purpose, with the real exception a CUDA allocation failure raises.

``IndexedRegression`` trains on ``(index, x, y)`` samples and records which sample indices its steps saw: in a
torchmetrics ``CatMetric`` (a side effect OOMBackoff undoes after a failed attempt) and in a plain Python list
(which it cannot undo). Out-of-memory errors are injected where a real one strikes: in the forward (after a
BatchNorm layer updated its statistics), in the backward, in ``optimizer.step``, or in validation / predict.
"""

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MeanSquaredError
from torchmetrics.aggregation import CatMetric

# the message of a real allocation failure on an H100 (torch 2.x), raised with its real type
OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.06 GiB is"
    " free. Including non-PyTorch memory, this process has 78.03 GiB memory in use. Of the allocated memory 76.50 GiB"
    " is allocated by PyTorch, and 1.02 GiB is reserved by PyTorch but unallocated. If reserved but unallocated"
    " memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See"
    " documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def raise_oom() -> None:
    raise torch.cuda.OutOfMemoryError(OOM_MESSAGE)


class _OOMInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise_oom()
        return grad


class IndexedData(Dataset):
    def __init__(self, num_samples: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, 4, generator=generator)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
            num_samples, 1, generator=generator
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, Tensor, Tensor]:
        return index, self.x[index], self.y[index]


class FlakySGD(torch.optim.SGD):
    """SGD whose ``fail_at_call``-th step runs out of memory after its closure finished."""

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, fail_at_call: int | None = None) -> None:
        super().__init__(params, lr=lr, momentum=momentum)
        self.fail_at_call = fail_at_call
        self.calls = 0

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.calls += 1
        if self.fail_at_call is not None and self.calls == self.fail_at_call:
            raise_oom()
        super().step()
        return loss


class IndexedRegression(pl.LightningModule):
    """Args:
    oom_above: a training micro-batch larger than this runs out of memory (``None``: never).
    oom_in: ``"forward"`` or ``"backward"``.
    oom_ranks: the global ranks that run out of memory (``None``: every rank).
    oom_until_step: stop injecting from this global step on (``None``: always).
    oom_from_step: inject only from this global step on.
    oom_from_batch: inject only from this batch index of each epoch on.
    oom_batches: inject only at these batch indices of each epoch (``None``: every one from ``oom_from_batch`` on).
    eval_oom_above: a validation / predict batch larger than this runs out of memory.
    step_oom_at: the optimizer step call (1-based) that runs out of memory, on ``oom_ranks``.
    """

    def __init__(
        self,
        num_samples: int = 32,
        batch_size: int = 8,
        oom_above: int | None = None,
        oom_in: str = "forward",
        oom_ranks: tuple[int, ...] | None = None,
        oom_until_step: int | None = None,
        oom_from_step: int = 0,
        oom_from_batch: int = 0,
        oom_batches: tuple[int, ...] | None = None,
        eval_oom_above: int | None = None,
        step_oom_at: int | None = None,
        batchnorm: bool = False,
        lr: float = 0.05,
        momentum: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_samples, self.batch_size = num_samples, batch_size
        self.oom_above, self.oom_in, self.oom_ranks, self.oom_until_step = oom_above, oom_in, oom_ranks, oom_until_step
        self.oom_from_batch, self.oom_batches, self.oom_from_step = oom_from_batch, oom_batches, oom_from_step
        self.eval_oom_above, self.step_oom_at = eval_oom_above, step_oom_at
        self.lr, self.momentum = lr, momentum
        torch.manual_seed(7)
        self.hidden = nn.Linear(4, 16)
        self.norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.head = nn.Linear(16, 1)
        self.index_metric = CatMetric(sync_on_compute=False)
        self.val_mse = MeanSquaredError()
        self.seen: list[list[int]] = []
        self.epoch_indices: list[list[int]] = []

    def _rank_injects(self) -> bool:
        return self.oom_ranks is None or self.global_rank in self.oom_ranks

    def _injects(self, samples: int, batch_idx: int) -> bool:
        if self.oom_above is None or samples <= self.oom_above or not self._rank_injects():
            return False
        if batch_idx < self.oom_from_batch or (self.oom_batches is not None and batch_idx not in self.oom_batches):
            return False
        if self.trainer.global_step < self.oom_from_step:
            return False
        return self.oom_until_step is None or self.trainer.global_step < self.oom_until_step

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.norm(self.hidden(x))))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        index, x, y = batch
        features = self.norm(self.hidden(x))  # BatchNorm statistics move before the OOM strikes
        self.index_metric.update(index.float())
        if self.oom_in == "forward" and self._injects(len(x), batch_idx):
            raise_oom()
        if self.oom_in == "backward" and self._injects(len(x), batch_idx):
            # mid-network: the head's gradients are accumulated before the backward fails
            features = _OOMInBackward.apply(features)
        loss = nn.functional.mse_loss(self.head(torch.tanh(features)), y)
        self.seen.append(index.tolist())
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("samples", float(len(x)), reduce_fx="sum", on_step=True, on_epoch=False)
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_indices.append(sorted(int(i) for i in self.index_metric.compute().tolist()))
        self.index_metric.reset()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        prediction = self(x)
        self.val_mse.update(prediction, y)
        if self.eval_oom_above is not None and len(x) > self.eval_oom_above:
            raise_oom()
        self.log("val_loss", nn.functional.mse_loss(prediction, y))
        self.log("val_mse", self.val_mse)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        _, x, _ = batch
        if self.eval_oom_above is not None and len(x) > self.eval_oom_above:
            raise_oom()
        return self(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        fail_at = self.step_oom_at if self._rank_injects() else None
        return FlakySGD(self.parameters(), lr=self.lr, momentum=self.momentum, fail_at_call=fail_at)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedData(self.num_samples), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedData(16, seed=1), batch_size=8, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(IndexedData(16, seed=1), batch_size=8, shuffle=False)
