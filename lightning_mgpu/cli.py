"""LightningCLI with the pack's YAML conventions: omegaconf interpolation, a global batch size, shipped configs."""

from typing import Any

from jsonargparse import set_parsing_settings
from jsonargparse.typing import PositiveInt
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from omegaconf import ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError
from typing_extensions import override

from lightning_mgpu.utilities.batch_size import per_device_batch_size

PER_DEVICE_BATCH_RESOLVER = "mgpu.per_device_batch"


def register_resolvers() -> None:
    """Register the omegaconf resolver ``mgpu.per_device_batch`` (idempotent).

    ``${mgpu.per_device_batch:GLOBAL,DEVICES[,NUM_NODES[,ACCUMULATE[,ACCELERATOR]]]}`` resolves to
    :func:`lightning_mgpu.utilities.batch_size.per_device_batch_size` of those values.

    Example::

        data:
          init_args:
            batch_size: ${mgpu.per_device_batch:${global_batch_size},${trainer.devices},${trainer.num_nodes}}
    """
    if OmegaConf.has_resolver(PER_DEVICE_BATCH_RESOLVER):
        return

    def resolve(global_batch_size, devices, num_nodes=1, accumulate_grad_batches=1, accelerator="auto"):
        if isinstance(devices, ListConfig):  # devices: [0, 1] arrives as omegaconf's list
            devices = list(devices)
        return per_device_batch_size(global_batch_size, devices, num_nodes, accumulate_grad_batches, accelerator)

    # omegaconf 2.4 renamed register_new_resolver to register_resolver (2.3's register_resolver is the legacy API)
    modern = hasattr(OmegaConf, "legacy_register_resolver")
    register = OmegaConf.register_resolver if modern else OmegaConf.register_new_resolver
    register(PER_DEVICE_BATCH_RESOLVER, resolve)


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

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as ``LightningCLI`` does; a failed interpolation ends in a usage error, not a traceback."""
        try:
            super().parse_arguments(parser, args)
        except InterpolationResolutionError as err:
            parser.error(str(err))

    @override
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
