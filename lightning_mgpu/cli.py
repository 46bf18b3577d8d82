"""LightningCLI with the pack's YAML conventions: omegaconf interpolation, a global batch size, shipped configs."""

from typing import Any

from jsonargparse import set_parsing_settings
from jsonargparse.typing import PositiveInt
from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.pytorch.accelerators import AcceleratorRegistry, MPSAccelerator
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

PER_DEVICE_BATCH_RESOLVER = "mgpu.per_device_batch"


def count_processes(devices: Any, num_nodes: Any = 1, accelerator: str = "auto") -> int:
    """The number of training processes a Trainer with these settings runs: devices per node times nodes.

    ``devices`` is read as the Trainer reads it: ``4`` or ``"4"`` (a count), ``"0,1"`` or ``[0, 1]`` (indices),
    ``-1`` (every GPU) or ``"auto"``. Only ``-1`` and ``"auto"`` look at the hardware, so a config naming its devices
    resolves on a machine without them (a login node). A launcher's ``WORLD_SIZE`` is not consulted: a launching
    process and the processes it starts compute the same number.

    Args:
        devices: the Trainer's ``devices``.
        num_nodes: the Trainer's ``num_nodes``.
        accelerator: the Trainer's ``accelerator``; ``"auto"`` means CUDA where torch sees GPUs, else CPU.

    Raises:
        ValueError: for values the Trainer would refuse too, or ``-1``/``"auto"`` on CUDA with no GPU here.

    Example::

        count_processes(devices=4, num_nodes=2)  # 8
    """
    name = _accelerator_name(accelerator)
    per_node = _devices_per_node(devices, name)
    if isinstance(num_nodes, bool) or not str(num_nodes).isdigit() or int(num_nodes) < 1:
        raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
    return per_node * int(num_nodes)


def per_device_batch_size(
    global_batch_size: Any,
    devices: Any,
    num_nodes: Any = 1,
    accumulate_grad_batches: Any = 1,
    accelerator: str = "auto",
) -> int:
    """The per-process batch size giving ``global_batch_size`` samples per optimizer step.

    Args:
        global_batch_size: samples per optimizer step over all processes and accumulated batches.
        devices: the Trainer's ``devices``.
        num_nodes: the Trainer's ``num_nodes``.
        accumulate_grad_batches: the Trainer's ``accumulate_grad_batches``.
        accelerator: the Trainer's ``accelerator``.

    Raises:
        ValueError: when the global batch does not split evenly, naming every number involved.

    Example::

        per_device_batch_size(256, devices=4, num_nodes=2)  # 32
    """
    if global_batch_size is None or isinstance(global_batch_size, bool) or int(global_batch_size) < 1:
        raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    processes = count_processes(devices, num_nodes, accelerator)
    accumulate = int(accumulate_grad_batches)
    share, remainder = divmod(int(global_batch_size), processes * accumulate)
    if remainder or share == 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not split evenly over {processes} processes"
            f" (devices={devices!r} x num_nodes={num_nodes}) x accumulate_grad_batches={accumulate}: choose a"
            f" multiple of {processes * accumulate}"
        )
    return share


def register_resolvers() -> None:
    """Register the omegaconf resolver ``mgpu.per_device_batch`` (idempotent).

    ``${mgpu.per_device_batch:GLOBAL,DEVICES[,NUM_NODES[,ACCUMULATE[,ACCELERATOR]]]}`` resolves to
    :func:`per_device_batch_size` of those values.

    Example::

        data:
          init_args:
            batch_size: ${mgpu.per_device_batch:${global_batch_size},${trainer.devices},${trainer.num_nodes}}
    """
    if not OmegaConf.has_resolver(PER_DEVICE_BATCH_RESOLVER):
        OmegaConf.register_new_resolver(PER_DEVICE_BATCH_RESOLVER, per_device_batch_size)


