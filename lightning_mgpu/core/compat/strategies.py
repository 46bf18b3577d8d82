"""Lightning's strategies and its accelerator connector, DDP's reducer, FSDP2's mesh, and the patches of Lightning."""

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from torch import nn
from torch.optim import Optimizer

from lightning_mgpu.core.compat.patches import PATCHES, install_patch, installed_patches, remove_patch
from lightning_mgpu.core.compat.versions import TESTED_LIGHTNING_RANGE, UnsupportedLightningError

# the patches of Lightning's private ``_AcceleratorConnector`` (2.5.2-2.6.6), among those named in ``patches.PATCHES``
CONNECTOR_PATCHES = {name: method for name, (_, cls, method) in PATCHES.items() if cls == "_AcceleratorConnector"}


def remove_connector_patch(name: str) -> bool:
    """Give Lightning's connector its own method back: :func:`~lightning_mgpu.core.compat.patches.remove_patch`."""
    return name in CONNECTOR_PATCHES and remove_patch(name)


def installed_connector_patches() -> list[str]:
    """The names of :data:`CONNECTOR_PATCHES` in place now, under other wrappers or not."""
    return [name for name in installed_patches() if name in CONNECTOR_PATCHES]


def install_strategy_flag_hint(add_hint: Callable[[Any, ValueError], None]) -> bool:
    """Let ``add_hint(strategy_flag, error)`` amend Lightning's error for a strategy flag it does not know.

    Lightning checks the flag in the private ``_AcceleratorConnector._check_config_and_set_final_flags`` (2.5.2-2.6.6,
    probed): the patch ``"strategy_flag_hint"`` wraps it once. Fallback, where it is missing: Lightning's message as
    it is.

    Returns:
        Whether the hint is in place.
    """

    def make_wrapper(check: Callable[..., Any]) -> Callable[..., Any]:
        def check_with_hint(self: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return check(self, strategy, *args, **kwargs)
            except ValueError as err:
                add_hint(strategy, err)
                raise

        return check_with_hint

    return install_patch("strategy_flag_hint", make_wrapper)


def install_strategy_replacement() -> bool:
    """Let a :class:`DDPStrategyBase` hand the Trainer another strategy once its launch is decided.

    Lightning's connector finishes a strategy in the private ``_lazy_init_strategy`` (2.5.2-2.6.6, probed), which ends
    by configuring the launcher, where :meth:`DDPStrategyBase.before_launch` runs. The patch
    ``"strategy_replacement"`` then takes :meth:`DDPStrategyBase.launch_replacement`, when there is one, as the
    Trainer's strategy. Any other strategy is left as it is.

    Returns:
        Whether the patch is in place.
    """

    def make_wrapper(lazy_init: Callable[..., Any]) -> Callable[..., Any]:
        def lazy_init_then_replace(self: Any) -> None:
            lazy_init(self)
            strategy = self.strategy
            if isinstance(strategy, DDPStrategyBase) and (replacement := strategy.launch_replacement()) is not None:
                self.strategy = replacement

        return lazy_init_then_replace

    return install_patch("strategy_replacement", make_wrapper)


def replace_trainer_strategy(trainer: "pl.Trainer", strategy: "pl.strategies.Strategy") -> None:
    """From now on ``trainer.strategy`` is ``strategy``: the connector's ``strategy``, and a launcher's (2.5.2-2.6.6).

    For a choice that can only be made once the fit's model and data are known (the memory plan, at ``setup``): the
    Trainer reads its strategy from the connector at every step of the fit (probed at setup: see
    :data:`LIGHTNING_INTERNALS`). A process-starting launcher that kept the previous strategy
    (``_MultiProcessingLauncher._strategy``) keeps the new one instead.
    """
    previous = trainer.strategy
    trainer._accelerator_connector.strategy = strategy
    launcher = strategy.launcher
    if launcher is not None and getattr(launcher, "_strategy", None) is previous:
        launcher._strategy = strategy


class DDPStrategyBase(LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` with two private hooks reached by public names (2.5.2-2.6.6).

    - :meth:`before_launch` runs where Lightning's accelerator connector calls the private ``_configure_launcher``:
      last, once the accelerator, devices, cluster environment and number of nodes are set.
    - :meth:`register_own_comm_hook` runs where Lightning calls the private ``_register_ddp_hooks``, after wrapping
      the model.

    With the patch ``"strategy_replacement"`` (:func:`install_strategy_replacement`), a strategy that chose another
    one in :meth:`before_launch` hands it to the Trainer through :meth:`launch_replacement`.
    """

    def before_launch(self) -> bool:
        """Decide what to launch; return ``False`` to skip configuring DDP's launcher."""
        return True

    def launch_replacement(self) -> "pl.strategies.Strategy | None":
        """The strategy the Trainer holds instead of this one, decided in :meth:`before_launch`; ``None`` keeps it."""
        return None

    def register_own_comm_hook(self) -> bool:
        """Register a hook of the subclass's own; return ``False`` to let Lightning register its ``ddp_comm_hook``."""
        return False

    def _configure_launcher(self) -> None:
        if self.before_launch():
            super()._configure_launcher()

    def _register_ddp_hooks(self) -> None:
        if not self.register_own_comm_hook():
            super()._register_ddp_hooks()


def check_launch_hook(strategy: LightningDDPStrategy) -> None:
    """Stop at construction if Lightning would not call :meth:`DDPStrategyBase.before_launch` (no choice made).

    Installs the patch ``"strategy_replacement"`` (:func:`install_strategy_replacement`), which the choice needs.

    Raises:
        UnsupportedLightningError: where ``DDPStrategy._configure_launcher``, ``_start_method`` or
            ``_AcceleratorConnector._lazy_init_strategy`` is missing.
    """
    missing = [name for name in ("_configure_launcher",) if name not in vars(LightningDDPStrategy)]
    missing += [name for name in ("_start_method",) if not hasattr(strategy, name)]
    if not install_strategy_replacement():
        missing.append("_AcceleratorConnector._lazy_init_strategy")
    if missing:
        lowest, first_untested = TESTED_LIGHTNING_RANGE
        raise UnsupportedLightningError(
            f"{type(strategy).__name__}: Lightning {lightning.__version__} lacks DDPStrategy internals lightning_mgpu "
            f"relies on: {', '.join(missing)}. lightning_mgpu is tested with lightning>={lowest},<{first_untested}."
        )


def set_start_method(strategy: LightningDDPStrategy, start_method: str) -> None:
    """The process start method Lightning's DDP launcher uses ("popen", "spawn", "fork"...) (2.5.2-2.6.6)."""
    strategy._start_method = start_method


def strategy_plugins(strategy: "pl.strategies.Strategy") -> dict[str, Any]:
    """What the Trainer's connector gave a strategy before its launch: accelerator, checkpoint IO, precision."""
    accelerator: Accelerator | None = strategy.accelerator
    return {
        "accelerator": accelerator,
        "checkpoint_io": strategy._checkpoint_io,
        "precision_plugin": strategy._precision_plugin,
    }


def process_group_timeout(strategy: "pl.strategies.Strategy") -> timedelta | None:
    """The process-group timeout a Lightning strategy was built with, or ``None`` (2.5.2-2.6.6)."""
    return getattr(strategy, "_timeout", None)


def ddp_kwargs(strategy: LightningDDPStrategy) -> dict[str, Any]:
    """The live dict of keyword arguments Lightning builds ``DistributedDataParallel`` with (2.5.2-2.6.6)."""
    return strategy._ddp_kwargs


def set_ddp_kwargs(strategy: LightningDDPStrategy, kwargs: dict[str, Any]) -> None:
    """Replace the keyword arguments Lightning builds ``DistributedDataParallel`` with."""
    strategy._ddp_kwargs = kwargs


def layer_sync(strategy: ParallelStrategy) -> Any:
    """The strategy's ``LayerSync`` plugin (sync-BN), ``None`` if none (2.5.2-2.6.6)."""
    return strategy._layer_sync


def set_layer_sync(strategy: ParallelStrategy, plugin: Any) -> None:
    """Set the ``LayerSync`` plugin the strategy applies when it sets the model up."""
    strategy._layer_sync = plugin


def lightning_comm_state(strategy: LightningDDPStrategy) -> bool:
    """Whether a ``ddp_comm_hook``, ``ddp_comm_state`` or model averaging was set through Lightning (2.5.2-2.6.6)."""
    return bool(
        strategy._ddp_comm_hook is not None or strategy._ddp_comm_state is not None or strategy._model_averaging_period
    )


def wrap_in_ddp(strategy: LightningDDPStrategy, module: nn.Module) -> nn.Module:
    """Wrap ``module`` in ``DistributedDataParallel`` as Lightning's strategy does, with its ``ddp_kwargs``.

    For a re-wrap during a fit (2.5.2-2.6.6). Lightning 2.6 flushes a static graph's first all-reduce once per wrapper
    under manual optimization, so that flag (``_pl_static_graph_delay_done``) is reset too; 2.5.2 has no such flag,
    and setting it there changes nothing.
    """
    model = strategy._setup_model(module)
    strategy._pl_static_graph_delay_done = False
    return model


def register_ddp_hooks(strategy: LightningDDPStrategy) -> None:
    """Register the strategy's DDP communication hooks on its current wrapper (2.5.2-2.6.6)."""
    strategy._register_ddp_hooks()


def ddp_has_comm_hook(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether a communication hook is registered on a ``DistributedDataParallel`` wrapper (torch 2.13)."""
    return bool(getattr(ddp, "_comm_hooks", None))


def broadcast_ddp_buffers(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Broadcast the module's buffers from rank 0 as DDP's forward does: coalesced, through a buffer comm hook.

    Returns ``False`` (nothing done) where this torch has no ``_sync_buffers`` (tested on torch 2.13).
    """
    if not hasattr(ddp, "_sync_buffers"):
        return False
    ddp._sync_buffers()
    return True


def ddp_delayed_params(ddp: nn.parallel.DistributedDataParallel) -> list[nn.Parameter]:
    """The parameters DDP averages by a hook of its own, outside its buckets (``delay_all_reduce_named_params``).

    torch 2.13's ``_delay_all_reduce_params``: that hook issues an all-reduce on every backward that reaches
    ``param_to_hook_all_reduce``, under ``no_sync()`` too. Empty where a torch lacks it.
    """
    return list(getattr(ddp, "_delay_all_reduce_params", ()))


def ddp_buckets_rebuilt(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP has rebuilt its buckets in the order gradients arrived, as it does once after the first backward.

    torch 2.13's ``_has_rebuilt_buckets``; ``True`` where a torch lacks it (no rebuild to wait for).
    """
    return bool(getattr(ddp, "_has_rebuilt_buckets", True))


def reset_ddp_reduction(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Forget the gradients a failed backward marked ready, before DDP's bucket rebuild.

    torch 2.13's reducer ``_reset_state``. After the rebuild a replay works without it, and with it the ranks'
    reductions part ways.
    """
    ddp.reducer._reset_state()


def expect_ddp_backward(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Tell DDP's reducer that a backward pass comes in which every parameter gets a gradient.

    What DDP's forward does after the module returned (``reducer.prepare_for_backward``, torch 2.13), for a rank
    whose forward raised before it got there, or whose backward raised part way.
    """
    ddp.reducer.prepare_for_backward([])


def set_mesh_sizes(strategy: ModelParallelStrategy, data_parallel: int, tensor_parallel: int) -> None:
    """The device-mesh shape Lightning's ``ModelParallelStrategy`` builds at ``setup_environment`` (2.5.2-2.6.6)."""
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


def release_mesh_process_groups(mesh: Any) -> None:
    """Drop the process groups a device mesh (and the mesh it was sliced from) holds: torch 2.13's ``_pg_registry``.

    For after ``destroy_process_group``: DTensor's caches keep the meshes, so the groups and their gloo threads, alive
    until the interpreter tears down. A mesh without the registry (an older torch) is left as it is.
    """
    for holder in (mesh, getattr(mesh, "_root_mesh", None)):
        registry = getattr(holder, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def configure_launcher(strategy: "pl.strategies.Strategy") -> None:
    """Let a strategy build its launcher, as the Trainer's connector does once (2.5.2-2.6.6)."""
    strategy._configure_launcher()


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Give meta-device parameters real memory and initialise them (Lightning's, 2.5.2-2.6.6)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: list[Optimizer], device: torch.device) -> None:
    """Move optimizer state to ``device`` (Lightning's, 2.5.2-2.6.6)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def train_dataloader(trainer: "pl.Trainer") -> Any:
    """The training dataloader(s) the fit will use, built afresh on every call (2.5.2-2.6.6).

    From ``fit``'s argument, the datamodule or the module's ``train_dataloader`` hook: Lightning's fit-loop data source.
    """
    return trainer.fit_loop._data_source.dataloader()


def set_launcher(strategy: "pl.strategies.Strategy", launcher: Any) -> None:
    """Give a strategy the launcher another one built (Lightning's ``Strategy._launcher``, 2.5.2-2.6.6)."""
    strategy._launcher = launcher


def sharded_checkpoint_metadata(path: "str | os.PathLike") -> dict[str, Any]:
    """What a sharded checkpoint folder holds besides the shards: loops, callbacks, hyperparameters (2.5.2-2.6.6).

    Lightning's ``ModelParallelStrategy`` writes it with ``torch.save`` under ``_METADATA_FILENAME`` (``meta.pt``).
    """
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    return torch.load(os.path.join(path, _METADATA_FILENAME), map_location="cpu", weights_only=False)
