"""Batch normalisation synchronised over a process group on any device: gloo on CPU, NCCL on CUDA."""

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_mgpu.core import compat

_CONVERTIBLE = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class CollectiveLedger:
    """Counts the collectives :class:`DistributedBatchNorm` layers issue in a training pass, so a replay can skip them.

    A rank whose forward or backward failed part way must still take part in the collectives the other ranks issue
    in that pass, in the same order. It runs the pass again on a sample or two inside :meth:`replaying`: the layers'
    first gathers and reductions, the ones it issued before failing, are then computed from the local batch alone,
    and the rest go out as usual. :meth:`start_pass` begins a new pass.

    Each layer counts in its ``ledger``: the layers :func:`convert_sync_batchnorm` makes share one per model, a layer
    built directly has its own (a pass replayed in the same order skips the same collectives either way);
    :func:`ledgers_of` finds a model's.

    Example::

        ledgers = ledgers_of(model)
        for ledger in ledgers:
            ledger.start_pass()
        try:
            loss = model(batch).mean()
            loss.backward()
        except torch.OutOfMemoryError:
            with replaying(ledgers):
                model(batch[:1]).mean().mul(0.0).backward()  # the collectives the others still wait in
    """

    def __init__(self) -> None:
        self.gathers = 0  # forward all-gathers issued in this pass
        self.reductions = 0  # backward all-reduces issued in this pass
        self.skip_gathers = 0
        self.skip_reductions = 0

    def start_pass(self) -> None:
        """A new training pass: nothing issued yet."""
        self.gathers = self.reductions = 0

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Run the failed pass again: the collectives it issued before failing are skipped, the rest issued."""
        self.skip_gathers, self.skip_reductions = self.gathers, self.reductions
        self.gathers = self.reductions = 0
        try:
            yield
        finally:
            self.skip_gathers = self.skip_reductions = 0

    def gather_skipped(self) -> bool:
        """Whether the next forward gather is one the failed pass issued already."""
        return self.gathers < self.skip_gathers

    def reduction_skipped(self) -> bool:
        """Whether the next backward reduction is one the failed pass issued already."""
        return self.reductions < self.skip_reductions


def ledgers_of(module: nn.Module) -> list[CollectiveLedger]:
    """The distinct ledgers of ``module``'s :class:`DistributedBatchNorm` layers (one for a converted model)."""
    found: dict[int, CollectiveLedger] = {}
    for layer in module.modules():
        if isinstance(layer, DistributedBatchNorm):
            found.setdefault(id(layer.ledger), layer.ledger)
    return list(found.values())


@contextmanager
def replaying(ledgers: list[CollectiveLedger]) -> Iterator[None]:
    """Every ledger of ``ledgers`` in :meth:`~CollectiveLedger.replaying` at once."""
    with ExitStack() as stack:
        for ledger in ledgers:
            stack.enter_context(ledger.replaying())
        yield