class MGPULightningCLI(LightningCLI):
    """``LightningCLI`` that reads the configs in ``lightning_mgpu/configs`` as they are written.

    Three differences from ``LightningCLI``, nothing else:

    - ``parser_mode="omegaconf+"`` by default: ``${...}`` interpolation is resolved once, after every ``--config``
      and command-line override is merged, so ``--trainer.devices=8`` also changes a batch size derived from it.
      Absolute paths (``${trainer.devices}``) work under the ``fit``/``validate`` subcommands: jsonargparse's
      ``omegaconf_absolute_to_relative_paths`` setting is switched on (it is process-wide).
    - Two top-level arguments for the configs' interpolation: ``global_batch_size`` and ``per_device_batch_size``
      (the shipped configs derive the second from the first; a datamodule config reads it as
      ``batch_size: ${per_device_batch_size}``). Neither is passed to any class.
    - The ``${mgpu.per_device_batch:...}`` resolver is registered (see :func:`register_resolvers`).

    Args:
        *args: as for ``LightningCLI``.
        parser_kwargs: as for ``LightningCLI``; ``parser_mode`` defaults to ``"omegaconf+"``.
        **kwargs: as for ``LightningCLI``.

    Example::

        # cli.py
        from lightning_mgpu.cli import MGPULightningCLI
        MGPULightningCLI(MyModel, MyData)

        # python cli.py fit --config "$(python -m lightning_mgpu config cpu)" --global_batch_size=512
    """

    def __init__(self, *args: Any, parser_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        register_resolvers()
        set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
        parser_kwargs = dict(parser_kwargs or {})
        parser_kwargs.setdefault("parser_mode", "omegaconf+")
        super().__init__(*args, parser_kwargs=parser_kwargs, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as ``LightningCLI`` does; a failed interpolation ends in a usage error, not a traceback."""
        try:
            super().parse_arguments(parser, args)
        except InterpolationResolutionError as err:
            parser.error(str(err))

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add ``global_batch_size`` and ``per_device_batch_size``, read by interpolation only."""
        parser.add_argument(
            "--global_batch_size",
            type=PositiveInt | None,
            default=None,
            help="samples per optimizer step over all processes",
        )
        parser.add_argument(
            "--per_device_batch_size",
            type=PositiveInt | None,
            default=None,
            help="samples per batch per process; the shipped configs derive it from global_batch_size",
        )


def _devices_per_node(devices: Any, accelerator: str) -> int:
    text = devices.strip() if isinstance(devices, str) else devices
    if isinstance(text, (list, tuple)) and text and all(isinstance(i, int) for i in text):
        return len(text)
    if isinstance(text, str) and "," in text:
        indices = [i for i in text.split(",") if i.strip()]
        if indices and all(i.strip().isdigit() for i in indices):
            return len(indices)
    if isinstance(text, str) and text.isdigit():
        text = int(text)
    if isinstance(text, int) and not isinstance(text, bool) and text >= 1:
        return text
    if text in ("auto", -1, "-1"):
        if accelerator == "cuda":
            found = num_cuda_devices()
            if found == 0:
                raise ValueError(f"devices={devices!r} with accelerator='cuda': torch sees no CUDA GPU on this machine")
            return found
        if text == "auto":
            return 1  # Lightning's CPU and MPS accelerators use one device by default
    raise ValueError(
        f"devices={devices!r} cannot be used with accelerator={accelerator!r}: give a count >= 1, indices such as"
        " '0,1' or [0, 1], or 'auto' (-1 too on CUDA)"
    )


def _accelerator_name(accelerator: Any) -> str:
    name = str(accelerator or "auto")
    if name in ("auto", "gpu"):
        if num_cuda_devices() > 0:
            return "cuda"
        if name == "gpu" and MPSAccelerator.is_available():
            return "mps"
        return "cpu" if name == "auto" else "cuda"
    if name not in AcceleratorRegistry:
        raise ValueError(f"accelerator={accelerator!r} is not one of {sorted(AcceleratorRegistry)}")
    return name
