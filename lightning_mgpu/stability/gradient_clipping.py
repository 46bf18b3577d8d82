"""Gradient clipping by norm, by value, unit-wise adaptive (AGC) or against running norm statistics (z-score)."""

import copy
import fnmatch
from collections.abc import Sequence
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.core._logging import (
    has_progress_bar,
    show_in_progress_bar,
)
from lightning_mgpu.core.sharded_tensors import local_part
from lightning_mgpu.core.step_service import StepService, step_service
from lightning_mgpu.core.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positive,
    check_sequence,
)
from lightning_mgpu.stability._amp import params_to_step
from lightning_mgpu.stability.clip_grad import (
    GradNormStatistics,
    adaptive_clip_grads_,
    scale_to_max_norm_,
    total_grad_norm,
    zscore_clip_grads_,
)

ClipMode = Literal["norm", "value", "agc", "zscore"]
CLIP_MODES: tuple[str, ...] = get_args(ClipMode)
# option -> the mode it belongs to, and its default there (None: required)
_MODE_OPTIONS: dict[str, tuple[str, float | int | None]] = {
    "max_norm": ("norm", None),
    "clip_value": ("value", None),
    "clip_factor": ("agc", 0.01),
    "eps": ("agc", 1e-3),
    "z_threshold": ("zscore", 2.5),
    "warmup_steps": ("zscore", 25),
    "decay": ("zscore", 0.97),
}


