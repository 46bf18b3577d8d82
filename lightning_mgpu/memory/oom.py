"""Out-of-memory errors: which ones a training loop may recover from, how to free memory, what to report.

An allocation failure leaves the process usable: nothing was written, the allocator simply said no, and a smaller
batch can be tried once the failed step's tensors are gone. A kernel fault (an illegal memory access, a device-side
assert) is different: the CUDA context is poisoned and every later CUDA call fails with the same error, so the only
way on is a new process. :func:`is_out_of_memory` tells the two apart from the exception alone.
"""

import gc
from collections.abc import Callable

import torch

from lightning_mgpu.core.host_memory import MIB, host_available_mb, process_rss_mb

# torch >= 2.5 has the device-generic torch.OutOfMemoryError, of which torch.cuda.OutOfMemoryError is an alias;
# older releases have only the CUDA one (raised by the CUDA, HIP and XPU caching allocators alike)
_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    dict.fromkeys(
        error_type
        for error_type in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
        if isinstance(error_type, type)
    )
)

# The text torch and the libraries below it put in a RuntimeError when an allocation fails.
_OOM_MESSAGES = (
    # c10/cuda/CUDACachingAllocator.cpp; hipified to "HIP out of memory" on ROCm
    "CUDA out of memory",
    "HIP out of memory",
    # C10_CUDA_CHECK on cudaErrorMemoryAllocation (a cudaMalloc outside the caching allocator, context creation);
    # torch.AcceleratorError, a RuntimeError, since torch 2.8
    "CUDA error: out of memory",
    "HIP error: out of memory",
    # the XPU caching allocator (torch.OutOfMemoryError already, matched here for older releases)
    "XPU out of memory",
    # aten/src/ATen/mps/MPSAllocator.mm, a plain RuntimeError
    "MPS backend out of memory",
    # c10/core/impl/alloc_cpu.cpp: posix_memalign failing (Linux, macOS), then malloc returning null (Windows)
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    # TORCH_CUDABLAS_CHECK, e.g. "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    "CUBLAS_STATUS_ALLOC_FAILED",
    # AT_CUDNN_CHECK, "cuDNN error: <status>": the cuDNN 8 name, then its cuDNN 9 successors
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
)

