"""DDP communication hooks chosen by plain names: fp16/bf16 compression and a PowerSGD that also works on gloo."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.core.validation import check_choice, check_int, check_positive

CommHookName = Literal["fp16", "bf16", "powersgd"]
COMM_HOOK_NAMES: tuple[str, ...] = ("fp16", "bf16", "powersgd")

# keeps Gram-Schmidt finite when a column vanishes (an all-zero gradient)
_ORTHOGONALIZATION_EPSILON = 1e-8


@dataclass
class _BucketLayout:
    """Where each gradient of one bucket lives in its flat buffer, and how PowerSGD treats it."""

    key: tuple
    compressed: list[tuple[int, int, int]]  # (offset, rows, cols) of matrices sent as P and Q
    uncompressed: list[tuple[int, int]]  # (offset, numel) runs sent as they are, adjacent runs merged
    p_numel: int
    q_numel: int


@dataclass
class _PendingBucket:
    """A bucket whose P's are computed and whose reduction waits for the step's last bucket."""

    buffer: Tensor
    layout: _BucketLayout
    error: Tensor | None
    q_old: Tensor | None
    p_flat: Tensor
    future: torch.futures.Future


@dataclass
class PowerSGDState:
    """Per-process state of :func:`powersgd_hook`: settings, step counter, error feedback and warm-started Q's.

    For the first ``warmup_steps`` synchronised backward passes the hook all-reduces exactly. After that every
    gradient of at least two dimensions, viewed as ``n x m`` (first dimension by the rest), for which compression
    pays (``n * m >= min_compression_rate * rank * (n + m)``), is replaced by a rank-``rank`` approximation
    ``P Q^T`` built by one power iteration; what the approximation misses is kept and added to the next step's
    gradient (error feedback, Vogels et al., 2019). Buffers are kept per bucket index and start afresh when a
    bucket's layout changes, as it does once when DDP rebuilds its buckets after the first iteration.

    Args:
        process_group: the group to reduce over; ``None`` for the default group.
        rank: the rank of the matrix approximation, at least 1.
        warmup_steps: steps of exact all-reduce before compression starts, at least 0.
        min_compression_rate: compress a matrix only if it shrinks by at least this factor; must be positive.
        seed: seeds the initial Q matrices, which must be identical on every process.

    Raises:
        TypeError: If ``rank``, ``warmup_steps`` or ``seed`` is not an int, or ``min_compression_rate`` not a number.
        ValueError: If ``rank``, ``warmup_steps``, ``min_compression_rate`` or ``seed`` is out of range.

    Example::

        state = PowerSGDState(rank=2, warmup_steps=1000)
        ddp_model.register_comm_hook(state, powersgd_hook)
    """

    process_group: Any = None
    rank: int = 1
    warmup_steps: int = 100
    min_compression_rate: float = 2.0
    seed: int = 0
    step: int = field(default=0, init=False)
    error_buffers: dict[int, Tensor] = field(default_factory=dict, init=False, repr=False)
    q_matrices: dict[int, Tensor] = field(default_factory=dict, init=False, repr=False)
    layouts: dict[int, _BucketLayout] = field(default_factory=dict, init=False, repr=False)
    pending: list["_PendingBucket"] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(owner, "rank", self.rank, minimum=1)
        check_int(owner, "warmup_steps", self.warmup_steps, minimum=0)
        check_int(owner, "seed", self.seed, minimum=0)
        # inf stays allowed, as before: then no matrix pays for compression and every gradient goes exact
        check_positive(owner, "min_compression_rate", self.min_compression_rate, allow_inf=True)


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """PowerSGD gradient compression with error feedback, safe on gloo as well as NCCL.

    Each bucket's P's are computed when DDP hands the bucket over; the reduction of all buckets of a step runs when
    the last bucket arrives, as two all-reduces for the whole step: the uncompressed tensors together with all P's,
    then all Q's. Both are issued from the hook itself, never from a future's callback, so every process issues
    identical collectives in identical order (DDP calls the hook bucket by bucket). Per-collective latency, not
    bandwidth, dominates small messages (about 1 ms on gloo over loopback), hence one round trip per power-iteration
    half for the whole model. Earlier buckets' futures complete then; DDP only waits for them at the end of backward.

    Args:
        state: this process's :class:`PowerSGDState`; the step counter advances on the bucket that is last.
        bucket: the gradient bucket DDP hands to the hook.

    Example::

        ddp_model.register_comm_hook(PowerSGDState(rank=1, warmup_steps=100), powersgd_hook)
    """
    group = state.process_group
    buffer = bucket.buffer()
    if state.step < state.warmup_steps:
        _allreduce_mean(buffer, group, dist.get_world_size(group))
        future = _completed_future(buffer)
    else:
        if bucket.index() == 0:
            state.pending.clear()  # left over from a backward pass that raised before its last bucket
        future = _compute_p(state, bucket, buffer)
        if bucket.is_last():
            _reduce_pending(state, group, dist.get_world_size(group))
    if bucket.is_last():
        state.step += 1
    return future


def register_comm_hook(
    model: DistributedDataParallel,
    name: CommHookName,
    *,
    powersgd_rank: int = 1,
    powersgd_warmup_steps: int = 100,
    process_group: Any = None,
    wrap: Callable[[Callable], Callable] | None = None,
) -> None:
    """Register the communication hook called ``name`` on a DDP model.

    ``"fp16"`` and ``"bf16"`` cast each bucket to that dtype divided by the world size, all-reduce the sum and
    cast back (torch's ``fp16_compress_hook`` / ``bf16_compress_hook``, which work on gloo too: they issue one
    all-reduce per bucket, from the hook itself).
    ``"powersgd"`` registers :func:`powersgd_hook` with a fresh :class:`PowerSGDState`.

    Args:
        model: the wrapped model; a hook can be registered once per model, before its first backward.
        name: one of :data:`COMM_HOOK_NAMES`.
        powersgd_rank: rank of the PowerSGD approximation, at least 1.
        powersgd_warmup_steps: steps of exact all-reduce before PowerSGD compresses, at least 0.
        process_group: the group to reduce over; ``None`` for the default group.
        wrap: applied to the hook before it is registered (``CommTimer.wrap`` times it).

    Raises:
        TypeError: If ``model`` is not a ``DistributedDataParallel``, ``name`` not a string, or ``powersgd_rank`` or
            ``powersgd_warmup_steps`` not an int.
        ValueError: If ``name`` is unknown, or ``powersgd_rank`` or ``powersgd_warmup_steps`` is out of range.

    Example::

        ddp_model = DistributedDataParallel(model)
        register_comm_hook(ddp_model, "powersgd", powersgd_rank=2, powersgd_warmup_steps=500)
    """
    owner = "register_comm_hook"
    check_choice(owner, "name", name, COMM_HOOK_NAMES)
    check_int(owner, "powersgd_rank", powersgd_rank, minimum=1)
    check_int(owner, "powersgd_warmup_steps", powersgd_warmup_steps, minimum=0)
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"{owner}: model must be a DistributedDataParallel, got {type(model).__name__}")
    if name == "powersgd":
        state = PowerSGDState(process_group=process_group, rank=powersgd_rank, warmup_steps=powersgd_warmup_steps)
        model.register_comm_hook(state, wrap(powersgd_hook) if wrap else powersgd_hook)
    else:
        hook = fp16_compress_hook if name == "fp16" else _bf16_compress_hook
        model.register_comm_hook(process_group, wrap(hook) if wrap else hook)


def register_timed_allreduce(model: DistributedDataParallel, wrap: Callable[[Callable], Callable]) -> None:
    """Register DDP's own reduction (each bucket all-reduced and divided by the world size) as a hook, wrapped.

    What DDP does without a hook, over the model's own process group, issued from Python so that ``wrap``
    (``CommTimer.wrap``) can time each bucket.
    """
    model.register_comm_hook(model.process_group, wrap(allreduce_hook))


def _bf16_compress_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    # torch's bf16 hook works on gloo, but DDP refuses to register a hook of that name unless torch was built
    # with CUDA and NCCL 2.10+, which would rule out CPU-only installs
    return bf16_compress_hook(process_group, bucket)


def _allreduce_mean(tensor: Tensor, group: Any, world_size: int) -> None:
    # divide first so fp16 sums cannot overflow; gloo has no ReduceOp.AVG
    tensor.div_(world_size)
    dist.all_reduce(tensor, group=group)


# below this many gathered elements, gloo reduces faster as one all-gather and a local sum than as an all-reduce
_GATHER_LIMIT = 1 << 20


def _small_mean(flat: Tensor, group: Any, world_size: int) -> None:
    """Mean over the group of a small flat fp32 tensor, in place."""
    if dist.get_backend(group) != "gloo" or flat.numel() * world_size > _GATHER_LIMIT:
        _allreduce_mean(flat, group, world_size)
        return
    # measured on 2 CPU processes: 0.6 ms against 1.3 ms for an all-reduce of 2,048 floats
    gathered = flat.new_empty(world_size * flat.numel())
    _all_gather_into(gathered, flat, group)
    torch.sum(gathered.view(world_size, -1), dim=0, out=flat)
    flat.div_(world_size)


def _all_gather_into(output: Tensor, input: Tensor, group: Any) -> None:
    # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single; older releases lack the latter
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def _completed_future(buffer: Tensor) -> torch.futures.Future[Tensor]:
    # a CUDA future records an event on the current stream, so DDP's copy waits for our kernels
    fut: torch.futures.Future[Tensor] = (
        torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
    )
    fut.set_result(buffer)
    return fut


def _layout(state: PowerSGDState, bucket: dist.GradBucket, buffer: Tensor) -> _BucketLayout:
    """The bucket's layout, re-planned (and its buffers reset) when the parameters' shapes change."""
    index = bucket.index()
    parameters = bucket.parameters()
    shapes = tuple(tuple(p.shape) for p in parameters)
    # identities too: after DDP rebuilds its buckets, equal shapes may belong to other parameters (repeated blocks)
    key = (tuple(id(p) for p in parameters), shapes, buffer.numel(), buffer.dtype, buffer.device)
    layout = state.layouts.get(index)
    if layout is not None and layout.key == key:
        return layout

    # the buffer holds each parameter's gradient contiguously, in bucket.parameters() order
    rank = state.rank
    compressed: list[tuple[int, int, int]] = []
    uncompressed: list[tuple[int, int]] = []
    offset = 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        rows, cols = (shape[0], numel // shape[0]) if len(shape) >= 2 and numel > 0 else (0, 0)
        if rank <= min(rows, cols) and rows * cols >= state.min_compression_rate * rank * (rows + cols):
            compressed.append((offset, rows, cols))
        elif uncompressed and sum(uncompressed[-1]) == offset:
            uncompressed[-1] = (uncompressed[-1][0], uncompressed[-1][1] + numel)
        else:
            uncompressed.append((offset, numel))
        offset += numel
    if offset != buffer.numel():
        raise RuntimeError(
            f"powersgd_hook: bucket {index} holds {buffer.numel()} elements but its parameters {offset}; "
            "this DDP version lays out buckets differently"
        )

    layout = _BucketLayout(
        key=key,
        compressed=compressed,
        uncompressed=uncompressed,
        p_numel=sum(rows * rank for _, rows, _ in compressed),
        q_numel=sum(cols * rank for _, _, cols in compressed),
    )
    state.layouts[index] = layout
    state.error_buffers.pop(index, None)
    state.q_matrices.pop(index, None)
    if compressed:
        state.error_buffers[index] = torch.zeros_like(buffer)
        # seeded on the CPU so that every process starts from the same Q whatever its device
        generator = torch.Generator().manual_seed(state.seed + index)
        q = torch.randn(layout.q_numel, generator=generator, dtype=torch.float32)
        state.q_matrices[index] = q.to(buffer.device)
    return layout


def _compute_p(state: PowerSGDState, bucket: dist.GradBucket, buffer: Tensor) -> torch.futures.Future[Tensor]:
    """Add the error feedback and compute ``P = M Q`` for the bucket's compressed matrices; defer the rest."""
    layout = _layout(state, bucket, buffer)
    rank = state.rank
    error = state.error_buffers.get(bucket.index())
    q_old = state.q_matrices.get(bucket.index())
    p_flat = torch.empty(layout.p_numel, dtype=torch.float32, device=buffer.device)
    if error is not None and q_old is not None:
        buffer.add_(error)
        p_start = q_start = 0
        for offset, rows, cols in layout.compressed:
            matrix = buffer.narrow(0, offset, rows * cols).view(rows, cols)
            q = q_old.narrow(0, q_start, cols * rank).view(cols, rank)
            torch.matmul(matrix.float(), q, out=p_flat.narrow(0, p_start, rows * rank).view(rows, rank))
            p_start += rows * rank
            q_start += cols * rank
    future: torch.futures.Future[Tensor] = (
        torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
    )
    state.pending.append(_PendingBucket(buffer, layout, error, q_old, p_flat, future))
    return future