class GradientClipping(Callback):
    """Clip gradients before every optimizer step, and log their norm.

    Runs in ``on_before_optimizer_step``: after Lightning has unscaled AMP gradients, before the optimizer step,
    once per optimizer step (with gradient accumulation, on the accumulated gradients). On an accelerator every
    decision is made on the device, so it adds no host-device synchronisation. On the CPU, where reading a value is
    a memory load, ``norm`` and ``zscore`` read the norm and skip the pass over the gradients on a step they do not
    clip.

    - ``mode="norm"``: scale all gradients so that their total ``norm_type``-norm is at most ``max_norm``; the same
      parameters as ``Trainer(gradient_clip_val=max_norm, gradient_clip_algorithm="norm")``.
    - ``mode="value"``: clamp every gradient element to ``[-clip_value, clip_value]``; the same as
      ``Trainer(gradient_clip_val=clip_value, gradient_clip_algorithm="value")``.
    - ``mode="agc"``: unit-wise adaptive clipping (Brock et al., 2021, NFNets): each unit's gradient norm is
      clipped to ``clip_factor * max(||unit weights||, eps)``. Parameters whose name matches a pattern of
      ``exclude`` are left alone; the paper leaves the final classifier unclipped.
    - ``mode="zscore"``: after ``warmup_steps`` steps that only gather statistics, scale the gradients down to
      ``mean + z_threshold * std`` of the recent total norms whenever their norm exceeds it. The statistics (a
      moving average with weight ``decay`` for the past) are updated with the clipped norm, and saved in
      checkpoints.

    Logged keys, on the steps Lightning's loggers write (every ``log_every_n_steps``), unitless norms:

    - ``grad_norm``: total ``norm_type``-norm of the gradients before clipping.
    - ``grad_norm_threshold`` (``zscore`` only): the norm the gradients were clipped to at most; ``inf`` during
      warm-up.

    Progress bar field, with ``progress_bar=True`` and a Trainer that draws a bar: ``grad_norm``, the same norm before
    clipping, refreshed at the end of the same logging steps (never with ``log_every_n_steps=0``). The norm is read
    from the device then, once, after the optimizer step: where Lightning's loggers read it anyway when ``log_norm``
    is on and a logger is set, and one read every ``log_every_n_steps`` steps otherwise. It is not sent to the
    loggers.

    Args:
        mode: ``"norm"``, ``"value"``, ``"agc"`` or ``"zscore"``.
        max_norm: ``norm``: the largest total norm.
        norm_type: the p of the p-norm used for ``norm``, ``zscore`` and the logged norm.
        clip_value: ``value``: the largest absolute gradient value.
        clip_factor: ``agc``: largest gradient-to-weight norm ratio per unit (default 0.01).
        eps: ``agc``: floor of the weight norm (default 1e-3).
        exclude: ``agc``: parameter name patterns (``fnmatch``, e.g. ``"head.*"``) not to clip.
        z_threshold: ``zscore``: standard deviations above the mean (default 2.5).
        warmup_steps: ``zscore``: steps that only gather statistics (default 25).
        decay: ``zscore``: weight of the past in the moving statistics (default 0.97).
        log_norm: log the keys above.
        progress_bar: show ``grad_norm`` in the progress bar.

    Raises:
        TypeError: an option of the wrong type: a ``mode`` that is not a string, a threshold that is not a number, a
            ``warmup_steps`` that is not an int, an ``exclude`` that is not a list of strings, or a ``log_norm`` or
            ``progress_bar`` that is not a bool.
        ValueError: an unknown mode, a missing or non-positive threshold, a negative ``warmup_steps``, a ``decay``
            outside (0, 1), or an option of another mode.
        MisconfigurationException: at ``setup``, if ``Trainer(gradient_clip_val=...)`` also clips.

    Example::

        trainer = Trainer(callbacks=[GradientClipping(mode="norm", max_norm=1.0)])
        trainer = Trainer(callbacks=[GradientClipping(mode="agc", clip_factor=0.01, exclude=["head.*"])])
        trainer = Trainer(callbacks=[GradientClipping(mode="zscore", z_threshold=2.5)])
    """

    def __init__(
        self,
        mode: ClipMode = "norm",
        max_norm: float | None = None,
        norm_type: float = 2.0,
        clip_value: float | None = None,
        clip_factor: float | None = None,
        eps: float | None = None,
        exclude: Sequence[str] = (),
        z_threshold: float | None = None,
        warmup_steps: int | None = None,
        decay: float | None = None,
        log_norm: bool = True,
        progress_bar: bool = True,
    ) -> None:
        owner = type(self).__name__
        check_choice(owner, "mode", mode, CLIP_MODES)
        given = {
            "max_norm": max_norm,
            "clip_value": clip_value,
            "clip_factor": clip_factor,
            "eps": eps,
            "z_threshold": z_threshold,
            "warmup_steps": warmup_steps,
            "decay": decay,
        }
        options: dict[str, Any] = {}
        for name, value in given.items():
            option_mode, default = _MODE_OPTIONS[name]
            if option_mode != mode:
                if value is not None:
                    raise ValueError(f"{owner}: {name} belongs to mode={option_mode!r}, not mode={mode!r}")
                continue
            if value is None and default is None:
                raise ValueError(f"{owner}(mode={mode!r}) needs {name}, a positive number")
            options[name] = default if value is None else value
        check_positive(owner, "norm_type", norm_type, allow_inf=True)
        for name in ("max_norm", "clip_value", "clip_factor", "eps", "z_threshold"):
            if name in options:
                check_positive(owner, name, options[name])
        if "warmup_steps" in options:
            check_int(owner, "warmup_steps", options["warmup_steps"], minimum=0)
        if "decay" in options:
            check_number(owner, "decay", options["decay"], 0, 1, min_inclusive=False, max_inclusive=False)
        exclude = check_sequence(owner, "exclude", exclude, "name patterns", item_type=str)
        if exclude and mode != "agc":
            raise ValueError(f"{owner}: exclude belongs to mode='agc', not mode={mode!r}")
        check_bool(owner, "log_norm", log_norm)
        check_bool(owner, "progress_bar", progress_bar)

        self.mode = mode
        self.norm_type = float(norm_type)
        self.options = options
        self.exclude = tuple(exclude)
        self.log_norm = log_norm
        self.progress_bar = progress_bar
        self.statistics = GradNormStatistics(decay=options.get("decay", 0.97))
        self._excluded_ids: set[int] = set()
        self._warned_unmatched = False
        self._state_key: str | None = None
        self._bar_norm: Tensor | None = None  # the norm of a logging step, for the bar at the end of its batch
        self._service: StepService | None = None  # the fit's: the step's norms and NaNSkip's verdict, shared

    @property
    @override
    def state_key(self) -> str:
        # Lightning reads this for every hook it calls: build it once
        if self._state_key is None:
            self._state_key = compat.callback_state_key(self, mode=self.mode, **self.options)
        return self._state_key

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        compat.check_lightning_internals(trainer, type(self).__name__)
        if trainer.gradient_clip_val:
            raise MisconfigurationException(
                f"{type(self).__name__}(mode={self.mode!r}) and Trainer(gradient_clip_val={trainer.gradient_clip_val})"
                " both clip gradients; keep one of them."
            )
        self._check_sharding(trainer)

    def _check_sharding(self, trainer: "pl.Trainer") -> None:
        if isinstance(trainer.strategy, ModelParallelStrategy) and (self.mode == "agc" or self.norm_type != 2.0):
            raise MisconfigurationException(
                f"{type(self).__name__}(mode={self.mode!r}, norm_type={self.norm_type}) is not supported under "
                f"{type(trainer.strategy).__name__}, where each rank holds shards of the gradients: use mode='norm', "
                "'zscore' (2-norms over all shards) or 'value'."
            )

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._check_sharding(trainer)  # again: a memory plan may have switched the strategy to FSDP since setup
        self._service = step_service(trainer)
        # after configure_model, which may build layers (the classifier to exclude, say) after setup
        names = [name for name, _ in pl_module.named_parameters()]
        matched = {pattern: [n for n in names if fnmatch.fnmatchcase(n, pattern)] for pattern in self.exclude}
        self._excluded_ids = {
            id(param)
            for name, param in pl_module.named_parameters()
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude)
        }
        self._bar_norm = None
        unmatched = [pattern for pattern, found in matched.items() if not found]
        if unmatched and not self._warned_unmatched:
            self._warned_unmatched = True
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            rank_zero_warn(
                f"{type(self).__name__}(mode='agc'): exclude pattern(s) {unmatched} match no parameter of "
                f"{type(pl_module).__name__}, so those layers are clipped too. Parameter names look like: {shown}"
            )

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer
    ) -> None:
        params = params_to_step(trainer, optimizer)
        if not params:
            return
        if self._service is None:  # added to the trainer after its fit started
            self._service = step_service(trainer)
        norm, threshold = self._clip(optimizer, params, trainer.global_step)
        if not compat.is_logging_step(trainer):
            return
        if self.log_norm:
            pl_module.log("grad_norm", norm, on_step=True, on_epoch=False)
            if threshold is not None:  # inf during warm-up: deciding that on the host would need a device read
                pl_module.log("grad_norm_threshold", threshold, on_step=True, on_epoch=False)
        if self.progress_bar and has_progress_bar(trainer):
            self._bar_norm = norm  # read at the end of the batch, once the optimizer step is queued, not before it

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._bar_norm is None:
            return
        norm, self._bar_norm = self._bar_norm, None
        show_in_progress_bar(pl_module, "grad_norm", float(norm))

    def _clip(self, optimizer: Optimizer, params: list[Tensor], step: int) -> tuple[Tensor, Tensor | None]:
        grads = [local_part(p.grad) for p in params]  # scaled in place: under FSDP, this rank's shards
        # per-gradient norms shared with NaNSkip, read before clipping changes anything (value clipping turns an
        # Inf into clip_value): one pass over the gradients per step, whatever the callbacks' order
        service = self._service
        assert service is not None
        norms = service.gradient_norms(optimizer, params, step)
        norm = torch.linalg.vector_norm(norms) if self.norm_type == 2.0 else total_grad_norm(grads, self.norm_type)
        if self.mode == "norm":
            scale_to_max_norm_(grads, norm, self.options["max_norm"])
            return norm, None
        if self.mode == "zscore":
            # NaNSkip's verdict, taken now if it has not been (before these gradients are scaled)
            skipped = service.step_is_bad(optimizer, params, step)
            return zscore_clip_grads_(
                grads,
                self.statistics,
                self.options["z_threshold"],
                self.options["warmup_steps"],
                norm=norm,
                skipped=skipped,
            )
        if self.mode == "value":
            torch.nn.utils.clip_grad_value_(params, self.options["clip_value"])
        else:
            kept = [p for p in params if id(p) not in self._excluded_ids]
            adaptive_clip_grads_(kept, self.options["clip_factor"], self.options["eps"])
        return norm, None

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._service is not None:
            self._service.new_gradients()  # norms and verdicts taken for an earlier backward are stale

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._service = None

    def _rollback_state(self) -> GradNormStatistics:
        """What NaNSkip's rollback saves of this callback (a copy of the z-score statistics)."""
        return copy.deepcopy(self.statistics)

    def _load_rollback_state(self, statistics: GradNormStatistics) -> None:
        self.statistics = statistics

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"statistics": self.statistics.state_dict()} if self.mode == "zscore" else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.mode == "zscore" and "statistics" in state_dict:
            self.statistics.load_state_dict(state_dict["statistics"])
