"""LightningCLI with the pack's YAML conventions: omegaconf interpolation, a global batch size, shipped configs."""

import inspect
import re
from collections.abc import Iterator
from typing import Any

from jsonargparse import Namespace, set_parsing_settings
from jsonargparse.typing import PositiveInt
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError
from typing_extensions import override

from lightning_mgpu.memory.batch_size import per_device_batch_size
from lightning_mgpu.memory.gpu_selection import select_gpus
from lightning_mgpu.strategies import unknown_strategy_message

PER_DEVICE_BATCH_RESOLVER = "mgpu.per_device_batch"
# the default of the top-level per_device_batch_size: derived from global_batch_size when a config gives that one
DERIVED_BATCH_RESOLVER = "mgpu.derived_per_device_batch"
FREE_GPUS_RESOLVER = "mgpu.free_gpus"
_DERIVED_BATCH_DEFAULT = (
    "${" + DERIVED_BATCH_RESOLVER + ":${.global_batch_size},${.trainer.devices},${.trainer.num_nodes},"
    "${.trainer.accumulate_grad_batches},${.trainer.accelerator}}"
)
# an interpolation that reads per_device_batch_size: ${per_device_batch_size}, or relative as omegaconf+ rewrites it
_READS_PER_DEVICE_BATCH = re.compile(r"\$\{[\w.\[\]]*\bper_device_batch_size\}")


def register_resolvers() -> None:
    """Register the pack's omegaconf resolvers (idempotent): batch arithmetic and GPU selection.

    ``${mgpu.per_device_batch:GLOBAL,DEVICES[,NUM_NODES[,ACCUMULATE[,ACCELERATOR]]]}`` resolves to
    :func:`lightning_mgpu.memory.batch_size.per_device_batch_size` of those values.
    ``mgpu.derived_per_device_batch`` (the same five values) is the default of :class:`MGPULightningCLI`'s
    ``per_device_batch_size``: the same number when ``GLOBAL`` is set, else ``None``, or an error naming the keys
    that read ``${per_device_batch_size}``. ``${mgpu.free_gpus:COUNT[,MIN_FREE_MB]}`` resolves to
    :func:`lightning_mgpu.memory.gpu_selection.select_gpus` of those values: the indices of the ``COUNT`` visible
    GPUs with the most free memory, for ``trainer.devices``.

    Example::

        data:
          init_args:
            batch_size: ${mgpu.per_device_batch:${global_batch_size},${trainer.devices},${trainer.num_nodes}}
    """
    names = (PER_DEVICE_BATCH_RESOLVER, DERIVED_BATCH_RESOLVER, FREE_GPUS_RESOLVER)
    if all(OmegaConf.has_resolver(name) for name in names):
        return

    def resolve(global_batch_size, devices, num_nodes=1, accumulate_grad_batches=1, accelerator="auto"):
        if isinstance(devices, ListConfig):  # devices: [0, 1] arrives as omegaconf's list
            devices = list(devices)
        return per_device_batch_size(global_batch_size, devices, num_nodes, accumulate_grad_batches, accelerator)

    def derive(global_batch_size, devices, num_nodes, accumulate_grad_batches, accelerator, _parent_):
        if global_batch_size is not None:
            return resolve(global_batch_size, devices, num_nodes, accumulate_grad_batches, accelerator)
        readers = list(_per_device_batch_readers(_parent_))
        if readers:
            raise ValueError(
                f"per_device_batch_size is not set, and {', '.join(readers)} reads it: give --global_batch_size=N"
                " (the per-device batch becomes N / (devices x num_nodes x accumulate_grad_batches)) or"
                " --per_device_batch_size=N, on the command line or as a top-level key of a config, or start from a"
                " shipped config (python -m lightning_mgpu config lists them)"
            )
        return None

    # omegaconf 2.4 renamed register_new_resolver to register_resolver (2.3's register_resolver is the legacy API)
    modern = hasattr(OmegaConf, "legacy_register_resolver")
    register = OmegaConf.register_resolver if modern else OmegaConf.register_new_resolver

    def free_gpus(count, min_free_mb=0.0):
        return select_gpus(count, min_free_mb)

    resolvers = (PER_DEVICE_BATCH_RESOLVER, resolve), (DERIVED_BATCH_RESOLVER, derive), (FREE_GPUS_RESOLVER, free_gpus)
    for name, resolver in resolvers:
        if not OmegaConf.has_resolver(name):
            register(name, resolver)