class DistributedBatchNorm(compat.BatchNormLayer):
    """Batch normalisation whose training statistics are computed over every rank of a process group.

    A device-agnostic counterpart of :class:`torch.nn.SyncBatchNorm`, which refuses CPU input. In training mode each
    rank computes the count, mean and sum of squared deviations of its own batch per channel; one ``all_gather`` of
    these moments lets every rank merge them, weighted by count, into the statistics of the global batch (Chan's
    parallel algorithm, in float32 or wider). Per-rank batches may differ in size, down to zero samples. The backward
    pass runs one ``all_reduce`` of two per-channel sums when the input needs a gradient. As with
    :class:`torch.nn.SyncBatchNorm`, ``weight`` and ``bias`` receive the gradient of the local batch only; DDP
    averages them across ranks. Running statistics are updated from the global statistics, so they stay identical on
    every rank.

    Every rank of the group must call ``forward``, and ``backward`` through it, the same number of times, or the
    collectives hang. Nothing is communicated in eval mode (ranks may evaluate different numbers of batches), where
    layers without running statistics normalise with the local batch statistics. Without an initialised process
    group, or in a group of one rank, this is the plain local batch norm.

    Args:
        num_features: Number of channels ``C`` of an input of shape ``(N, C, *)``.
        eps: Value added to the variance for numerical stability.
        momentum: Weight of the new statistics in the running averages; ``None`` for a cumulative average.
        affine: Whether to learn a per-channel ``weight`` and ``bias``.
        track_running_stats: Whether to keep running statistics, used for normalisation in eval mode.
        process_group: Group whose ranks share statistics; ``None`` for the default (world) group.
        device: Device of the parameters and buffers.
        dtype: Dtype of the parameters and buffers.

    Raises:
        ValueError: From ``forward``, if the input has fewer than 2 dimensions or not ``num_features`` channels, or
            if the global batch has at most one value per channel in training.

    Example::

        model = convert_sync_batchnorm(model)  # or build layers directly:
        layer = DistributedBatchNorm(64)
        out = layer(torch.randn(8, 64, 32, 32))
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group
        self.ledger = CollectiveLedger()  # shared with the model's other layers by convert_sync_batchnorm

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "ledger" not in state:  # a layer pickled before layers had a ledger
            self.ledger = CollectiveLedger()

    @override
    def check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"{type(self).__name__} expected an input of shape (N, C, *), got {input.dim()}D input")
        if input.size(1) != self.num_features:
            raise ValueError(
                f"{type(self).__name__} expected {self.num_features} channels on dim 1, got input of shape"
                f" {tuple(input.shape)}; check num_features"
            )

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` of shape ``(N, C, *)`` per channel; the output has the input's dtype."""
        self.check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        # buffers are passed only where they are read (eval) or updated (training and tracking)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None

        world_size = _group_size(self.process_group)
        if not (self.training and world_size > 1):
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor, self.eps
            )
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            factor,
            self.process_group,
            world_size,
            self.ledger,
        )


