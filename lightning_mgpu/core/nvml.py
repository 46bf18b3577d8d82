"""The one module that talks to NVML: started lazily (again after a fork), devices found by UUID, warnings once.

NVML numbers GPUs in PCI bus order; CUDA, and so torch, numbers the devices it sees after ``CUDA_VISIBLE_DEVICES``
and ``CUDA_DEVICE_ORDER`` (fastest first by default) have reordered and filtered them, and MIG slices a GPU into
devices NVML lists under their parent. :meth:`NVMLSession.map_torch_devices` therefore matches UUIDs and only falls
back to an index where CUDA and NVML provably agree on it.
"""

import contextlib
import importlib
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from lightning_mgpu.core.host_memory import MIB

_LEGACY_MIG = re.compile(r"^MIG-GPU-(?P<gpu>[^/]+)/(?P<gi>\d+)/(?P<ci>\d+)$")
_FIX = (
    "set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA numbers GPUs like NVML, name devices by UUID in "
    "CUDA_VISIBLE_DEVICES (see `nvidia-smi -L`), or pass the UUIDs torch reports (torch_device_uuid)"
)


class NVMLWarning(UserWarning):
    """NVML could not tell something; the value is reported as unavailable and training goes on."""


class _Unset:
    def __repr__(self) -> str:
        return "<read from the environment>"


_UNSET = _Unset()


@dataclass(frozen=True)
class NVMLDevice:
    """A physical GPU or a MIG device as NVML lists it.

    Args:
        index: NVML index of the physical GPU (the parent's index for a MIG device).
        uuid: the UUID as NVML reports it, ``"GPU-..."`` or ``"MIG-..."``.
        name: the product name.
        handle: the NVML handle of this device, valid in the process that enumerated it.
        parent_handle: handle of the physical GPU of a MIG device; ``None`` for a full GPU.
        gpu_instance_id: MIG GPU instance id; ``None`` for a full GPU.
        compute_instance_id: MIG compute instance id; ``None`` for a full GPU.
    """

    index: int
    uuid: str
    name: str
    handle: Any
    parent_handle: Any | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def is_mig(self) -> bool:
        """Whether this is a MIG device rather than a full GPU."""
        return self.parent_handle is not None


@dataclass(frozen=True)
class DeviceReading:
    """One reading of a device; a field NVML could not report is ``None``.

    Args:
        memory_total_mb: memory of the device in MiB (of the MIG slice for a MIG device).
        memory_free_mb: free memory in MiB.
        memory_used_mb: used memory in MiB.
        utilization_pct: GPU utilisation in percent over NVML's last sample period.
        temperature_c: GPU temperature in degrees Celsius (of the whole board for a MIG device).
        power_w: power draw in watts (of the whole board for a MIG device).
    """

    memory_total_mb: float | None = None
    memory_free_mb: float | None = None
    memory_used_mb: float | None = None
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None