def _per_device_batch_readers(config: DictConfig) -> Iterator[str]:
    """The dotted keys whose unresolved value reads ``per_device_batch_size``."""

    def walk(node: Any, path: str) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from walk(value, f"{path}[{index}]")
        elif isinstance(node, str) and _READS_PER_DEVICE_BATCH.search(node):
            yield path

    yield from walk(OmegaConf.to_container(config, resolve=False), "")


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
      When a config gives ``global_batch_size`` and no ``per_device_batch_size`` (a config of your own with
      ``batch_size: ${per_device_batch_size}``), the per-device batch is derived from the merged trainer settings as
      the shipped configs derive it; when neither is given and a config reads ``${per_device_batch_size}``, parsing
      stops with a usage error that says how to set it.
    - The ``${mgpu.per_device_batch:...}`` resolver is registered (see :func:`register_resolvers`).

    It also checks two things a plain ``LightningCLI`` passes on: a ``trainer.strategy`` name that is not registered
    is a usage error naming the closest registered name (before the Trainer is built), and ``--trainer.devices=4``
    is kept as the int ``4``, as in a YAML file, not as the string ``'4'`` (:class:`MGPUArgumentParser`).

    Args:
        *args: as for ``LightningCLI``.
        parser_kwargs: as for ``LightningCLI``; ``parser_mode`` defaults to ``"omegaconf+"``.
        **kwargs: as for ``LightningCLI``; ``parser_class`` defaults to :class:`MGPUArgumentParser`.

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
        # the subcommands' parsers report jsonargparse's default mode while arguments are added: remember ours
        self._derives_batch_size = parser_kwargs["parser_mode"] == "omegaconf+"
        kwargs.setdefault("parser_class", MGPUArgumentParser)
        super().__init__(*args, parser_kwargs=parser_kwargs, **kwargs)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as ``LightningCLI`` does; a failed interpolation or an unknown strategy name is a usage error."""
        try:
            super().parse_arguments(parser, args)
        except InterpolationResolutionError as err:
            parser.error(str(err))
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        strategy = config.get("trainer.strategy") if isinstance(config, Namespace) else None
        message = unknown_strategy_message(strategy) if isinstance(strategy, str) else None
        if message is not None:
            parser.error(f"trainer.{message}")

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
            # derived by interpolation, which only omegaconf+ resolves after every config is merged
            default=_DERIVED_BATCH_DEFAULT if self._derives_batch_size else None,
            help="samples per batch per process; by default global_batch_size / (devices x num_nodes x"
            " accumulate_grad_batches) when global_batch_size is given, else unset",
        )


class MGPUArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` that reads ``--trainer.devices=4`` as the int ``4``.

    The Trainer annotates ``devices`` as ``list[int] | str | int``; jsonargparse takes the first type that accepts a
    value, so a count given on the command line stayed the string ``'4'`` in the parsed, printed and saved config
    (a YAML file gives the int). Here ``devices`` is declared ``int | list[int] | str``: a count becomes an int, and
    ``"auto"``, ``"0,1"``, ``[0, 1]`` and ``-1`` parse as before.
    """

    @override
    def add_class_arguments(
        self, class_type: Any, nested_key: str | None = None, *args: Any, skip: set | None = None, **kwargs: Any
    ) -> list[str]:
        """Add a class's arguments as jsonargparse does, with ``devices`` typed count-first for a Trainer."""
        devices = _trainer_devices_parameter(class_type)
        if devices is None or nested_key is None or "devices" in (skip or ()):
            return super().add_class_arguments(class_type, nested_key, *args, skip=skip, **kwargs)
        added = super().add_class_arguments(class_type, nested_key, *args, skip={*(skip or ()), "devices"}, **kwargs)
        group = self.groups.get(nested_key, self) if hasattr(self, "groups") else self
        group.add_argument(
            f"--{nested_key}.devices",
            type=int | list[int] | str,
            default=devices.default,
            help="devices per node: a count, a list of indices ([0, 1] or '0,1'), -1 (every GPU) or 'auto'",
        )
        return [*added, f"{nested_key}.devices"]


def _trainer_devices_parameter(class_type: Any) -> inspect.Parameter | None:
    if not (inspect.isclass(class_type) and issubclass(class_type, Trainer)):
        return None
    return inspect.signature(class_type.__init__).parameters.get("devices")
