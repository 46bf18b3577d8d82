"""Which errors count as a recoverable out-of-memory, fed the text torch and the libraries below it really emit."""

import gc
import re
import weakref

import pytest
import torch
from torch._utils import ExceptionWrapper

from lightning_mgpu.memory import oom
from lightning_mgpu.memory.oom import is_out_of_memory, memory_summary, release_memory
from tests.helpers.runif import run_if

# torch >= 2.8 raises torch.AcceleratorError (a RuntimeError) from C10_CUDA_CHECK; older releases a RuntimeError
AcceleratorError = getattr(torch, "AcceleratorError", RuntimeError)

# C10_CUDA_CHECK's message: cudaGetErrorString, then (torch >= 2.8) the error's name, then the same suffix always
_CUDA_SUFFIX = (
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
_HIP_SUFFIX = (
    "HIP kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.\nFor debugging consider passing AMD_SERIALIZE_KERNEL=3\n"
    "Compile with `TORCH_USE_HIP_DSA` to enable device-side assertions.\n"
)


def cuda_error(text, name):
    return (
        f"CUDA error: {text}\nSearch for `{name}' in "
        "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.\n" + _CUDA_SUFFIX
    )


# c10/cuda/CUDACachingAllocator.cpp, torch >= 2.1
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.10 GiB of which 3.06 MiB is "
    "free. Including non-PyTorch memory, this process has 79.09 GiB memory in use. Of the allocated memory 78.41 GiB "
    "is allocated by PyTorch, and 181.23 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
)
# the same allocator before torch 2.1
CUDA_OOM_LEGACY = (
    "CUDA out of memory. Tried to allocate 192.00 MiB (GPU 0; 10.76 GiB total capacity; 9.54 GiB already allocated; "
    "50.56 MiB free; 9.59 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting "
    "max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
# the CUDA allocator hipified, on ROCm
HIP_OOM = (
    "HIP out of memory. Tried to allocate 978.00 MiB. GPU 0 has a total capacity of 15.98 GiB of which 630.00 MiB "
    "is free. Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
# c10/xpu/XPUCachingAllocator.cpp
XPU_OOM = (
    "XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.11 GiB. Of the allocated "
    "memory 14.20 GiB is allocated by PyTorch, and 96.00 MiB is reserved by PyTorch but unallocated. Please use "
    "`empty_cache` to release all unoccupied cached memory."
)
# aten/src/ATen/mps/MPSAllocator.mm, a plain RuntimeError
MPS_OOM = (
    "MPS backend out of memory (MPS allocated: 17.21 GiB, other allocations: 2.80 GiB, max allowed: 20.13 GiB). "
    "Tried to allocate 256.00 MiB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit "
    "for memory allocations (may cause system failure)."
)
# c10/core/impl/alloc_cpu.cpp: posix_memalign (Linux; this text is what this machine raises), then _aligned_malloc
CPU_OOM_POSIX = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "4611686018427387904 bytes. Error code 12 (Cannot allocate memory)"
)
CPU_OOM_WINDOWS = (
    "[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you tried to allocate "
    "6383992832 bytes."
)
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered\n" + _CUDA_SUFFIX

RECOVERABLE = [
    pytest.param(torch.OutOfMemoryError(CUDA_OOM), id="cuda-allocator"),
    pytest.param(torch.cuda.OutOfMemoryError(CUDA_OOM), id="cuda-allocator-cuda-type"),
    pytest.param(RuntimeError(CUDA_OOM), id="cuda-allocator-as-runtime-error"),
    pytest.param(RuntimeError(CUDA_OOM_LEGACY), id="cuda-allocator-before-2.1"),
    pytest.param(torch.OutOfMemoryError(HIP_OOM), id="hip-allocator"),
    pytest.param(RuntimeError(HIP_OOM), id="hip-allocator-as-runtime-error"),
    pytest.param(AcceleratorError(cuda_error("out of memory", "cudaErrorMemoryAllocation")), id="cuda-error-oom"),
    pytest.param(RuntimeError("CUDA error: out of memory\n" + _CUDA_SUFFIX), id="cuda-error-oom-before-2.8"),
    pytest.param(
        AcceleratorError(
            "HIP error: out of memory\nSearch for `hipErrorOutOfMemory' in "
            "https://docs.nvidia.com/cuda/cuda-runtime-api/group__HIPRT__TYPES.html for more information.\n"
            + _HIP_SUFFIX
        ),
        id="hip-error-oom",
    ),
    pytest.param(torch.OutOfMemoryError(XPU_OOM), id="xpu-allocator"),
    pytest.param(RuntimeError(XPU_OOM), id="xpu-allocator-as-runtime-error"),
    pytest.param(RuntimeError(MPS_OOM), id="mps-allocator"),
    pytest.param(RuntimeError(CPU_OOM_POSIX), id="cpu-allocator-posix"),
    pytest.param(RuntimeError(CPU_OOM_WINDOWS), id="cpu-allocator-windows"),
    pytest.param(
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), id="cublas-alloc"
    ),
    pytest.param(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), id="cudnn8-alloc"),
    pytest.param(
        RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"), id="cudnn9-device-alloc"
    ),
    pytest.param(
        RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"), id="cudnn9-host-alloc"
    ),
    # the type alone decides: a message no pattern knows
    pytest.param(torch.OutOfMemoryError("NPU out of memory. Tried to allocate 2.00 GiB"), id="oom-type-any-text"),
    pytest.param(torch.OutOfMemoryError(), id="oom-type-no-text"),
]

