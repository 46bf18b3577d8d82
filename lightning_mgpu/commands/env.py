"""``python -m lightning_mgpu env``: what a multi-GPU run depends on, as text.

Nothing here initialises CUDA: device counts come from ``torch.cuda.device_count()`` (NVML-based once Lightning is
imported), GPUs from NVML, and the UUIDs CUDA reports only when CUDA was already initialised by someone else.
"""

import importlib.metadata
import os
import platform
import sys
from typing import Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_mgpu.core.devices import accelerator_name, devices_per_node, is_positive_int
from lightning_mgpu.core.nvml import NVMLDevice, NVMLSession, torch_device_uuid
from lightning_mgpu.core.strategy_choice import (
    LaunchContext,
    StrategyChoice,
    choose_strategy,
    cuda_is_initialized,
    is_interactive,
)

AcceleratorFlag = Literal["auto", "cpu", "cuda", "gpu"]
ACCELERATORS: tuple[str, ...] = ("auto", "cpu", "cuda", "gpu")
LAUNCH_VARIABLES: tuple[str, ...] = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NNODES",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "LSB_JOBID",
    "JSM_NAMESPACE_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
)


def environment_report(
    accelerator: AcceleratorFlag = "auto",
    devices: int | Literal["auto"] = "auto",
    num_nodes: int = 1,
    session: NVMLSession | None = None,
) -> str:
    """Describe versions, GPUs, backends, the launch context and the strategy ``MultiGPUStrategy`` would choose.

    Args:
        accelerator: the Trainer's ``accelerator`` to assume; ``"auto"`` is CUDA when a GPU is visible, else CPU.
        devices: the Trainer's ``devices`` to assume: a count, ``-1`` or ``"auto"`` (every visible GPU, one CPU).
        num_nodes: the Trainer's ``num_nodes`` to assume.
        session: the NVML session to read GPUs through; by default a new one, whose warnings become notes of the
            report, shut down at the end.

    Raises:
        ValueError: ``devices`` or ``num_nodes`` the Trainer would reject.

    Example::

        print(environment_report(accelerator="cpu", devices=2))
    """
    notes: list[str] = []
    _count_devices(accelerator, devices, num_nodes)
    try:
        context: LaunchContext | str = build_launch_context(accelerator, devices, num_nodes)
    except Exception as err:  # a launch environment Lightning itself rejects, e.g. SLURM's --ntasks
        context = f"Lightning would fail to start here: {err} ({type(err).__name__})"
    own_session = session is None
    nvml = NVMLSession(warn=notes.append) if session is None else session
    num_devices = context.num_devices if isinstance(context, LaunchContext) else 1
    try:
        sections = [
            ("Versions", versions_lines()),
            ("GPUs (NVML)", nvml_lines(nvml, notes)),
            ("CUDA devices seen by torch", torch_device_lines(nvml, notes)),
            ("Backends", backend_lines()),
            ("Process", process_lines()),
            ("Launch", launch_lines(num_devices, num_nodes)),
            ("Strategy", strategy_lines(context, notes)),
        ]
        # the GPU section already says why NVML is unavailable
        reason = nvml.unavailable_reason
        notes = [note for note in notes if not (reason and reason in note)]
    finally:
        if own_session:
            nvml.shutdown()
    if notes:
        sections.append(("Notes", [f"- {note}" for note in notes]))
    lines = ["lightning_mgpu environment"]
    for title, body in sections:
        lines += ["", title, *(f"  {line}" for line in body)]
    return "\n".join(lines)


def build_launch_context(
    accelerator: AcceleratorFlag = "auto", devices: int | Literal["auto"] = "auto", num_nodes: int = 1
) -> LaunchContext:
    """The :class:`LaunchContext` ``MultiGPUStrategy`` would see in this process for these Trainer arguments.

    Mirrors ``MultiGPUStrategy.launch_context`` without a Trainer: the cluster environment is detected in the
    order Lightning's accelerator connector uses.

    Args:
        accelerator: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"gpu"``.
        devices: a count, ``-1`` or ``"auto"``.
        num_nodes: number of nodes.

    Raises:
        ValueError: ``devices`` or ``num_nodes`` the Trainer would reject.
    """
    name, count = _count_devices(accelerator, devices, num_nodes)
    launcher, world_size = detect_launcher(count, num_nodes)
    return LaunchContext(
        accelerator=name,
        num_devices=count,
        num_nodes=num_nodes,
        external_launcher=launcher,
        external_world_size=world_size,
        interactive=is_interactive(),
        cuda_initialized=cuda_is_initialized(),
        fork_available="fork" in mp.get_all_start_methods(),
    )


