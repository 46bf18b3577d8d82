"""``BatchSizeSearch``: the largest micro-batch that fits on every rank, found before training, batch kept."""

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.modules.batchnorm import SyncBatchNorm
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core.batch_split import batch_size_of, slice_batch
from lightning_mgpu.core.distributed_batchnorm import DistributedBatchNorm
from lightning_mgpu.core.step_pieces import LogCall, capture_logs
from lightning_mgpu.core.step_service import step_service
from lightning_mgpu.core.validation import check_int, check_str
from lightning_mgpu.fsdp.memory_planning import first_batch, untouched
from lightning_mgpu.memory.batch_search import SearchResult, search_micro_batch
from lightning_mgpu.memory.oom import is_out_of_memory, release_memory


class BatchSizeSearch(Callback):
    """Find the largest micro-batch that fits on every rank, and keep the batch per optimizer step by accumulation.

    Lightning's ``BatchSizeFinder`` refuses distributed strategies. This callback runs once, at the start of ``fit``
    (after the strategy has wrapped the model and before the training loader is built): it takes the first training
    batch and tries a forward and backward of the module's ``training_step`` on the configured per-device batch
    (read from the attribute ``batch_arg_name`` of the module, its hparams or the datamodule), then on ever smaller
    divisors of it (about halving), until one fits on every rank. An out-of-memory error, recognised as
    :class:`OOMBackoff` recognises them, means "does not fit". Each size costs one all-reduce of a flag, so every
    rank picks the same size.

    The trials run on the LightningModule itself, outside DDP's wrapper, so no gradient is reduced and a rank that
    fails leaves no collective waiting. The random generators, buffers (BatchNorm statistics) and gradients are put
    back and the trials' ``self.log`` calls dropped: when the configured batch fits, the run is the same as without
    the callback. Otherwise the attribute is set to the micro-batch and ``trainer.accumulate_grad_batches`` multiplied
    by ``batch // micro``: every optimizer step still sees the same samples, so a config's ``global_batch_size`` stays
    true (gradients equal up to float rounding, for a loss that is a mean over the batch). The size found goes into
    checkpoints; a resumed run uses it without searching.

    Args:
        batch_arg_name: the attribute holding the per-device batch size, as in Lightning's ``BatchSizeFinder``.
        min_size: the smallest micro-batch to try.

    Raises:
        MisconfigurationException: at ``setup``: manual optimization, a ``GradientAccumulationScheduler``, FSDP
            (its collectives run inside the forward, so a failing rank would leave the others waiting), or no
            attribute ``batch_arg_name``.
        BatchSizeSearchError: at the start of ``fit``, on every rank, when not even ``min_size`` fits.

    Example::

        trainer = Trainer(strategy="mgpu", devices=8, callbacks=[BatchSizeSearch()])
    """

    def __init__(self, batch_arg_name: str = "batch_size", min_size: int = 1) -> None:
        owner = type(self).__name__
        check_str(owner, "batch_arg_name", batch_arg_name)
        check_int(owner, "min_size", min_size, minimum=1)
        self.batch_arg_name = batch_arg_name
        self.min_size = min_size
        self.result: SearchResult | None = None
        self._found: tuple[int, int] | None = None  # (configured batch, micro-batch): searched, or from a checkpoint
        self._applied: tuple[int, int] | None = None  # (configured batch, accumulation factor) while a fit runs

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        compat.check_lightning_internals(trainer, type(self).__name__)
        if stage != "fit":
            return
        name = type(self).__name__
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                f"{name} needs automatic optimization: it keeps the batch by gradient accumulation, which manual "
                "optimization does itself."
            )
        self._refuse_sharding(trainer)
        if any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks):
            raise MisconfigurationException(
                f"{name} sets accumulate_grad_batches itself; remove the GradientAccumulationScheduler."
            )
        # converted after this hook: a synchronized BatchNorm's collective inside a failing trial would hang
        step_service(trainer).keep_batchnorm_local(f"{name} runs trials that may fail on one rank mid-forward")
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise MisconfigurationException(
                f"{name}(batch_arg_name={self.batch_arg_name!r}): neither the model, its hparams nor the datamodule "
                "has this attribute; give the name of the attribute your train_dataloader() reads its batch size from."
            )

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._refuse_sharding(trainer)  # again: a memory plan may have switched the strategy to FSDP since setup
        configured = int(lightning_getattr(pl_module, self.batch_arg_name))
        synced = [m for m in pl_module.modules() if isinstance(m, (SyncBatchNorm, DistributedBatchNorm))]
        if synced and trainer.world_size > 1:
            raise MisconfigurationException(
                f"{type(self).__name__} cannot search with synchronized BatchNorm ({type(synced[0]).__name__}): its "
                "collective runs inside the forward, so a rank that runs out of memory before it would leave the "
                "others waiting. Turn sync_batchnorm off, or remove the callback."
            )
        if self._found is not None and self._found[0] == configured:
            self._apply(trainer, pl_module, SearchResult(self._found[1], configured // self._found[1]))
            return
        batch = trainer.strategy.batch_to_device(first_batch(trainer))
        if batch_size_of(batch) != configured:
            raise MisconfigurationException(
                f"{type(self).__name__}: the training loader's first batch has {batch_size_of(batch)} samples, but "
                f"{self.batch_arg_name}={configured}; the train_dataloader must read its batch size from "
                f"{self.batch_arg_name!r} (the last batch of an epoch may be smaller; the first may not)."
            )
        result = search_micro_batch(
            configured,
            lambda size: self._fits(pl_module, slice_batch(batch, 0, size)),
            lambda fits: bool(trainer.strategy.reduce_boolean_decision(fits, all=True)),
            self.min_size,
        )
        self._apply(trainer, pl_module, result)
        tried = ", ".join(f"{size} {'fits' if fits else 'does not fit'}" for size, fits in result.trials)
        if result.accumulation == 1:
            rank_zero_info(f"{type(self).__name__}: the per-device batch {configured} fits ({tried}).")
        else:
            rank_zero_info(
                f"{type(self).__name__}: the per-device batch {configured} does not fit on every rank ({tried}); "
                f"micro-batch {result.size} x {result.accumulation} accumulated steps keeps it "
                f"(accumulate_grad_batches={trainer.accumulate_grad_batches})."
            )

    def _refuse_sharding(self, trainer: "pl.Trainer") -> None:
        if isinstance(trainer.strategy, ModelParallelStrategy):
            raise MisconfigurationException(
                f"{type(self).__name__} does not run under {type(trainer.strategy).__name__}: FSDP's collectives run "
                "inside the forward, so a rank that runs out of memory in a trial would leave the others waiting. "
                "Use MultiGPUStrategy(mode='auto', memory_budget_mb=...) to plan sharding and activation checkpointing."
            )

    def _fits(self, pl_module: "pl.LightningModule", piece: Any) -> bool:
        calls: list[LogCall] = []
        try:
            with untouched(pl_module), capture_logs(pl_module, calls, samples=1):
                output = pl_module.training_step(piece, 0)
                loss = output["loss"] if isinstance(output, dict) else output
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
                del output, loss
            return True
        except Exception as error:
            if not is_out_of_memory(error):
                raise
        release_memory()  # outside the except block, once the failed step's frames are gone
        return False

    def _apply(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", result: SearchResult) -> None:
        configured = int(lightning_getattr(pl_module, self.batch_arg_name))
        self.result = result
        self._found = (configured, result.size)
        if result.accumulation == 1:
            return
        lightning_setattr(pl_module, self.batch_arg_name, result.size)
        trainer.accumulate_grad_batches *= result.accumulation
        self._applied = (configured, result.accumulation)
        compat.rebuild_train_dataloader(trainer)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._undo(trainer, pl_module)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._undo(trainer, pl_module)

    def _undo(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # the next fit of this trainer and module starts from the configured batch again (and reuses what was found)
        if self._applied is None:
            return
        configured, accumulation = self._applied
        self._applied = None
        lightning_setattr(pl_module, self.batch_arg_name, configured)
        trainer.accumulate_grad_batches //= accumulation

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._found is None:
            return {}
        return {"configured_batch_size": self._found[0], "micro_batch_size": self._found[1]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "micro_batch_size" in state_dict:
            self._found = (int(state_dict["configured_batch_size"]), int(state_dict["micro_batch_size"]))
