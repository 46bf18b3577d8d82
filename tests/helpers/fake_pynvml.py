"""A fake ``pynvml`` (nvidia-ml-py): the same function names, constants and error classes, with GPUs, MIG devices
and failures a test describes, and counters of every call.

Install it with ``monkeypatch.setitem(sys.modules, "pynvml", fake)`` or ``NVMLSession(load=lambda: fake)``. Readings
are read from the ``FakeGPU``/``FakeMIG`` objects at call time, so a test changes ``fake.gpus[0].memory_used``
between two reads. Like the real library, MIG handles do not report utilisation, temperature or power, and every
device query before ``nvmlInit`` raises ``NVMLError_Uninitialized``.
"""

import types
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MiB = 2**20
GiB = 2**30

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_TEMPERATURE_GPU = 0
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

_ERROR_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """Base of the fake NVML errors; ``value`` is the NVML return code, as in pynvml."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, value: int) -> type[NVMLError]:
    def __init__(self: NVMLError) -> None:
        NVMLError.__init__(self, value)

    return type(name, (NVMLError,), {"__init__": __init__})


NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _error_class("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _error_class("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_Unknown = _error_class("NVMLError_Unknown", NVML_ERROR_UNKNOWN)


@dataclass
class FakeMIG:
    """A MIG device; memory in bytes."""

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    name: str = "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    memory_total: int = 5 * GiB
    memory_used: int = 0
    unsupported: set[str] = field(default_factory=set)
    raising: dict[str, Exception] = field(default_factory=dict)


@dataclass
class FakeGPU:
    """A physical GPU; memory in bytes, power in milliwatts.

    ``mig_mode`` ``None`` means: enabled when ``migs`` is not empty, else the GPU does not support MIG. ``migs``
    lists the MIG slots in order, ``None`` for an empty slot.
    """

    name: str
    uuid: str
    memory_total: int = 16 * GiB
    memory_used: int = 1 * GiB
    utilization: int = 50
    memory_utilization: int = 20
    temperature: int = 40
    power_mw: int = 100_000
    migs: list[FakeMIG | None] = field(default_factory=list)
    mig_mode: int | None = None
    max_mig_devices: int = 7
    unsupported: set[str] = field(default_factory=set)
    raising: dict[str, Exception] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mig_mode is None and self.migs:
            self.mig_mode = NVML_DEVICE_MIG_ENABLE


@dataclass(eq=False)
class FakeHandle:
    """An opaque device handle; valid until ``FakeNVML.invalidate_handles`` (a simulated fork) is called."""

    gpu: FakeGPU
    mig: FakeMIG | None
    generation: int


class FakeNVML(types.ModuleType):
    """A module object with pynvml's API over the GPUs given.

    Args:
        gpus: the physical GPUs, in NVML (PCI bus) order.
        driver_version: what ``nvmlSystemGetDriverVersion`` returns.
        unsupported: names of functions that raise ``NVMLError_NotSupported`` for every device.
        raising: function name -> exception raised for every device (the exception object is raised as is).
        init_error: an exception ``nvmlInit`` raises.
        bytes_strings: return names, UUIDs and the driver version as bytes, like old pynvml versions.
    """

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_Unknown = NVMLError_Unknown
    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_UNINITIALIZED = NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE

    def __init__(
        self,
        gpus: Iterable[FakeGPU] = (),
        driver_version: str = "550.54.15",
        unsupported: Iterable[str] = (),
        raising: dict[str, Exception] | None = None,
        init_error: Exception | None = None,
        bytes_strings: bool = False,
    ) -> None:
        super().__init__("pynvml")
        self.gpus = list(gpus)
        self.driver_version = driver_version
        self.unsupported = set(unsupported)
        self.raising = dict(raising or {})
        self.init_error = init_error
        self.bytes_strings = bytes_strings
        self.calls: Counter[str] = Counter()
        self.initialized = 0
        self.generation = 0

    @property
    def init_count(self) -> int:
        """How many times ``nvmlInit`` was called, failed calls included."""
        return self.calls["nvmlInit"]

    def invalidate_handles(self) -> None:
        """Make every handle given out so far raise ``NVMLError_InvalidArgument``, as in a forked child."""
        self.generation += 1

    def _enter(self, function: str, handle: FakeHandle | None = None) -> None:
        self.calls[function] += 1
        if not self.initialized:
            raise NVMLError_Uninitialized()
        if handle is not None and (not isinstance(handle, FakeHandle) or handle.generation != self.generation):
            raise NVMLError_InvalidArgument()
        device = None if handle is None else handle.mig if handle.mig is not None else handle.gpu
        error = self.raising.get(function) or (device.raising.get(function) if device is not None else None)
        if error is not None:
            raise error
        if function in self.unsupported or (device is not None and function in device.unsupported):
            raise NVMLError_NotSupported()

    def _string(self, text: str) -> str | bytes:
        return text.encode() if self.bytes_strings else text

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise self.init_error
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._enter("nvmlSystemGetDriverVersion")
        return self._string(self.driver_version)

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument()
        return FakeHandle(self.gpus[index], None, self.generation)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str | bytes:
        self._enter("nvmlDeviceGetUUID", handle)
        return self._string(handle.mig.uuid if handle.mig is not None else handle.gpu.uuid)

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str | bytes:
        self._enter("nvmlDeviceGetName", handle)
        return self._string(handle.mig.name if handle.mig is not None else handle.gpu.name)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: Any = None) -> types.SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        device = handle.mig if handle.mig is not None else handle.gpu
        return types.SimpleNamespace(
            total=device.memory_total, used=device.memory_used, free=device.memory_total - device.memory_used
        )

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> types.SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        self._whole_gpu_only(handle)
        return types.SimpleNamespace(gpu=handle.gpu.utilization, memory=handle.gpu.memory_utilization)

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", handle)
        self._whole_gpu_only(handle)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError_InvalidArgument()
        return handle.gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetPowerUsage", handle)
        self._whole_gpu_only(handle)
        return handle.gpu.power_mw

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", handle)
        if handle.mig is not None:
            raise NVMLError_InvalidArgument()
        if handle.gpu.mig_mode is None:
            raise NVMLError_NotSupported()
        return [handle.gpu.mig_mode, handle.gpu.mig_mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        if handle.gpu.mig_mode is None:
            raise NVMLError_NotSupported()
        return handle.gpu.max_mig_devices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if handle.mig is not None or handle.gpu.mig_mode != NVML_DEVICE_MIG_ENABLE:
            raise NVMLError_InvalidArgument()
        if index >= handle.gpu.max_mig_devices:
            raise NVMLError_InvalidArgument()
        mig = handle.gpu.migs[index] if index < len(handle.gpu.migs) else None
        if mig is None:
            raise NVMLError_NotFound()
        return FakeHandle(handle.gpu, mig, self.generation)

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId", handle)
        if handle.mig is None:
            raise NVMLError_InvalidArgument()
        return handle.mig.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId", handle)
        if handle.mig is None:
            raise NVMLError_InvalidArgument()
        return handle.mig.compute_instance_id

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: FakeHandle) -> FakeHandle:
        self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        if handle.mig is None:
            raise NVMLError_InvalidArgument()
        return FakeHandle(handle.gpu, None, self.generation)

    @staticmethod
    def _whole_gpu_only(handle: FakeHandle) -> None:
        if handle.mig is not None:
            raise NVMLError_NotSupported()