def _reduce_pending(state: PowerSGDState, group: Any, world_size: int) -> None:
    """Reduce every pending bucket of the step in two all-reduces, write results back and complete the futures."""
    pending, state.pending = state.pending, []
    rank = state.rank

    # round 1: every uncompressed run of every bucket, then every P, in one flat fp32 buffer
    exact_parts = [b.buffer.narrow(0, offset, numel) for b in pending for offset, numel in b.layout.uncompressed]
    flat = torch.cat([part.float() for part in exact_parts] + [b.p_flat for b in pending])
    _small_mean(flat, group, world_size)
    start = 0
    for part in exact_parts:
        part.copy_(flat.narrow(0, start, part.numel()))
        start += part.numel()
    p_means = flat.narrow(0, start, flat.numel() - start).split([b.p_flat.numel() for b in pending])

    # round 2: Q = M^T P for every compressed matrix, in one flat buffer
    matrices, ps = [], []
    for bucket, p_mean in zip(pending, p_means, strict=True):
        p_start = 0
        for offset, rows, cols in bucket.layout.compressed:
            p = p_mean.narrow(0, p_start, rows * rank).view(rows, rank)
            _orthogonalize_(p)
            matrices.append(bucket.buffer.narrow(0, offset, rows * cols).view(rows, cols))
            ps.append(p)
            p_start += rows * rank
    if not matrices:
        for bucket in pending:
            bucket.future.set_result(bucket.buffer)
        return
    q_flat = torch.cat([(matrix.float().t() @ p).reshape(-1) for matrix, p in zip(matrices, ps, strict=True)])
    _small_mean(q_flat, group, world_size)

    # approximation P Q^T replaces each matrix; what it misses is kept as error for the next step
    reduced = iter(zip(matrices, ps, q_flat.split([matrix.shape[1] * rank for matrix in matrices]), strict=True))
    for bucket in pending:
        q_start = 0
        for offset, rows, cols in bucket.layout.compressed:
            matrix, p, q_mean = next(reduced)
            q = q_mean.view(cols, rank)
            matrix_error = bucket.error.narrow(0, offset, rows * cols).view(rows, cols)  # type: ignore[union-attr]
            # in place, no n x m temporary: error = M - P Q^T, then M = P Q^T
            torch.addmm(matrix, p.to(matrix.dtype), q.t().to(matrix.dtype), alpha=-1, out=matrix_error)
            # an overflowing step (fp16 AMP, which GradScaler then skips) must not live on in the error feedback
            matrix_error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            torch.mm(p.to(matrix.dtype), q.t().to(matrix.dtype), out=matrix)
            # warm-start from the new Q, except for columns that vanished (an all-zero gradient): a zero Q would
            # make every later P zero and the layer would never be updated again; Q is reduced, so ranks agree
            q_old = bucket.q_old.narrow(0, q_start, cols * rank).view(cols, rank)  # type: ignore[union-attr]
            q_old.copy_(torch.where(q.norm(dim=0, keepdim=True) > 0, q, q_old))
            q_start += cols * rank
        bucket.future.set_result(bucket.buffer)


def _orthogonalize_(matrix: Tensor) -> None:
    """Make the columns of an ``n x r`` fp32 matrix orthonormal in place (Gram-Schmidt)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        col.div_(col.norm() + _ORTHOGONALIZATION_EPSILON)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))