# Sticky faults, as C10_CUDA_CHECK and the BLAS/cuDNN checks word them: the context is lost for good
STICKY_FAULTS = [
    pytest.param(ILLEGAL_ACCESS, id="illegal-access"),
    pytest.param(
        cuda_error("an illegal memory access was encountered", "cudaErrorIllegalAddress"), id="illegal-access-2.8"
    ),
    pytest.param(
        "HIP error: an illegal memory access was encountered\nSearch for `hipErrorIllegalAddress' in "
        "https://rocm.docs.amd.com/projects/HIP/en/latest/index.html for more information.\n" + _HIP_SUFFIX,
        id="hip-illegal-access",
    ),
    pytest.param(cuda_error("misaligned address", "cudaErrorMisalignedAddress"), id="misaligned-address"),
    pytest.param(cuda_error("device-side assert triggered", "cudaErrorAssert"), id="device-side-assert"),
    pytest.param(cuda_error("unspecified launch failure", "cudaErrorLaunchFailure"), id="launch-failure"),
    pytest.param(
        cuda_error("an illegal instruction was encountered", "cudaErrorIllegalInstruction"), id="illegal-instruction"
    ),
    pytest.param(cuda_error("hardware stack error", "cudaErrorHardwareStackError"), id="hardware-stack-error"),
    pytest.param(cuda_error("invalid program counter", "cudaErrorInvalidPc"), id="invalid-pc"),
    pytest.param(
        cuda_error("operation not supported on global/shared address space", "cudaErrorInvalidAddressSpace"),
        id="invalid-address-space",
    ),
    pytest.param(cuda_error("the launch timed out and was terminated", "cudaErrorLaunchTimeout"), id="launch-timeout"),
    pytest.param("CUDA error: uncorrectable ECC error encountered\n" + _CUDA_SUFFIX, id="uncorrectable-ecc"),
    pytest.param(
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, &alpha, a, "
        "lda, b, ldb, &beta, c, ldc)`",
        id="cublas-execution-failed",
    ),
    pytest.param("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED", id="cudnn-execution-failed"),
]

