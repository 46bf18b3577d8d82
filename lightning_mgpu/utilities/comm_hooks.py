"""DDP communication hooks chosen by plain names: fp16/bf16 compression and a PowerSGD that also works on gloo."""

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

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

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_int(self.rank, "rank", 1, owner)
        _check_int(self.warmup_steps, "warmup_steps", 0, owner)
        _check_int(self.seed, "seed", 0, owner)
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(f"{owner}: min_compression_rate must be a positive number, got {rate!r}")


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """PowerSGD gradient compression with error feedback, safe on gloo as well as NCCL.

    Every collective runs synchronously inside the hook, in an order fixed by the bucket's layout, so all
    processes issue identical collectives in identical order (DDP calls the hook bucket by bucket). Per compressed
    bucket that is at most three all-reduces: the uncompressed tensors, all P's, all Q's, each as one flat buffer.
    The returned future is already complete and holds the bucket's buffer, averaged over the group.

    Args:
        state: this process's :class:`PowerSGDState`; the step counter advances on the bucket that is last.
        bucket: the gradient bucket DDP hands to the hook.

    Example::

        ddp_model.register_comm_hook(PowerSGDState(rank=1, warmup_steps=100), powersgd_hook)
    """
    group = state.process_group
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    if state.step < state.warmup_steps:
        _allreduce_mean(buffer, group, world_size)
    else:
        _compress_and_reduce(state, bucket, buffer, group, world_size)
    if bucket.is_last():
        state.step += 1
    return _completed_future(buffer)


def register_comm_hook(
    model: DistributedDataParallel,
    name: CommHookName,
    *,
    powersgd_rank: int = 1,
    powersgd_warmup_steps: int = 100,
    process_group: Any = None,
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

    Raises:
        TypeError: If ``model`` is not a ``DistributedDataParallel``.
        ValueError: If ``name``, ``powersgd_rank`` or ``powersgd_warmup_steps`` is not allowed.

    Example::

        ddp_model = DistributedDataParallel(model)
        register_comm_hook(ddp_model, "powersgd", powersgd_rank=2, powersgd_warmup_steps=500)
    """
    owner = "register_comm_hook"
    if name not in COMM_HOOK_NAMES:
        raise ValueError(f"{owner}: name must be one of {COMM_HOOK_NAMES}, got {name!r}")
    _check_int(powersgd_rank, "powersgd_rank", 1, owner)
    _check_int(powersgd_warmup_steps, "powersgd_warmup_steps", 0, owner)
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"{owner}: model must be a DistributedDataParallel, got {type(model).__name__}")
    if name == "powersgd":
        state = PowerSGDState(process_group=process_group, rank=powersgd_rank, warmup_steps=powersgd_warmup_steps)
        model.register_comm_hook(state, powersgd_hook)
    else:
        hook = fp16_compress_hook if name == "fp16" else _bf16_compress_hook
        model.register_comm_hook(process_group, hook)


def _check_int(value: Any, name: str, minimum: int, owner: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")


def _bf16_compress_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    # torch's bf16 hook works on gloo, but DDP refuses to register a hook of that name unless torch was built
    # with CUDA and NCCL 2.10+, which would rule out CPU-only installs
    return bf16_compress_hook(process_group, bucket)


def _allreduce_mean(tensor: Tensor, group: Any, world_size: int) -> None:
    # divide first so fp16 sums cannot overflow; gloo has no ReduceOp.AVG
    tensor.div_(world_size)
    dist.all_reduce(tensor, group=group)


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
    shapes = tuple(tuple(p.shape) for p in bucket.parameters())
    key = (shapes, buffer.numel(), buffer.dtype, buffer.device)
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


def _compress_and_reduce(
    state: PowerSGDState, bucket: dist.GradBucket, buffer: Tensor, group: Any, world_size: int
) -> None:
    layout = _layout(state, bucket, buffer)
    if not layout.compressed:
        _allreduce_mean(buffer, group, world_size)
        return

    error = state.error_buffers[bucket.index()]
    buffer.add_(error)

    if layout.uncompressed:
        flat = torch.cat([buffer.narrow(0, offset, numel) for offset, numel in layout.uncompressed])
        _allreduce_mean(flat, group, world_size)
        start = 0
        for offset, numel in layout.uncompressed:
            buffer.narrow(0, offset, numel).copy_(flat.narrow(0, start, numel))
            start += numel

    rank = state.rank
    matrices = [buffer.narrow(0, offset, rows * cols).view(rows, cols) for offset, rows, cols in layout.compressed]
    p_sizes = [rows * rank for _, rows, _ in layout.compressed]
    q_sizes = [cols * rank for _, _, cols in layout.compressed]
    p_flat = torch.empty(layout.p_numel, dtype=torch.float32, device=buffer.device)
    q_flat = torch.empty(layout.q_numel, dtype=torch.float32, device=buffer.device)
    ps = [p.view(-1, rank) for p in p_flat.split(p_sizes)]
    qs = [q.view(-1, rank) for q in q_flat.split(q_sizes)]
    q_olds = [q.view(-1, rank) for q in state.q_matrices[bucket.index()].split(q_sizes)]

    for matrix, p, q_old in zip(matrices, ps, q_olds, strict=True):
        torch.matmul(matrix.float(), q_old, out=p)
    _allreduce_mean(p_flat, group, world_size)
    for p in ps:
        _orthogonalize_(p)

    for matrix, p, q in zip(matrices, ps, qs, strict=True):
        torch.matmul(matrix.float().t(), p, out=q)
    _allreduce_mean(q_flat, group, world_size)

    for (offset, rows, cols), matrix, p, q, q_old in zip(layout.compressed, matrices, ps, qs, q_olds, strict=True):
        matrix_error = error.narrow(0, offset, rows * cols).view(rows, cols)
        matrix_error.copy_(matrix)
        matrix.copy_(p @ q.t())
        matrix_error.sub_(matrix)
        # warm-start from the new Q, except for columns that vanished (an all-zero gradient): a zero Q would make
        # every later P zero and the layer would never be updated again; Q is all-reduced, so every rank agrees
        q_old.copy_(torch.where(q.norm(dim=0, keepdim=True) > 0, q, q_old))


def _orthogonalize_(matrix: Tensor) -> None:
    """Make the columns of an ``n x r`` fp32 matrix orthonormal in place (Gram-Schmidt)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        col.div_(col.norm() + _ORTHOGONALIZATION_EPSILON)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))