class _BatchNormXd(compat.BatchNormLayer):
    """Plain batch norm for inputs of any dim >= 2: the revert target of a layer whose original class is unknown."""

    @override
    def check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"{type(self).__name__} expected an input of shape (N, C, *), got {input.dim()}D input")


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        factor: float,
        group: Any,
        world_size: int,
        ledger: CollectiveLedger,
    ) -> Tensor:
        compute_dtype = torch.promote_types(input.dtype, torch.float32)
        x = input.to(compute_dtype)
        channels = input.size(1)
        count, local_mean, local_m2 = _local_moments(x)

        packed = torch.cat([x.new_full((1,), count), local_mean, local_m2])
        replayed = ledger.gather_skipped()  # issued before this rank's pass failed: the local batch alone
        if replayed:
            gathered = packed
        else:
            # gloo accepts only the flat (concatenated) output layout, not the stacked one
            gathered = packed.new_empty(world_size * packed.numel())
            _all_gather_into(gathered, packed, group)
        ledger.gathers += 1  # counted once issued: an allocation that failed before issued nothing
        total, mean, m2 = _merge_moments(gathered.view(-1, packed.numel()), channels)

        # only a rank with at most one value can be part of a global batch of at most one value, and then all are:
        # the ranks raise together, and the others need no host synchronisation
        if not replayed and count <= 1 and total.item() <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {input.size()}"
                f" ({int(total.item())} value(s) per channel over {world_size} ranks)"
            )

        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1.0 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1.0 - factor).add_((m2 / (total - 1)).to(running_var.dtype), alpha=factor)

        shape = _channel_shape(input)
        out = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.to(compute_dtype).view(shape)
        if bias is not None:
            out = out + bias.to(compute_dtype).view(shape)

        ctx.save_for_backward(input, weight, mean, invstd, total)
        ctx.group, ctx.ledger = group, ledger
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, mean, invstd, total = ctx.saved_tensors
        compute_dtype = mean.dtype
        shape = _channel_shape(input)
        dims = _reduce_dims(input)
        dy = grad_output.to(compute_dtype)
        xhat = (input.to(compute_dtype) - mean.view(shape)) * invstd.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)

        grad_input = grad_weight = grad_bias = None
        # every rank skips or runs this collective alike: whether the input needs a gradient is a property of the
        # model, not of the batch
        if ctx.needs_input_grad[0]:
            global_sums = torch.cat([sum_dy, sum_dy_xhat])
            if not ctx.ledger.reduction_skipped():
                dist.all_reduce(global_sums, op=dist.ReduceOp.SUM, group=ctx.group)
            ctx.ledger.reductions += 1
            mean_dy, mean_dy_xhat = (global_sums / total).view(2, -1)
            scale = invstd if weight is None else invstd * weight.to(compute_dtype)
            grad_x = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
            grad_input = grad_x.to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def _group_size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _reduce_dims(input: Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def _channel_shape(input: Tensor) -> list[int]:
    return [1, input.size(1)] + [1] * (input.dim() - 2)


def _local_moments(x: Tensor) -> tuple[int, Tensor, Tensor]:
    """Per-channel count, mean and sum of squared deviations from the mean of ``x`` of shape ``(N, C, *)``."""
    channels = x.size(1)
    count = x.numel() // channels if channels else 0
    if count == 0:
        # an empty batch contributes nothing to the merge; var_mean of it would be NaN
        zeros = x.new_zeros(channels)
        return 0, zeros, zeros.clone()
    var, mean = torch.var_mean(x, dim=_reduce_dims(x), correction=0)
    return count, mean, var * count


def _merge_moments(gathered: Tensor, channels: int) -> tuple[Tensor, Tensor, Tensor]:
    """Merge rows of packed ``[count, mean (C), m2 (C)]`` moments into the global count, mean and m2."""
    counts = gathered[:, :1]
    means = gathered[:, 1 : 1 + channels]
    m2s = gathered[:, 1 + channels :]
    total = counts.sum()
    # clamp keeps an all-empty group finite until the caller raises on it
    mean = (counts * means).sum(0) / total.clamp(min=1)
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return total, mean, m2


def _all_gather_into(output: Tensor, input: Tensor, group: Any) -> None:
    # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single; older releases lack the latter
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` by a :class:`DistributedBatchNorm`.

    The new layers take over the same ``Parameter`` and buffer objects, so optimizers and state built on the
    original module stay valid, and keep its training flag. Their original class is remembered for
    :func:`revert_sync_batchnorm`. :class:`torch.nn.SyncBatchNorm` layers are left alone.

    Args:
        module: Model to convert in place; a bare batch-norm layer is converted and returned.
        process_group: Group whose ranks share statistics; ``None`` for the default (world) group.

    Returns:
        ``module`` with its batch-norm layers replaced, or the new layer if ``module`` is one. The new layers share
        one :class:`CollectiveLedger`.
    """
    return _convert(module, process_group, CollectiveLedger())


def _convert(module: nn.Module, process_group: Any, ledger: CollectiveLedger) -> nn.Module:
    if isinstance(module, _CONVERTIBLE):
        converted = DistributedBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group=process_group,
            device="meta",  # placeholders only: the original parameters and buffers replace them below
        )
        _take_over_state(converted, module)
        converted._original_class = type(module)
        converted.ledger = ledger
        return converted
    for name, child in module.named_children():
        module.add_module(name, _convert(child, process_group, ledger))
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Turn every :class:`DistributedBatchNorm` in ``module`` back into a plain batch-norm layer.

    Layers made by :func:`convert_sync_batchnorm` get their original class back; others become a batch norm that
    accepts any input dim >= 2. The same ``Parameter`` and buffer objects and the training flag carry over.

    Args:
        module: Model to revert in place; a bare :class:`DistributedBatchNorm` is reverted and returned.

    Returns:
        ``module`` with its distributed batch-norm layers replaced, or the new layer if ``module`` is one.
    """
    if isinstance(module, DistributedBatchNorm):
        cls = getattr(module, "_original_class", _BatchNormXd)
        reverted = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            device="meta",  # placeholders only: the current parameters and buffers replace them below
        )
        _take_over_state(reverted, module)
        return reverted
    for name, child in module.named_children():
        module.add_module(name, revert_sync_batchnorm(child))
    return module


def has_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` is or contains a batch-norm layer (any torch BatchNorm, synchronised ones included).

    Args:
        module: Model to inspect.
    """
    return any(isinstance(m, compat.BatchNormBase) for m in module.modules())


def _take_over_state(target: compat.BatchNormBase, source: compat.BatchNormBase) -> None:
    target.weight = source.weight
    target.bias = source.bias
    target.running_mean = source.running_mean
    target.running_var = source.running_var
    target.num_batches_tracked = source.num_batches_tracked
    target.train(source.training)