class NVMLSession:
    """A lazily started NVML connection that never raises: what NVML cannot tell comes back as ``None``.

    Nothing happens at construction, so a session can be built on a machine without GPUs and pickled into spawned
    workers (the library, handles and devices are dropped and found again there). The first call that needs NVML
    starts it; a call in a forked child starts it again, because the parent's handles are not valid there. When
    ``pynvml`` is missing or ``nvmlInit`` fails, :attr:`available` is ``False``, :attr:`unavailable_reason` says
    why, and one :class:`NVMLWarning` is emitted. A query NVML refuses (not supported, no permission, ...) warns
    once per query kind and device.

    Args:
        load: returns the ``pynvml`` module; the default imports it (package ``nvidia-ml-py``). It must be
            picklable for the session to be.
        warn: receives each warning message; the default emits an :class:`NVMLWarning`.

    Example::

        session = NVMLSession()
        device = session.map_torch_devices([0], [torch_device_uuid(0)])[0]
        if device is not None:
            print(session.read(device).memory_used_mb)
    """

    def __init__(self, load: Callable[[], ModuleType] | None = None, warn: Callable[[str], None] | None = None) -> None:
        self._load = load
        self._warn = warn
        self._warned: set[tuple[str, ...]] = set()
        self._forget()

    def _forget(self) -> None:
        self._lib: Any = None
        self._pid: int | None = None
        self._devices: list[NVMLDevice] | None = None
        self.unavailable_reason: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_lib=None, _pid=None, _devices=None, unavailable_reason=None)
        return state

    def start(self) -> bool:
        """Start NVML unless this process already tried; return whether it is usable."""
        pid = os.getpid()
        if self._pid == pid:
            return self._lib is not None
        self._forget()
        self._pid = pid
        try:
            lib = self._load() if self._load is not None else importlib.import_module("pynvml")
        except Exception as err:
            return self._fail(f"the pynvml module (package nvidia-ml-py) could not be imported: {_describe(err)}")
        try:
            lib.nvmlInit()
        except Exception as err:
            return self._fail(f"nvmlInit failed: {_describe(err)}")
        self._lib = lib
        return True

    def _fail(self, reason: str) -> bool:
        self.unavailable_reason = reason
        self._warn_once(("unavailable",), f"NVML is unavailable, so GPU readings will be missing: {reason}")
        return False

    @property
    def available(self) -> bool:
        """Whether NVML is usable in this process (starting it if needed)."""
        return self.start()

    def shutdown(self) -> None:
        """Shut NVML down if this process started it; safe to call repeatedly. A later call starts it again."""
        if self._lib is not None and self._pid == os.getpid():
            with contextlib.suppress(Exception):
                self._lib.nvmlShutdown()
        self._forget()

    def devices(self) -> list[NVMLDevice]:
        """Every physical GPU and every MIG device of GPUs in MIG mode; ``[]`` when NVML is unavailable."""
        if not self.start():
            return []
        if self._devices is None:
            self._devices = self._enumerate()
        return list(self._devices)

    def driver_version(self) -> str | None:
        """The driver version NVML reports, or ``None``."""
        if not self.start():
            return None
        version = self._call("driver version", "system", self._lib.nvmlSystemGetDriverVersion)
        return None if version is None else _text(version)

    def read(self, device: NVMLDevice) -> DeviceReading:
        """Read memory, utilisation, temperature and power of ``device``; what NVML refuses is ``None``.

        Temperature and power of a MIG device are the whole board's, read from its parent GPU.

        Args:
            device: a device of :meth:`devices` or :meth:`map_torch_devices`, possibly from before a fork.
        """
        if not self.start():
            return DeviceReading()
        lib = self._lib
        # handles of a device found before a fork are stale in the child: take this process's by UUID
        if self._devices is None:
            self._devices = self._enumerate()
        current = next((d for d in self._devices if d.uuid == device.uuid), device)
        board = current.parent_handle if current.parent_handle is not None else current.handle
        memory = self._query("memory", current, lib.nvmlDeviceGetMemoryInfo, current.handle)
        utilization = self._query("utilization", current, lib.nvmlDeviceGetUtilizationRates, current.handle)
        temperature = self._query("temperature", current, lib.nvmlDeviceGetTemperature, board, lib.NVML_TEMPERATURE_GPU)
        power = self._query("power", current, lib.nvmlDeviceGetPowerUsage, board)
        return DeviceReading(
            memory_total_mb=None if memory is None else memory.total / MIB,
            memory_free_mb=None if memory is None else memory.free / MIB,
            memory_used_mb=None if memory is None else memory.used / MIB,
            utilization_pct=None if utilization is None else float(utilization.gpu),
            temperature_c=None if temperature is None else float(temperature),
            power_w=None if power is None else power / 1000.0,
        )

    def map_torch_devices(
        self,
        torch_indices: Sequence[int],
        torch_uuids: Sequence[str | None] | None = None,
        visible_devices: str | _Unset | None = _UNSET,
        device_order: str | _Unset | None = _UNSET,
    ) -> dict[int, NVMLDevice | None]:
        """Find the NVML device behind each torch CUDA index, by UUID wherever possible.

        In order: the UUID CUDA reports for the torch device (``torch_uuids``, matched against every GPU and MIG
        device); else entry ``i`` of ``CUDA_VISIBLE_DEVICES`` for torch index ``i`` (a ``GPU-`` UUID or unique
        prefix, a ``MIG-`` UUID, a legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` name, or an integer, trusted only when
        CUDA numbers GPUs like NVML: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or all GPUs of one model). What stays
        unresolved maps to ``None``, with one warning saying why and how to fix it.

        Args:
            torch_indices: torch CUDA device indices.
            torch_uuids: the UUID torch reports for each entry of ``torch_indices`` (same length), with or without
                the ``GPU-``/``MIG-`` prefix; ``None`` entries fall back to ``CUDA_VISIBLE_DEVICES``.
            visible_devices: ``CUDA_VISIBLE_DEVICES`` to assume; read from the environment by default.
            device_order: ``CUDA_DEVICE_ORDER`` to assume; read from the environment by default.

        Raises:
            ValueError: ``torch_uuids`` and ``torch_indices`` differ in length.
        """
        indices = list(torch_indices)
        uuids = list(torch_uuids) if torch_uuids is not None else [None] * len(indices)
        if len(uuids) != len(indices):
            raise ValueError(
                f"{type(self).__name__}.map_torch_devices: torch_uuids has {len(uuids)} entries but torch_indices "
                f"has {len(indices)}; give one UUID (or None) per index"
            )
        if not self.start():
            return dict.fromkeys(indices)
        if isinstance(visible_devices, _Unset):
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        if isinstance(device_order, _Unset):
            device_order = os.environ.get("CUDA_DEVICE_ORDER")
        resolver = _Resolver(self.devices(), parse_visible_devices(visible_devices), device_order)
        mapping: dict[int, NVMLDevice | None] = {}
        problems: list[str] = []
        for index, uuid in zip(indices, uuids, strict=True):
            device, problem = resolver.resolve(index, uuid)
            mapping[index] = device
            if problem is not None:
                problems.append(f"torch device {index}: {problem}")
        if problems:
            env = f"CUDA_VISIBLE_DEVICES={visible_devices!r}, CUDA_DEVICE_ORDER={device_order!r}"
            message = (
                f"Cannot tell which NVML GPU some torch devices are ({env}): {'; '.join(problems)}. To fix: {_FIX}."
            )
            self._warn_once(("map", message), message)
        return mapping

    def _enumerate(self) -> list[NVMLDevice]:
        lib = self._lib
        count = self._call("device count", "system", lib.nvmlDeviceGetCount)
        found: list[NVMLDevice] = []
        for index in range(count or 0):
            where = f"GPU {index}"
            handle = self._call("handle", where, lib.nvmlDeviceGetHandleByIndex, index)
            uuid = None if handle is None else self._call("UUID", where, lib.nvmlDeviceGetUUID, handle)
            if uuid is None:
                continue
            name = self._call("name", where, lib.nvmlDeviceGetName, handle)
            gpu = NVMLDevice(
                index=index, uuid=_text(uuid), name="unknown" if name is None else _text(name), handle=handle
            )
            found.append(gpu)
            found.extend(self._mig_devices(gpu))
        return found

    def _mig_devices(self, gpu: NVMLDevice) -> list[NVMLDevice]:
        lib = self._lib
        where = f"GPU {gpu.index} ({gpu.uuid})"
        try:
            if lib.nvmlDeviceGetMigMode(gpu.handle)[0] != lib.NVML_DEVICE_MIG_ENABLE:
                return []
        except Exception as err:
            # GPUs without MIG answer NotSupported: that is an answer, not a problem
            if getattr(err, "value", None) != lib.NVML_ERROR_NOT_SUPPORTED:
                self._warn_once(("MIG mode", gpu.uuid), f"NVML cannot report the MIG mode of {where}: {_describe(err)}")
            return []
        slots = self._call("MIG device count", where, lib.nvmlDeviceGetMaxMigDeviceCount, gpu.handle) or 0
        migs: list[NVMLDevice] = []
        for slot in range(slots):
            try:
                handle = lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
            except Exception as err:
                if getattr(err, "value", None) != lib.NVML_ERROR_NOT_FOUND:  # NotFound: an empty slot
                    self._warn_once(
                        ("MIG device", gpu.uuid, str(slot)),
                        f"NVML cannot open MIG slot {slot} of {where}: {_describe(err)}",
                    )
                continue
            uuid = self._call("MIG UUID", f"{where} MIG slot {slot}", lib.nvmlDeviceGetUUID, handle)
            if uuid is None:
                continue
            name = self._call("MIG name", f"{where} MIG slot {slot}", lib.nvmlDeviceGetName, handle)
            gi = self._call("GPU instance id", f"{where} MIG slot {slot}", lib.nvmlDeviceGetGpuInstanceId, handle)
            ci = self._call(
                "compute instance id", f"{where} MIG slot {slot}", lib.nvmlDeviceGetComputeInstanceId, handle
            )
            migs.append(
                NVMLDevice(
                    index=gpu.index,
                    uuid=_text(uuid),
                    name=gpu.name if name is None else _text(name),
                    handle=handle,
                    parent_handle=gpu.handle,
                    gpu_instance_id=gi,
                    compute_instance_id=ci,
                )
            )
        return migs

    def _query(self, kind: str, device: NVMLDevice, fn: Callable[..., Any], *args: Any) -> Any:
        where = f"{'MIG device' if device.is_mig else 'GPU'} {device.index} ({device.name}, {device.uuid})"
        return self._call(kind, where, fn, *args, key=device.uuid)

    def _call(self, kind: str, where: str, fn: Callable[..., Any], *args: Any, key: str | None = None) -> Any:
        try:
            return fn(*args)
        except Exception as err:
            self._warn_once(
                (kind, key or where), f"NVML cannot report {kind} of {where}: {_describe(err)}; reported as unavailable"
            )
            return None

    def _warn_once(self, key: tuple[str, ...], message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        if self._warn is not None:
            self._warn(message)
        else:
            warnings.warn(message, NVMLWarning, stacklevel=3)


class _Resolver:
    """Finds the NVML device for one torch index; the rules of :meth:`NVMLSession.map_torch_devices`."""

    def __init__(self, devices: list[NVMLDevice], entries: list[str] | None, device_order: str | None) -> None:
        self.devices = devices
        self.gpus = [d for d in devices if not d.is_mig]
        self.entries = entries
        self.pci_order = device_order == "PCI_BUS_ID" or len({gpu.name for gpu in self.gpus}) <= 1
        self.order_note = f"CUDA_DEVICE_ORDER={device_order or 'FASTEST_FIRST'}"

    def resolve(self, index: int, uuid: str | None) -> tuple[NVMLDevice | None, str | None]:
        device, problem = self._resolve(index, uuid)
        if device is None and index == 0 and len(self.devices) == 1 and not self.devices[0].is_mig:
            # NVML sees one whole GPU, and CUDA sees a device: it can only be that GPU, whatever CUDA_VISIBLE_DEVICES
            # calls it (a container that numbers the host's GPUs, say)
            return self.devices[0], None
        return device, problem

    def _resolve(self, index: int, uuid: str | None) -> tuple[NVMLDevice | None, str | None]:
        if uuid is not None:
            key = normalize_uuid(uuid)
            matches = [d for d in self.devices if normalize_uuid(d.uuid) == key]
            if len(matches) == 1:
                return matches[0], None
            return None, f"CUDA reports UUID {uuid!r}, which matches {len(matches)} NVML devices"
        if self.entries is None:
            entry, source = str(index), f"CUDA_VISIBLE_DEVICES is unset, so this is CUDA's GPU {index}"
        elif index < len(self.entries):
            entry, source = self.entries[index], f"CUDA_VISIBLE_DEVICES entry {index} is {self.entries[index]!r}"
        else:
            return None, f"CUDA_VISIBLE_DEVICES lists only {len(self.entries)} device(s)"
        return self._resolve_entry(entry, source)

    def _resolve_entry(self, entry: str, source: str) -> tuple[NVMLDevice | None, str | None]:
        legacy = _LEGACY_MIG.match(entry)
        if legacy is not None:
            parents = self._by_prefix(self.gpus, legacy["gpu"])
            gi, ci = int(legacy["gi"]), int(legacy["ci"])
            found = [
                d
                for d in self.devices
                if d.is_mig
                and d.gpu_instance_id == gi
                and d.compute_instance_id == ci
                and any(d.parent_handle is p.handle for p in parents)
            ]
            found = found or [d for d in self.devices if d.is_mig and d.uuid == entry]
            return self._one(found, source, "no MIG device with that parent GPU and instance ids")
        if entry.startswith("MIG-"):
            found = self._by_prefix([d for d in self.devices if d.is_mig], entry)
            return self._one(found, source, "no MIG device has that UUID")
        if entry.startswith("GPU-"):
            return self._whole_gpu(self._by_prefix(self.gpus, entry), source, "no GPU has that UUID (prefix)")
        ordinal = int(entry)
        if not self.pci_order:
            names = ", ".join(sorted({gpu.name for gpu in self.gpus}))
            return None, (
                f"{source}, an index, but the GPUs differ ({names}) and under {self.order_note} CUDA numbers "
                "them fastest first while NVML numbers them by PCI bus"
            )
        return self._whole_gpu([g for g in self.gpus if g.index == ordinal], source, f"NVML has no GPU {ordinal}")

    def _whole_gpu(self, found: list[NVMLDevice], source: str, missing: str) -> tuple[NVMLDevice | None, str | None]:
        gpu, problem = self._one(found, source, missing)
        if gpu is not None and any(d.parent_handle is gpu.handle for d in self.devices):
            return None, f"{source}, GPU {gpu.index} ({gpu.uuid}), which is in MIG mode: CUDA sees its MIG devices"
        return gpu, problem

    @staticmethod
    def _by_prefix(candidates: list[NVMLDevice], entry: str) -> list[NVMLDevice]:
        key = normalize_uuid(entry)
        if not key:
            return []
        exact = [d for d in candidates if normalize_uuid(d.uuid) == key]
        return exact or [d for d in candidates if normalize_uuid(d.uuid).startswith(key)]

    @staticmethod
    def _one(found: list[NVMLDevice], source: str, missing: str) -> tuple[NVMLDevice | None, str | None]:
        if len(found) == 1:
            return found[0], None
        if not found:
            return None, f"{source}: {missing}"
        return None, f"{source}, which matches {len(found)} NVML devices"


def normalize_uuid(value: str) -> str:
    """Lower-case ``value`` and strip its ``GPU-``/``MIG-`` prefixes, so UUIDs from NVML and CUDA compare equal.

    Args:
        value: a UUID as NVML, CUDA or ``CUDA_VISIBLE_DEVICES`` write it.

    Example::

        >>> normalize_uuid("GPU-5A3F-01")
        '5a3f-01'
    """
    text = value.strip().lower()
    while text.startswith(("gpu-", "mig-")):
        text = text[4:]
    return text


def parse_visible_devices(value: str | None) -> list[str] | None:
    """Split ``CUDA_VISIBLE_DEVICES`` into its entries the way CUDA reads it.

    Entries are stripped; ``GPU-``/``MIG-`` names are kept as written, integers are written back in decimal (CUDA
    reads ``"1gpu"`` as ``1``, like ``strtoul``). Parsing stops at the first entry that is neither, or a negative
    integer; a repeated entry hides every device, as in CUDA.

    Args:
        value: the variable's value, ``None`` when it is unset.

    Returns:
        ``None`` when unset (every GPU visible), else the entries; ``[]`` hides every GPU.

    Example::

        >>> parse_visible_devices("1, 0,-1,2")
        ['1', '0']
    """
    if value is None:
        return None
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry.startswith(("GPU-", "MIG-")):
            number = re.match(r"[+-]?\d+", entry)
            if number is None or int(number.group()) < 0:
                break
            entry = str(int(number.group()))
        if entry in entries:
            return []
        entries.append(entry)
    return entries


def torch_device_uuid(index: int) -> str | None:
    """The UUID CUDA reports for torch device ``index``, or ``None`` without a usable CUDA build.

    This initialises CUDA when it is available (reading device properties needs it); it never raises.

    Args:
        index: torch CUDA device index.
    """
    try:
        if torch.version.cuda is None or not torch.cuda.is_available():
            return None
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(err: BaseException) -> str:
    return f"{err} ({type(err).__name__})"
