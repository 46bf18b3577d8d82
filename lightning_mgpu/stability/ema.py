"""An exponential moving average of the weights, kept as each rank's shards under FSDP, evaluated and checkpointed."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core.sharded_tensors import local_part
from lightning_mgpu.core.validation import check_bool, check_int, check_number
from lightning_mgpu.ddp.data_parallel import DataParallelStrategy
from lightning_mgpu.fsdp.fsdp import FSDPStrategy
from lightning_mgpu.fsdp.sharded_state import ShardedCallbackState, as_sharded_like

# parameters kept in these dtypes are averaged in float32: a bfloat16 average of steps of 1e-3 would not move
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _averaged_copy(param: Tensor) -> Tensor:
    return param.to(torch.float32, copy=True) if param.dtype in _LOW_PRECISION else param.clone()


class _Average:
    """The average of one fit: a tensor per parameter (this rank's shard under FSDP), and how often it moved."""

    def __init__(self, pl_module: "pl.LightningModule", sharded_saves: bool) -> None:
        self.module = pl_module
        self.sharded_saves = sharded_saves  # FSDPStrategy writes the shards; else the callback's state holds them
        self.names = [name for name, _ in pl_module.named_parameters()]
        self.weights = [_averaged_copy(local_part(param.detach())) for param in pl_module.parameters()]
        self.upcast = any(param.dtype in _LOW_PRECISION for param in pl_module.parameters())
        # this rank's part of each parameter, found at the first update and kept: the optimizer steps it in place.
        # Not earlier: FSDP's first forward may re-pad a shard into new memory
        self.params: list[Tensor] | None = None
        self.updates = 0
        self.last_step = -1

    def update(self, step: int, start_step: int, weight: float) -> None:
        """Copy the parameters (until ``start_step``) or move towards them by ``weight``: one multi-tensor kernel."""
        self.last_step = step
        if self.params is None:
            self.params = [local_part(param.detach()) for param in self.module.parameters()]
        params = self.params
        if self.upcast:
            params = [param.to(average.dtype) for param, average in zip(params, self.weights, strict=True)]
        if step <= start_step:
            compat.foreach_copy_(self.weights, params)
        else:
            compat.foreach_lerp_(self.weights, params, weight)
            self.updates += 1

    def parameters(self) -> list[Tensor]:
        """The local parts of the module's parameters, checked to be laid out as the average is.

        Raises:
            RuntimeError: the names or shard shapes changed since the average was made.
        """
        locals_ = [local_part(param.detach()) for param in self.module.parameters()]
        names = [name for name, _ in self.module.named_parameters()]
        if names != self.names or [t.shape for t in locals_] != [t.shape for t in self.weights]:
            raise RuntimeError(
                "EMA: the model's parameters no longer match the average's (names or shard shapes changed since it "
                "was made); an average is kept for one model laid out one way"
            )
        return locals_

    def restore(self, state: dict[str, Any]) -> None:
        """Take ``updates``/``last_step`` and, when present, the whole ``weights`` of a checkpoint."""
        self.updates = state.get("updates", 0)
        self.last_step = state.get("last_step", -1)
        weights = state.get("weights")
        if weights is None:
            return
        with torch.no_grad():
            for name, param, average in zip(self.names, self.module.parameters(), self.weights, strict=True):
                full = weights[name].to(average.device)
                if isinstance(param, DTensor):  # a one-file checkpoint of a sharded run: keep this rank's shard
                    full = distribute_tensor(full, param.device_mesh, param.placements).to_local()
                average.copy_(full)

    def sharded(self) -> dict[str, Tensor]:
        """The average as ``DTensor`` laid out as the parameters, under every name a parameter has."""
        by_param = {
            id(param): as_sharded_like(weight, param)
            for weight, param in zip(self.weights, self.module.parameters(), strict=True)
        }
        return {name: by_param[id(param)] for name, param in self.module.named_parameters(remove_duplicate=False)}


class EMA(ShardedCallbackState, Callback):
    """Keep an exponential moving average (EMA) of the weights, and validate, test and predict with it.

    After every ``every_n_steps``-th optimizer step each weight's average moves towards it:
    ``average = decay * average + (1 - decay) * weight``; until ``start_step`` optimizer steps have run it copies the
    weights instead. The update is one multi-tensor kernel on the device and adds no collective and no host sync.

    Under :class:`~lightning_mgpu.strategies.FSDPStrategy` (full, ``grad_op`` or hybrid sharding) each rank averages
    the shard of every parameter it holds, so the average costs one more copy of the shards, not of the model. Under
    DDP or one device it is a copy of the parameters.

    With ``evaluate=True`` the average is swapped into the model for ``validate``, ``test`` and ``predict`` (inside
    ``fit`` too) and the trained weights are put back afterwards, bit for bit.

    Checkpoints hold the average: under FSDP's distributed checkpoints as shards beside the model's (each rank writes
    its own), otherwise in the callback's state. A resumed fit continues the same average.
    ``python -m lightning_mgpu export CHECKPOINT OUT.pt --ema`` writes the averaged weights as a plain state dict.

    Parameters in float32 or float64 are averaged in their dtype; bfloat16 and float16 ones (``precision="bf16-true"``)
    in float32, where small steps still move the average. Lightning's own ``EMAWeightAveraging`` keeps a whole copy of
    the module (Lightning 2.6 and later) and leaves FSDP out; this one is for sharded runs as well.

    Args:
        decay: the weight of the past average, in (0, 1); 0.999 averages over about 1,000 updates.
        every_n_steps: update after every this many optimizer steps.
        start_step: copy the weights, without averaging, until this many optimizer steps have run.
        evaluate: validate, test and predict with the averaged weights.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: ``decay`` outside (0, 1), ``every_n_steps`` below 1 or a negative ``start_step``.
        MisconfigurationException: at ``setup``, a strategy other than one device, DataParallel, DDP or the pack's
            :class:`~lightning_mgpu.strategies.FSDPStrategy` (Lightning's FSDP, DeepSpeed and model-parallel
            strategies would save rank 0's shards only).

    Example::

        trainer = Trainer(strategy="mgpu_fsdp", devices=8, callbacks=[EMA(decay=0.999)])
    """

    def __init__(
        self, decay: float = 0.999, every_n_steps: int = 1, start_step: int = 0, evaluate: bool = True
    ) -> None:
        owner = type(self).__name__
        check_number(owner, "decay", decay, 0.0, 1.0, min_inclusive=False, max_inclusive=False, hint="e.g. 0.999")
        check_int(owner, "every_n_steps", every_n_steps, minimum=1)
        check_int(owner, "start_step", start_step, minimum=0)
        check_bool(owner, "evaluate", evaluate)
        self.decay = float(decay)
        self.every_n_steps = every_n_steps
        self.start_step = start_step
        self.evaluate = evaluate
        self._average: _Average | None = None
        self._restored: dict[str, Any] | None = None  # a checkpoint's full weights, applied at fit start
        self._held: list[Tensor] | None = None  # the trained weights while the average is in the model
        self._state_key = compat.callback_state_key(self, decay=self.decay, every_n_steps=self.every_n_steps)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key  # Lightning reads it at every hook call: made once

    @property
    def weights(self) -> dict[str, Tensor]:
        """The averaged weights by parameter name: this rank's shards under FSDP (empty before the first fit)."""
        if self._average is None:
            return {}
        return dict(zip(self._average.names, self._average.weights, strict=True))

    def full_weights(self) -> dict[str, Tensor]:
        """The averaged weights as whole tensors, under every name of each parameter (empty before the first fit).

        Under FSDP the shards are gathered: call it on every rank.
        """
        if self._average is None:
            return {}
        return {
            name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
            for name, tensor in self._average.sharded().items()
        }

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._check_strategy(trainer.strategy)
        if stage == "fit":
            self._average = None  # a new fit averages afresh, unless its checkpoint holds an average
            self._restored = None

    def _check_strategy(self, strategy: "pl.strategies.Strategy") -> None:
        # under FSDP1 or DeepSpeed a rank's parameters are views of flat shards, and Lightning's own sharded
        # strategies save a callback's state from rank 0 alone: an average there would be one rank's
        names = {cls.__name__ for cls in type(strategy).__mro__}
        known = isinstance(strategy, (FSDPStrategy, DataParallelStrategy, SingleDeviceStrategy, DDPStrategy))
        if not known or "DeepSpeedStrategy" in names:
            raise MisconfigurationException(
                f"{type(self).__name__} averages the weights under one device, DataParallel, DDP or the pack's "
                f"FSDPStrategy, which save each rank's shards; got {type(strategy).__name__}. Use strategy='mgpu' or "
                "strategy='mgpu_fsdp' (MultiGPUStrategy(mode='fsdp')) for a sharded model."
            )

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # after every checkpoint is loaded (FSDP loads after on_fit_start): a fit that resumes from a checkpoint
        # without an average starts one from the weights it resumed, not from those it was built with
        self._ensure(trainer, pl_module)

    def _ensure(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> _Average:
        if self._average is None:
            strategy = trainer.strategy
            sharded_saves = isinstance(strategy, FSDPStrategy) and strategy.distributed_saves
            self._average = _Average(pl_module, sharded_saves)
        if self._restored is not None:
            self._average.restore(self._restored)
            self._restored = None
        return self._average

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        average, step = self._average, trainer.global_step
        if average is None or step == average.last_step or step % self.every_n_steps:
            return
        average.update(step, self.start_step, 1.0 - self.decay)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._swap_in(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._swap_out()

    @override
    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._swap_in(trainer, pl_module)

    @override
    def on_test_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._swap_out()

    @override
    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._swap_in(trainer, pl_module)

    @override
    def on_predict_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._swap_out()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._swap_out()  # an evaluation that raised leaves the trained weights in the model

    def _swap_in(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # outside a fit there is an average only from an earlier fit of this callback or from a checkpoint
        if self.evaluate and self._held is None and (self._average is not None or self._restored is not None):
            average = self._ensure(trainer, pl_module)
            with _resharded(average.module), torch.no_grad():  # FSDP gathers units from the shards: none stale
                params = average.parameters()
                self._held = [param.clone() for param in params]
                compat.foreach_copy_(params, average.weights)

    def _swap_out(self) -> None:
        if self._held is not None:
            with _resharded(self._average.module), torch.no_grad():
                compat.foreach_copy_(self._average.parameters(), self._held)
            self._held = None

    @override
    def sharded_state_dict(self, pl_module: "pl.LightningModule") -> dict[str, Tensor]:
        """The average's shards as ``DTensor`` laid out as the parameters, under every name a parameter has."""
        return self._ensure(pl_module.trainer, pl_module).sharded()

    @override
    def state_dict(self) -> dict[str, Any]:
        average = self._average
        if average is None:  # a checkpoint's state not applied yet is kept as it came
            return dict(self._restored) if self._restored is not None else {}
        state: dict[str, Any] = {"updates": average.updates, "last_step": average.last_step}
        if not average.sharded_saves:  # gathered from the shards under FSDP: collectives on every rank
            state["weights"] = self.full_weights()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self._average is not None:  # under FSDP, after the strategy loaded the shards into it
            self._average.restore(state_dict)
        else:
            self._restored = dict(state_dict)  # applied once the parameters are laid out


@contextmanager
def _resharded(pl_module: "pl.LightningModule") -> Iterator[None]:
    def reshard() -> None:
        for module in pl_module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    reshard()
    yield
    reshard()
