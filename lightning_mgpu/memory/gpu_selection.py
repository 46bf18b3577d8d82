"""Choose the visible GPUs with the most free memory, for ``Trainer(devices=...)``, without initialising CUDA.

Free memory is read through NVML (:class:`~lightning_mgpu.core.nvml.NVMLSession`), and each torch index is
matched to its NVML device by ``CUDA_VISIBLE_DEVICES`` (UUIDs, or indices where CUDA and NVML provably number GPUs
alike), never by asking CUDA: a process that initialised CUDA could no longer fork its DDP workers. The choice is
made once per launch. A script Lightning runs again for each further rank (or one started by a launcher from this
process) inherits it through :data:`SELECTED_GPUS_VARIABLE`, so every rank trains on the same GPUs even though the
first rank's memory use has changed the readings.
"""

import os

from lightning.fabric.accelerators.cuda import num_cuda_devices

from lightning_mgpu.core.nvml import NVMLDevice, NVMLSession
from lightning_mgpu.core.validation import check_int, check_number

# holds "2,0": the torch indices chosen first in this launch, read by the processes it starts
SELECTED_GPUS_VARIABLE = "LIGHTNING_MGPU_SELECTED_GPUS"
_OWNER = "select_gpus"


class GPUSelectionError(RuntimeError):
    """Fewer visible GPUs qualify than were asked for, or NVML cannot say which do."""


def select_gpus(
    count: int,
    min_free_mb: float = 0.0,
    session: NVMLSession | None = None,
    visible_count: int | None = None,
) -> list[int]:
    """The torch CUDA indices of the ``count`` visible GPUs with the most free memory, most free first.

    Args:
        count: how many GPUs to return (a positive int).
        min_free_mb: the free memory, in MiB, every chosen GPU must have (0 takes any).
        session: the NVML session to read; a new one by default.
        visible_count: how many CUDA devices torch sees; counted through NVML (as Lightning counts them) by default.

    Returns:
        Indices for ``Trainer(devices=...)``, within the devices ``CUDA_VISIBLE_DEVICES`` leaves visible. Inside a
        process this launch started (a further rank), the first process's choice.

    Raises:
        TypeError, ValueError: a bad ``count`` or ``min_free_mb`` (at the call, naming the parameter).
        GPUSelectionError: NVML is unavailable, a visible device cannot be matched to an NVML device, or fewer than
            ``count`` GPUs have ``min_free_mb`` free; the message lists every visible GPU's free memory.

    Example::

        trainer = Trainer(accelerator="cuda", devices=select_gpus(2, min_free_mb=20_000))
        # in a YAML config read by MGPULightningCLI:  trainer: {devices: "${mgpu.free_gpus:2,20000}"}
    """
    check_int(_OWNER, "count", count, minimum=1)
    check_number(_OWNER, "min_free_mb", min_free_mb, minimum=0, unit="MiB")
    inherited = os.environ.get(SELECTED_GPUS_VARIABLE)
    if inherited:
        chosen = [int(index) for index in inherited.split(",")]
        if len(chosen) == count:
            return chosen
    chosen = _choose(count, float(min_free_mb), session or NVMLSession(warn=lambda message: None), visible_count)
    os.environ[SELECTED_GPUS_VARIABLE] = ",".join(map(str, chosen))
    return chosen


def _choose(count: int, min_free_mb: float, session: NVMLSession, visible_count: int | None) -> list[int]:
    if not session.available:
        raise GPUSelectionError(f"{_OWNER}: cannot read free GPU memory: {session.unavailable_reason}")
    visible = num_cuda_devices() if visible_count is None else visible_count
    if visible < count:
        raise GPUSelectionError(
            f"{_OWNER}: {count} GPU(s) asked for, but torch sees {visible} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    mapping = session.map_torch_devices(range(visible))
    unmapped = [index for index, device in mapping.items() if device is None]
    if unmapped:
        raise GPUSelectionError(
            f"{_OWNER}: cannot tell which NVML GPU torch device(s) {unmapped} are, so their free memory is unknown. "
            "Name the GPUs by UUID in CUDA_VISIBLE_DEVICES (`nvidia-smi -L`), or set CUDA_DEVICE_ORDER=PCI_BUS_ID"
        )
    free = {index: _free_mb(session, device) for index, device in mapping.items() if device is not None}
    enough = [index for index, mb in free.items() if mb is not None and mb >= min_free_mb]
    qualified = sorted(enough, key=lambda index: (-(free[index] or 0.0), index))  # ties: the lower index first
    if len(qualified) < count:
        listing = "; ".join(
            f"cuda:{index} ({device.uuid}): {_describe(free[index])}"
            for index, device in mapping.items()
            if device is not None
        )
        raise GPUSelectionError(
            f"{_OWNER}: {count} GPU(s) with at least {min_free_mb:,.0f} MiB free asked for, {len(qualified)} have "
            f"it. Visible GPUs: {listing}. Lower min_free_mb, ask for fewer, or free memory on them"
        )
    return qualified[:count]


def _free_mb(session: NVMLSession, device: NVMLDevice) -> float | None:
    return session.read(device).memory_free_mb


def _describe(free_mb: float | None) -> str:
    return "free memory unknown" if free_mb is None else f"{free_mb:,.0f} MiB free"