# Sticky errors (cudaGetErrorString's text): the context is unusable until the process exits. Checked first, so
# that a fault reported while allocating, or a traceback that shows both, is never taken for a recoverable OOM.
# Not "device-side assert" alone: every C10_CUDA_CHECK message ends with "... to enable device-side assertions."
_FATAL_MESSAGES = (
    "an illegal memory access was encountered",
    "an illegal instruction was encountered",
    "misaligned address",
    "device-side assert triggered",
    "unspecified launch failure",
    "hardware stack error",
    "invalid program counter",
    "operation not supported on global/shared address space",
    "the launch timed out and was terminated",
    "uncorrectable ECC error encountered",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_EXECUTION_FAILED",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure after which the process can go on, with less memory in use.

    True for ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``) and for a ``RuntimeError`` whose message
    is a known allocation failure of the CUDA, HIP, XPU, MPS or CPU allocator, cuBLAS or cuDNN. False whenever the
    message also names a sticky CUDA fault (illegal memory access, misaligned address, device-side assert, ...),
    whatever the type, and for every other exception type, whatever its text. Only ``error`` itself is read, not
    its ``__cause__`` or ``__context__``; an error that ``torch.nn.DataParallel`` re-raises from a replica (through
    ``torch._utils.ExceptionWrapper``) keeps its type and carries the original traceback in its message, so it is
    recognised too.

    Args:
        error: the exception caught.

    Returns:
        True if dropping the failed step's tensors and retrying with less memory may succeed.

    Example::

        >>> is_out_of_memory(RuntimeError("CUDA error: out of memory"))
        True
        >>> is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
        False
    """
    if not isinstance(error, RuntimeError):
        return False
    message = str(error)
    if any(fatal in message for fatal in _FATAL_MESSAGES):
        return False
    return isinstance(error, _OOM_TYPES) or any(oom in message for oom in _OOM_MESSAGES)


def cuda_allocated_bytes() -> int:
    """The bytes CUDA tensors hold on the current device, as ``torch.cuda.memory_allocated()``; 0 before CUDA starts.

    Read from the allocator's nested statistics: ``memory_allocated`` flattens every statistic into a new dictionary
    first (about 160 recursive calls: 151 us a call on an H100's host, against 23 us here), too slow for once a step.
    """
    if not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"])


def release_memory(allocated_before: int | None = None) -> None:
    """Collect garbage, then hand the CUDA caching allocator's unused blocks back to the driver.

    The tensors of a step that failed are kept alive by the exception: its traceback holds every frame, and the
    frames hold the activations. A caller must let go of the exception first, or nothing is freed here: call this
    after the ``except`` block, not in it, since until the block ends the exception is still the one being handled
    (``sys.exc_info()``), even after ``del err``; and keep no other reference to it.

    Most of the failed step's memory goes by reference counting as the frames die; ``gc.collect`` breaks the cycles.
    The young generations are collected first (about a millisecond); a full collection, about 200 ms in a process
    that imported Lightning, runs only when CUDA still holds more than ``allocated_before`` (the bytes allocated
    before the failed attempt), or when that is not given. ``torch.cuda.empty_cache`` runs only when CUDA has been
    initialised, so this never creates a CUDA context. Statistics such as peak memory are left as they are.

    Args:
        allocated_before: :func:`cuda_allocated_bytes` before the attempt that failed, if known.

    Example::

        out_of_memory = False
        try:
            loss = model(batch).sum()
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
            out_of_memory = True
        if out_of_memory:  # outside the except block: the exception and its frames are gone
            release_memory()
    """
    gc.collect(1)
    if not torch.cuda.is_initialized():
        if allocated_before is None:
            gc.collect()
        return
    if allocated_before is None or cuda_allocated_bytes() > allocated_before:
        gc.collect()
    torch.cuda.empty_cache()


def memory_summary(device: torch.device | None = None) -> str:
    """A few lines on memory use for an error message: the device's, if CUDA, then the host's.

    For a CUDA device: memory allocated by PyTorch's caching allocator, its peak since the last reset, memory reserved
    by the allocator, and the GPU's free and total memory. For every device: this process's resident set and the
    memory the host (or its container) still has available. All in MiB. Never raises: what cannot be read is reported
    as such, and the rest still is.

    Args:
        device: the device that ran out of memory; ``None`` or a CPU device for the host lines only.

    Returns:
        One fact per line, without a trailing newline.

    Example::

        >>> print(memory_summary(torch.device("cpu")))  # doctest: +SKIP
        process RSS: 812.4 MiB
        host available: 101233.7 MiB
    """
    lines = []
    try:
        device = None if device is None else torch.device(device)
        if device is not None and device.type == "cuda":
            lines.extend(_cuda_lines(device))
    except Exception as err:
        lines.append(f"{device}: unreadable ({type(err).__name__}: {err})")
    lines.append(f"process RSS: {_read_mib(process_rss_mb)}")
    lines.append(f"host available: {_read_mib(host_available_mb)}")
    return "\n".join(lines)


def _cuda_lines(device: torch.device) -> list[str]:
    if not torch.cuda.is_initialized():
        # nothing can be allocated yet, and reading would create a context of several hundred MiB
        return [f"{device}: CUDA not initialised"]
    index = torch.cuda.current_device() if device.index is None else device.index
    name = f"cuda:{index}"
    lines = []
    try:
        stats = torch.cuda.memory_stats(index)
        lines.append(f"{name} allocated: {_mib(stats.get('allocated_bytes.all.current'))}")
        lines.append(f"{name} max allocated: {_mib(stats.get('allocated_bytes.all.peak'))}")
        lines.append(f"{name} reserved: {_mib(stats.get('reserved_bytes.all.current'))}")
    except Exception as err:
        lines.append(f"{name} allocator statistics unreadable ({type(err).__name__}: {err})")
    try:
        free, total = torch.cuda.mem_get_info(index)
        lines.append(f"{name} free: {_mib(free)} of {_mib(total)} total")
    except Exception as err:
        lines.append(f"{name} free and total unreadable ({type(err).__name__}: {err})")
    return lines


def _read_mib(read: Callable[[], float | None]) -> str:
    try:
        value = read()
    except Exception:
        value = None
    return "unknown" if value is None else f"{value:.1f} MiB"


def _mib(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else f"{num_bytes / MIB:.1f} MiB"