def visible_cuda_devices() -> int:
    """CUDA devices torch can use, counted without initialising CUDA; 0 on a CPU build."""
    return torch.cuda.device_count() if torch.version.cuda is not None else 0


def detect_launcher(num_devices: int = 1, num_nodes: int = 1) -> tuple[str | None, int]:
    """The cluster environment that launched this process and its world size, or ``(None, 1)``.

    The same detection as Lightning's accelerator connector (TorchElastic, SLURM, LSF, MPI, else Lightning's own,
    which counts as external when ``LOCAL_RANK`` is set), and the world size the strategy sees after the connector's
    ``set_world_ranks`` (``num_nodes * num_devices`` unless the environment reports its own). ``os.environ`` is
    restored afterwards because some environments write to it when built.

    Args:
        num_devices: devices per node given to the Trainer.
        num_nodes: the Trainer's ``num_nodes``.
    """
    from lightning.fabric.plugins.environments import (
        LightningEnvironment,
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    saved = dict(os.environ)
    try:
        candidates = (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment)
        env_type = next((env for env in candidates if env.detect()), LightningEnvironment)
        env = env_type()
        env.set_world_size(num_nodes * num_devices)
        if not env.creates_processes_externally:
            return None, 1
        return env_type.__name__, env.world_size()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def versions_lines() -> list[str]:
    """Python, platform and the versions of the packages a run depends on."""
    import lightning

    import lightning_mgpu

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build, no CUDA"
    return [
        f"python: {platform.python_version()} ({sys.executable})",
        f"platform: {platform.platform()}",
        f"torch: {torch.__version__} ({cuda})",
        f"lightning: {lightning.__version__}",
        f"lightning_mgpu: {lightning_mgpu.__version__}",
        f"nvidia-ml-py: {_distribution_version('nvidia-ml-py') or 'not installed'}",
    ]


def nvml_lines(session: NVMLSession, notes: list[str]) -> list[str]:
    """The driver version and every GPU and MIG device NVML lists, with memory; or why NVML is unavailable.

    Args:
        session: the NVML session to read through.
        notes: receives remarks for the end of the report.
    """
    if not session.start():
        return [f"NVML unavailable: {session.unavailable_reason}"]
    devices = session.devices()
    gpus = [device for device in devices if not device.is_mig]
    lines = [f"driver: {session.driver_version() or 'unknown'}", f"GPUs: {len(gpus)}"]
    for device in devices:
        reading = session.read(device)
        memory = f"memory {_mib(reading.memory_total_mb)} total, {_mib(reading.memory_free_mb)} free"
        if device.is_mig:
            instance = f"MIG {device.gpu_instance_id}/{device.compute_instance_id}"
            lines.append(f"  {instance} of GPU {device.index}: {device.name}, {device.uuid}, {memory}")
        else:
            load = (
                f"{_unit(reading.utilization_pct, '%')} busy, {_unit(reading.temperature_c, ' C')}, "
                f"{_unit(reading.power_w, ' W')}"
            )
            lines.append(f"GPU {device.index}: {device.name}, {device.uuid}, {memory}, {load}")
    if len({gpu.name for gpu in gpus}) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        notes.append(
            "the GPUs are of different models: CUDA numbers them fastest first, NVML and nvidia-smi by PCI bus; "
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID so indices agree"
        )
    if gpus and torch.version.cuda is None:
        notes.append(f"NVML sees {len(gpus)} GPU(s) but this torch is a CPU build: install a CUDA build to use them")
    return lines


def torch_device_lines(
    session: NVMLSession, notes: list[str], device_count: int | None = None, uuids: list[str | None] | None = None
) -> list[str]:
    """``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER`` and the NVML device behind each torch CUDA index.

    Args:
        session: the NVML session to map through.
        notes: receives remarks for the end of the report.
        device_count: torch CUDA devices; by default counted without initialising CUDA.
        uuids: the UUID CUDA reports per torch index; by default read only when CUDA is already initialised.
    """
    count = visible_cuda_devices() if device_count is None else device_count
    lines = [
        f"CUDA_VISIBLE_DEVICES: {_env('CUDA_VISIBLE_DEVICES', 'unset (every GPU)')}",
        f"CUDA_DEVICE_ORDER: {_env('CUDA_DEVICE_ORDER', 'unset (FASTEST_FIRST)')}",
        f"torch.cuda.device_count(): {count}",
    ]
    if count == 0:
        return lines
    if uuids is None and cuda_is_initialized():
        uuids = [torch_device_uuid(index) for index in range(count)]
    if not session.start():
        return [*lines, "torch index -> NVML device: unknown, NVML is unavailable"]
    mapping = session.map_torch_devices(range(count), uuids)
    lines += [f"cuda:{index} -> {_describe_device(device)}" for index, device in mapping.items()]
    if None in mapping.values():
        notes.append("a torch device without an NVML device gets no GPU readings from lightning_mgpu's monitors")
    return lines


def backend_lines() -> list[str]:
    """Which ``torch.distributed`` backends this torch build has."""
    if not dist.is_available():
        return ["torch.distributed: not available in this build"]
    nccl = "no"
    if torch.version.cuda is not None and dist.is_nccl_available():
        nccl = f"yes ({_nccl_version()})"
    return [
        "torch.distributed: available",
        f"nccl: {nccl}",
        f"gloo: {_yes(dist.is_gloo_available())}",
        f"mpi: {_yes(dist.is_mpi_available())}",
    ]


def process_lines() -> list[str]:
    """What limits how processes can be started from here: a REPL or notebook, fork, CUDA already initialised."""
    return [
        f"interactive (REPL or notebook): {_yes(is_interactive())}",
        f"'fork' start method: {'available' if 'fork' in mp.get_all_start_methods() else 'not available'}",
        f"CUDA initialised in this process: {_yes(cuda_is_initialized())}",
    ]


def launch_lines(num_devices: int = 1, num_nodes: int = 1) -> list[str]:
    """The launcher environment variables set (torchrun, SLURM, LSF, MPI) and the cluster environment detected.

    Args:
        num_devices: devices per node given to the Trainer.
        num_nodes: the Trainer's ``num_nodes``.
    """
    seen = [f"{name}={os.environ[name]}" for name in LAUNCH_VARIABLES if name in os.environ]
    nccl = [f"{name}={value}" for name, value in sorted(os.environ.items()) if name.startswith("NCCL_")]
    try:
        launcher, world_size = detect_launcher(num_devices, num_nodes)
        detected = (
            f"{launcher}: processes were started outside Lightning (world size {world_size})"
            if launcher is not None
            else "none: Lightning launches the processes itself"
        )
    except Exception as err:
        detected = f"detection failed: {err} ({type(err).__name__})"
    return [
        f"launcher variables: {', '.join(seen) if seen else 'none set'}",
        f"NCCL variables: {', '.join(nccl) if nccl else 'none set'}",
        f"external launcher: {detected}",
    ]


def strategy_lines(context: LaunchContext | str, notes: list[str]) -> list[str]:
    """The mode ``MultiGPUStrategy(mode="auto")`` would choose for ``context`` and why.

    Args:
        context: the launch context to decide for, or why there is none.
        notes: receives remarks for the end of the report.
    """
    if isinstance(context, str):
        return [f"MultiGPUStrategy cannot decide: {context}"]
    choice: StrategyChoice = choose_strategy(context)
    if context.accelerator == "cuda" and context.num_devices == 0:
        notes.append("accelerator 'cuda' with no CUDA device visible to torch: the Trainer would refuse to start")
    return [
        f"assuming: accelerator={context.accelerator}, devices={context.num_devices}, num_nodes={context.num_nodes}",
        f"MultiGPUStrategy would choose: {choice.mode}",
        f"because: {choice.reason}",
    ]


def _count_devices(accelerator: str, devices: int | str, num_nodes: int) -> tuple[str, int]:
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {', '.join(map(repr, ACCELERATORS))}, got {accelerator!r}")
    if not is_positive_int(num_nodes):
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    name = accelerator_name(accelerator)
    if name == "cuda" and devices in ("auto", -1):
        return name, visible_cuda_devices()  # none visible is what this report is for: its notes say so
    if name != "cuda" and devices != "auto" and not is_positive_int(devices):
        raise ValueError(
            f"devices={devices!r} with accelerator={name!r}: give a number of processes (--devices N); -1 and lists"
            " of GPU indices select CUDA GPUs"
        )
    return name, devices_per_node(devices, accelerator)


def _describe_device(device: NVMLDevice | None) -> str:
    if device is None:
        return "unknown (see notes)"
    if device.is_mig:
        return f"MIG {device.gpu_instance_id}/{device.compute_instance_id} of NVML GPU {device.index}, {device.uuid}"
    return f"NVML GPU {device.index}, {device.name}, {device.uuid}"


def _nccl_version() -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception as err:
        return f"version unknown: {err}"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _env(name: str, unset: str) -> str:
    value = os.environ.get(name)
    return unset if value is None else repr(value)


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} MiB"


def _unit(value: float | None, unit: str) -> str:
    return "n/a" if value is None else f"{value:.0f}{unit}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