UNRECOVERABLE = [
    # errors that are no allocation failure at all
    pytest.param(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"), id="shape-mismatch"),
    pytest.param(
        AcceleratorError(
            cuda_error("no kernel image is available for execution on the device", "cudaErrorNoKernelImageForDevice")
        ),
        id="no-kernel-image",
    ),
    pytest.param(
        RuntimeError(
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
        ),
        id="cudnn-not-supported",
    ),
    pytest.param(RuntimeError("out of memory"), id="bare-out-of-memory-text"),
    # other exception types, whatever their text
    pytest.param(ValueError(CUDA_OOM), id="value-error-with-oom-text"),
    pytest.param(ValueError("out of memory"), id="value-error-out-of-memory"),
    pytest.param(MemoryError(CPU_OOM_POSIX), id="memory-error"),
    pytest.param(OSError(12, "Cannot allocate memory"), id="os-error-enomem"),
    pytest.param(Exception(CUDA_OOM), id="plain-exception"),
    pytest.param(KeyboardInterrupt(), id="keyboard-interrupt"),
]


@pytest.mark.parametrize("error", RECOVERABLE)
def test_allocation_failures_are_recoverable(error):
    assert is_out_of_memory(error) is True


@pytest.mark.parametrize("message", STICKY_FAULTS)
def test_sticky_faults_are_never_recoverable(message):
    assert is_out_of_memory(AcceleratorError(message)) is False
    assert is_out_of_memory(RuntimeError(message)) is False
    # the fault wins over every sign of an allocation failure: the type, or the allocator's text beside it
    assert is_out_of_memory(torch.OutOfMemoryError(message)) is False
    assert is_out_of_memory(RuntimeError(f"{CUDA_OOM}\n{message}")) is False
    assert is_out_of_memory(RuntimeError(f"{message}\n{CPU_OOM_POSIX}")) is False


@pytest.mark.parametrize("error", UNRECOVERABLE)
def test_other_errors_are_not(error):
    assert is_out_of_memory(error) is False


def test_the_oom_types_this_torch_has_are_all_checked():
    # torch.cuda.OutOfMemoryError is an alias of torch.OutOfMemoryError here; on older torch only the former exists
    assert torch.cuda.OutOfMemoryError in oom._OOM_TYPES
    assert set(oom._OOM_TYPES) <= {torch.OutOfMemoryError, torch.cuda.OutOfMemoryError}


def test_a_real_cpu_allocation_failure_is_recoverable():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: beyond any address space, so it fails at once
    assert "DefaultCPUAllocator" in str(caught.value)
    assert is_out_of_memory(caught.value) is True


def test_a_real_non_oom_torch_error_is_not():
    with pytest.raises(RuntimeError) as caught:
        torch.ones(2, 3) @ torch.ones(4, 5)
    assert is_out_of_memory(caught.value) is False


def reraised_from_replica(raise_error):
    """What DataParallel's parallel_apply raises when ``raise_error`` failed in replica 0's thread."""
    try:
        raise_error()
    except BaseException:
        wrapper = ExceptionWrapper(where="in replica 0 on device 0")
    with pytest.raises(BaseException) as caught:
        wrapper.reraise()
    return caught.value


def raiser(error, during=None):
    def raise_error():
        if during is None:
            raise error
        try:
            raise during
        except BaseException:
            raise error  # noqa: B904 - an implicit __context__, as when a handler fails

    return raise_error


def test_an_oom_reraised_from_a_data_parallel_replica_is_recoverable():
    error = reraised_from_replica(raiser(torch.OutOfMemoryError(CUDA_OOM)))
    assert type(error) is torch.OutOfMemoryError
    assert str(error).startswith("Caught OutOfMemoryError in replica 0 on device 0.\nOriginal Traceback")
    assert is_out_of_memory(error) is True
    # the type alone carries it, with a text no pattern knows
    assert is_out_of_memory(reraised_from_replica(raiser(torch.OutOfMemoryError("allocation refused")))) is True


def test_a_runtime_error_oom_reraised_from_a_replica_is_recoverable():
    error = reraised_from_replica(raiser(AcceleratorError(cuda_error("out of memory", "cudaErrorMemoryAllocation"))))
    assert type(error) is AcceleratorError
    assert str(error).startswith(f"Caught {AcceleratorError.__name__} in replica 0 on device 0.")
    assert is_out_of_memory(error) is True
    assert is_out_of_memory(reraised_from_replica(raiser(RuntimeError(CPU_OOM_POSIX)))) is True


def test_a_fault_reraised_from_a_replica_is_not_recoverable_even_after_an_oom():
    assert is_out_of_memory(reraised_from_replica(raiser(RuntimeError(ILLEGAL_ACCESS)))) is False
    # the replica's handler for an OOM hit a sticky fault: the formatted traceback shows both
    error = reraised_from_replica(raiser(RuntimeError(ILLEGAL_ACCESS), during=torch.OutOfMemoryError(CUDA_OOM)))
    assert "CUDA out of memory" in str(error) and is_out_of_memory(error) is False
    # an OOM raised while handling a fault: the type says OOM, the traceback says the context is gone
    error = reraised_from_replica(raiser(torch.OutOfMemoryError(CUDA_OOM), during=RuntimeError(ILLEGAL_ACCESS)))
    assert type(error) is torch.OutOfMemoryError and is_out_of_memory(error) is False


class _Node:
    def __init__(self, tensor):
        self.tensor = tensor
        self.self = self  # a reference cycle: only the garbage collector frees it


def test_release_memory_frees_what_only_a_cycle_held(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    gc.disable()
    try:
        node = _Node(torch.ones(1024))
        alive = weakref.ref(node)
        del node
        assert alive() is not None
        release_memory()
        assert alive() is None
    finally:
        gc.enable()
    assert emptied == []  # CUDA never initialised: no context is created to empty a cache


def test_release_memory_empties_the_cuda_cache_once_cuda_is_initialised(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    release_memory()
    assert emptied == [True]


def test_allocated_bytes_are_zero_before_cuda_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert oom.cuda_allocated_bytes() == 0  # and nothing is read that would create a context


@run_if(min_cuda_gpus=1)
def test_allocated_bytes_are_what_memory_allocated_reports():
    torch.cuda.init()
    before = oom.cuda_allocated_bytes()
    block = torch.empty(2**20, device="cuda")  # 4 MiB
    assert oom.cuda_allocated_bytes() == torch.cuda.memory_allocated() >= before + 4 * 2**20
    del block
    assert oom.cuda_allocated_bytes() == torch.cuda.memory_allocated() == before


def test_the_failed_steps_tensors_live_until_the_exception_is_dropped():
    def step():
        activations = _Node(torch.ones(1024))  # noqa: F841 - held by this frame, which the traceback keeps
        torch.empty(2**62, dtype=torch.uint8)

    gc.disable()
    try:
        try:
            step()
        except RuntimeError as err:
            assert is_out_of_memory(err)
            held = weakref.ref(err.__traceback__.tb_next.tb_frame.f_locals["activations"])
            del err
            # still handling the exception (sys.exc_info()): its traceback keeps the frame, whatever ``del`` did
            assert held() is not None
        release_memory(allocated_before=0)  # the young generations are enough for the failed step's cycle
        assert held() is None
    finally:
        gc.enable()


def test_memory_summary_on_cpu_reports_this_process_and_the_host():
    summary = memory_summary(torch.device("cpu"))
    assert re.fullmatch(r"process RSS: \d+\.\d MiB\nhost available: (\d+\.\d MiB|unknown)", summary), summary
    rss = float(re.search(r"process RSS: (\S+)", summary).group(1))
    assert rss > 10  # this process holds torch: tens of MiB at least
    assert memory_summary(None).splitlines()[0].startswith("process RSS: ")


@pytest.mark.parametrize(
    "device",
    [torch.device("cuda", 99), torch.device("meta"), "not a device", 3.5],
    ids=["cuda-99", "meta", "bad-string", "float"],
)
def test_memory_summary_never_raises_for_a_bogus_device(device):
    summary = memory_summary(device)
    assert "process RSS: " in summary and "host available: " in summary


def test_memory_summary_of_an_unreadable_device_says_so():
    summary = memory_summary("not a device")
    assert summary.splitlines()[0].startswith("not a device: unreadable (RuntimeError")


def test_memory_summary_reads_the_cuda_allocator_and_driver(monkeypatch):
    mib = 2**20
    stats = {
        "allocated_bytes.all.current": 1536 * mib,
        "allocated_bytes.all.peak": 4096 * mib,
        "reserved_bytes.all.current": 2048 * mib,
    }
    asked = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda index: asked.append(index) or stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (3 * mib, 81 * 1024 * mib))
    lines = memory_summary(torch.device("cuda", 1)).splitlines()
    assert lines[:4] == [
        "cuda:1 allocated: 1536.0 MiB",
        "cuda:1 max allocated: 4096.0 MiB",
        "cuda:1 reserved: 2048.0 MiB",
        "cuda:1 free: 3.0 MiB of 82944.0 MiB total",
    ]
    assert asked == [1] and lines[4].startswith("process RSS: ")
    # no index: the current device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert memory_summary(torch.device("cuda")).startswith("cuda:0 allocated: 1536.0 MiB")


def test_memory_summary_returns_what_it_could_read(monkeypatch):
    def fail(index):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda index: {"allocated_bytes.all.current": 2**20})
    monkeypatch.setattr(torch.cuda, "mem_get_info", fail)
    lines = memory_summary(torch.device("cuda", 0)).splitlines()
    assert lines[0] == "cuda:0 allocated: 1.0 MiB"
    assert lines[1:3] == ["cuda:0 max allocated: unknown", "cuda:0 reserved: unknown"]
    assert lines[3].startswith("cuda:0 free and total unreadable (RuntimeError: CUDA error: an illegal memory")
    monkeypatch.setattr(torch.cuda, "memory_stats", fail)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (2**20, 2**30))
    lines = memory_summary(torch.device("cuda", 0)).splitlines()
    assert lines[0].startswith("cuda:0 allocator statistics unreadable (RuntimeError")
    assert lines[1] == "cuda:0 free: 1.0 MiB of 1024.0 MiB total"
    # the host readings failing too
    monkeypatch.setattr(oom, "process_rss_mb", lambda: 1 / 0)
    monkeypatch.setattr(oom, "host_available_mb", lambda: None)
    assert memory_summary(torch.device("cpu")) == "process RSS: unknown\nhost available: unknown"
