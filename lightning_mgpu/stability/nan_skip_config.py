"""NaNSkip's options: what each allows, checked once when the callback is built."""

from dataclasses import dataclass
from typing import Literal, get_args

from lightning_mgpu.core.validation import check_bool, check_choice, check_int, check_positive

CheckTarget = Literal["loss", "grads", "both"]
CHECK_TARGETS: tuple[str, ...] = get_args(CheckTarget)
SpikeTarget = Literal["loss", "grad_norm", "both"]
SPIKE_TARGETS: tuple[str, ...] = get_args(SpikeTarget)
SpikeAction = Literal["skip", "rollback"]
SPIKE_ACTIONS: tuple[str, ...] = get_args(SpikeAction)


@dataclass(frozen=True)
class NaNSkipConfig:
    """The options of :class:`~lightning_mgpu.NaNSkip`, as given (its docstring says what each does).

    Call :meth:`validate` once, where the options come in; the rest of the callback reads them from here. Every field
    is required: the defaults are the callback's signature's alone.
    """

    check: CheckTarget
    max_consecutive: int | None
    log_skipped: bool
    progress_bar: bool
    spike_zscore: float | None
    spike_window: int
    spike_on: SpikeTarget
    spike_action: SpikeAction
    snapshot_every: int
    max_rollbacks: int | None
    skip_on_device: bool | Literal["auto"]

    def validate(self, owner: str) -> None:
        """Raise ``TypeError``/``ValueError`` naming ``owner``, the option and its value for the first bad option."""
        check_choice(owner, "check", self.check, CHECK_TARGETS)
        no_limit = "use None for no limit"
        check_int(owner, "max_consecutive", self.max_consecutive, minimum=1, allow_none=True, hint=no_limit)
        check_bool(owner, "log_skipped", self.log_skipped)
        check_bool(owner, "progress_bar", self.progress_bar)
        check_positive(owner, "spike_zscore", self.spike_zscore, allow_none=True, hint="use None to turn spikes off")
        check_int(owner, "spike_window", self.spike_window, minimum=2)
        check_choice(owner, "spike_on", self.spike_on, SPIKE_TARGETS)
        check_choice(owner, "spike_action", self.spike_action, SPIKE_ACTIONS)
        check_int(owner, "snapshot_every", self.snapshot_every, minimum=1)
        check_int(owner, "max_rollbacks", self.max_rollbacks, minimum=1, allow_none=True, hint=no_limit)
        check_choice(owner, "skip_on_device", self.skip_on_device, ("auto", True, False))

    @property
    def loss_spikes(self) -> bool:
        """Whether the loss is tested for spikes."""
        return self.spike_zscore is not None and self.spike_on != "grad_norm"

    @property
    def norm_spikes(self) -> bool:
        """Whether the gradient norms are tested for spikes."""
        return self.spike_zscore is not None and self.spike_on != "loss"

    @property
    def rollback(self) -> bool:
        """Whether a bad step rolls training back to the last snapshot."""
        return self.spike_action == "rollback"
