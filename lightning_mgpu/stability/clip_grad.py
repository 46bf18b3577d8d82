"""Gradient clipping as pure functions on tensors, decided on the device: no host synchronisation.

Every function takes gradients (or parameters with gradients) and changes them in place; none reads a tensor's
value on the host, so on CUDA a step costs a few kernels and no ``cudaStreamSynchronize``.
"""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_mgpu.core import compat
from lightning_mgpu.core.validation import check_number


def total_grad_norm(grads: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """The norm of all ``grads`` taken together, as one 0-dim tensor on their device, in fp32 or wider.

    Args:
        grads: the gradients.
        norm_type: the p of the p-norm; ``float("inf")`` for the max norm.

    Example::

        >>> total_grad_norm([torch.tensor([3.0]), torch.tensor([4.0])])
        tensor(5.)
    """
    if not grads:
        return torch.zeros(())
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6: grouped foreach kernels
    if get_total_norm is not None:
        return get_total_norm(list(grads), norm_type).float()
    norms = [torch.linalg.vector_norm(g.float(), norm_type).to(grads[0].device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def scale_grads_(grads: Sequence[Tensor], coefficient: Tensor) -> None:
    """Multiply every gradient in place by a 0-dim ``coefficient`` tensor.

    Args:
        grads: the gradients.
        coefficient: the factor, on the gradients' device.
    """
    if grads:
        compat.foreach_mul_(list(grads), coefficient.to(grads[0].device))


def clip_grads_by_norm_(grads: Sequence[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scale ``grads`` so that their total norm is at most ``max_norm``; return the norm before clipping.

    The same arithmetic as ``torch.nn.utils.clip_grad_norm_`` (and so as ``Trainer(gradient_clip_val=...)``):
    coefficient ``max_norm / (norm + 1e-6)``, clamped to at most 1.

    Args:
        grads: the gradients.
        max_norm: the largest allowed total norm.
        norm_type: the p of the p-norm.

    Example::

        >>> grads = [torch.tensor([3.0, 4.0])]
        >>> clip_grads_by_norm_(grads, max_norm=1.0)
        tensor(5.)
        >>> grads[0]
        tensor([0.6000, 0.8000])
    """
    norm = total_grad_norm(grads, norm_type)
    scale_to_max_norm_(grads, norm, max_norm)
    return norm


def scale_to_max_norm_(grads: Sequence[Tensor], norm: Tensor, max_norm: float) -> None:
    """Scale ``grads``, whose total norm is ``norm``, by ``torch.clamp(max_norm / (norm + 1e-6), max=1.0)``.

    On an accelerator, always, with no host read. On the CPU, where reading the coefficient is a memory load and not
    a synchronisation, the pass over the gradients is saved on a step whose coefficient is 1 (multiplying by 1.0
    changes nothing): the same gradients, bit for bit.

    Args:
        grads: the gradients.
        norm: their total norm (0-dim).
        max_norm: the largest allowed total norm.
    """
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if norm.device.type == "cpu" and float(coefficient) >= 1.0:  # a NaN coefficient is applied, as torch does
        return
    scale_grads_(grads, coefficient)


def unitwise_norm(tensor: Tensor) -> Tensor:
    """Norm per output unit: over all dims but the first for a matrix or kernel, over everything for a vector.

    Args:
        tensor: a parameter or its gradient.

    Example::

        >>> unitwise_norm(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        tensor([[5.],
                [1.]])
    """
    if tensor.dim() <= 1:
        return torch.linalg.vector_norm(tensor.float())
    return torch.linalg.vector_norm(tensor.float(), dim=tuple(range(1, tensor.dim())), keepdim=True)


def adaptive_clip_grads_(params: Sequence[Tensor], clip_factor: float = 0.01, eps: float = 1e-3) -> None:
    """Unit-wise adaptive gradient clipping (AGC, Brock et al. 2021) of ``params``' gradients, in place.

    For every unit (an output row of a weight), the gradient's norm is clipped to
    ``clip_factor * max(||unit weights||, eps)``: a gradient may change a unit by at most that fraction.

    Args:
        params: parameters whose ``.grad`` is set.
        clip_factor: the largest allowed ratio of gradient norm to weight norm, per unit.
        eps: floor of the weight norm, so that units initialised at zero can still move.

    Example::

        >>> weight = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))
        >>> weight.grad = torch.tensor([[0.6, 0.8]])
        >>> adaptive_clip_grads_([weight], clip_factor=0.1)
        >>> weight.grad
        tensor([[0.3000, 0.4000]])
    """
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        max_norm = unitwise_norm(param.detach()).clamp(min=eps) * clip_factor
        grad_norm = unitwise_norm(grad)
        scale = torch.where(grad_norm > max_norm, max_norm / grad_norm.clamp(min=1e-6), torch.ones_like(grad_norm))
        grad.mul_(scale.to(grad.dtype))


class GradNormStatistics:
    """Running mean and variance of the total gradient norm, for z-score clipping, kept where the gradients are.

    The weight of a new observation is ``max(1 - decay, 1 / n)`` for the n-th: an exact average while few
    norms have been seen, an exponential moving average afterwards. A non-finite norm changes nothing, not even the
    count, so a step that another callback skips for NaN leaves no trace, whatever the callbacks' order.

    On an accelerator, count, mean and variance are 0-dim float32 tensors on the device, updated by eleven small
    device ops a step: nothing here reads a value on the host. On the CPU the device is the host, so they are plain
    Python numbers (double precision), and a norm is read as one (a memory load, not a synchronisation: what
    ``torch.optim`` does with its CPU step counts). Eleven tensor ops cost the CPU 50-100 us a step in a training
    loop (dispatch, not arithmetic); the numbers cost a few.

    Args:
        decay: weight of the past in the moving average, in (0, 1).

    Raises:
        TypeError: a ``decay`` that is not a number.
        ValueError: a ``decay`` outside (0, 1).

    Example::

        >>> stats = GradNormStatistics(decay=0.9)
        >>> for norm in (1.0, 3.0):
        ...     stats.update(torch.tensor(norm))
        >>> float(stats.mean), float(stats.var)
        (2.0, 1.0)
    """

    # device types whose statistics are host numbers; tests empty it to run the device arithmetic on the CPU
    _host_device_types: tuple[str, ...] = ("cpu",)

    def __init__(self, decay: float = 0.97) -> None:
        check_number(type(self).__name__, "decay", decay, 0.0, 1.0, min_inclusive=False, max_inclusive=False)
        self.decay = decay
        # host numbers until the first norm comes from an accelerator. On a device, float32 like the mean: no dtype
        # conversion per step, exact up to 2**24 accepted norms (where it stops counting; the weight is 1 - decay
        # long before that)
        self.count: Tensor | float = 0.0
        self.mean: Tensor | float = 0.0
        self.var: Tensor | float = 0.0

    @property
    def on_host(self) -> bool:
        """Whether the statistics are host numbers (the gradients are on the CPU) rather than device tensors."""
        return not isinstance(self.mean, Tensor)

    def to(self, device: torch.device) -> None:
        """Keep the statistics where ``device``'s gradients need them; a no-op where they are already.

        A move reads the statistics once (from the device when they leave one).
        """
        host = device.type in self._host_device_types
        if host == self.on_host and (host or self.mean.device == device):
            return
        values = (float(self.count), float(self.mean), float(self.var))
        if host:
            self.count, self.mean, self.var = values
        else:
            self.count, self.mean, self.var = (
                torch.tensor(value, dtype=torch.float32, device=device) for value in values
            )

    def update(self, norm: Tensor, accept: Tensor | None = None) -> None:
        """Fold one observed norm into the statistics; a NaN or Inf, or a norm ``accept`` turns down, changes nothing.

        Args:
            norm: the observed norm (0-dim).
            accept: a boolean tensor, false to leave the norm out; ``None`` to take every finite norm. A non-finite
                norm is left out either way.
        """
        self.to(norm.device)
        if self.on_host:
            value = float(norm)
            self._fold_number(value, math.isfinite(value) and (accept is None or bool(accept)))
            return
        norm = norm.float()
        finite = torch.isfinite(norm)
        self._fold(norm, finite if accept is None else finite & accept)

    def _fold(self, value: Tensor, accept: Tensor) -> None:
        """:meth:`update` on the device, for a float32 ``value`` known finite wherever ``accept`` (a boolean) is true.

        Eleven small device ops: a weight of 0 leaves the mean and the variance exactly as they were, and a value left
        out is replaced by the mean, so no NaN or Inf reaches the arithmetic.
        """
        count = self.count + accept
        # max(1 / n, 1 - decay) for the n-th accepted norm; a count still at 0 gives 1 / 0 = inf, clamped to 1, times 0
        weight = torch.clamp(count.reciprocal(), min=1.0 - self.decay, max=1.0) * accept
        value = torch.where(accept, value, self.mean)
        delta = value - self.mean
        # (1 - w) * (var + w * delta**2): a variance that overflowed stays inf (clipping off) rather than NaN, and the
        # first accepted norm gives exactly 0
        self.var = (1.0 - weight) * torch.addcmul(self.var, weight * delta, delta)
        self.mean, self.count = torch.addcmul(self.mean, weight, delta), count

    def _fold_number(self, value: float, accept: bool) -> None:
        """:meth:`_fold` on the host: the same arithmetic on Python numbers."""
        if not accept:
            return
        self.count += 1
        weight = max(1.0 / self.count, 1.0 - self.decay)
        delta = value - self.mean
        self.var = (1.0 - weight) * (self.var + weight * delta * delta)
        self.mean += weight * delta

    def threshold(self, z_threshold: float, warmup_steps: int) -> Tensor | float:
        """``mean + z_threshold * std``, or ``inf`` while fewer than ``warmup_steps`` norms have been seen.

        A device tensor, or a number where the statistics are host numbers.
        """
        if self.on_host:
            return self.mean + z_threshold * math.sqrt(self.var) if self.count >= warmup_steps else math.inf
        return torch.where(
            self.count >= warmup_steps, torch.add(self.mean, self.var.sqrt(), alpha=z_threshold), math.inf
        )

    def state_dict(self) -> dict[str, float | int]:
        """Plain numbers for a checkpoint (reads the device once, at checkpoint time)."""
        return {"count": int(self.count), "mean": float(self.mean), "var": float(self.var)}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; missing keys keep their current values."""
        values = (float(int(state.get("count", self.count))), float(state.get("mean", self.mean)))
        values += (float(state.get("var", self.var)),)
        if self.on_host:
            self.count, self.mean, self.var = values
        else:
            self.count, self.mean, self.var = (
                torch.tensor(value, dtype=torch.float32, device=self.mean.device) for value in values
            )


def zscore_clip_grads_(
    grads: Sequence[Tensor],
    stats: GradNormStatistics,
    z_threshold: float,
    warmup_steps: int,
    norm_type: float = 2.0,
    norm: Tensor | None = None,
    skipped: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Clip ``grads`` to ``mean + z * std`` of recent total norms once ``warmup_steps`` norms have been seen.

    The statistics are then updated with the norm after clipping, so that one spike does not inflate them, unless
    the step is ``skipped``. Whether warm-up is over is decided on the device too. On the CPU, where the statistics
    are host numbers (see :class:`GradNormStatistics`), the gradients are scaled only on a step that is clipped.

    Args:
        grads: the gradients.
        stats: the running statistics, updated in place.
        z_threshold: how many standard deviations above the mean a norm may be before it is clipped.
        warmup_steps: finite norms to gather before clipping starts.
        norm_type: the p of the p-norm.
        norm: the gradients' total norm if the caller has it already.
        skipped: a boolean tensor, true when the step will be skipped: its norm stays out of the statistics.

    Returns:
        The total norm before clipping, and the threshold applied (``inf`` during warm-up).

    Example::

        stats = GradNormStatistics()
        norm, threshold = zscore_clip_grads_(grads, stats, z_threshold=2.5, warmup_steps=25)
    """
    norm = total_grad_norm(grads, norm_type) if norm is None else norm
    stats.to(norm.device)
    if stats.on_host:  # CPU gradients: the norm and the verdict are host memory, read without a synchronisation
        value = float(norm)
        threshold = stats.threshold(z_threshold, warmup_steps)
        finite = math.isfinite(value)
        coefficient = threshold / (value + 1e-6) if finite else 1.0  # a non-finite norm is NaNSkip's business
        if coefficient < 1.0:  # multiplying by 1.0 would change nothing, so that pass over the gradients is saved
            scale_grads_(grads, torch.tensor(coefficient, dtype=torch.float32))
        # a non-finite norm, or a skipped step's, is left out; a norm taken in is recorded clipped
        stats._fold_number(min(value, threshold), finite and not (skipped is not None and bool(skipped)))
        return norm, torch.tensor(threshold)
    value = norm.float()
    finite = torch.isfinite(value)
    threshold = stats.threshold(z_threshold, warmup_steps)
    scale_grads_(grads, torch.where(finite, torch.clamp(threshold / (value + 1e-6), max=1.0), 1.0))
    # finite and not skipped: for booleans, finite > skipped in one op. A norm left out may be NaN or Inf (the
    # statistics replace it); one taken in is finite, and so is its minimum with the threshold
    stats._fold(torch.minimum(value, threshold), finite if skipped is None else torch.gt(finite, skipped))
    return norm, threshold
