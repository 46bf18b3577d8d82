"""What NaNSkip holds for one fit: made when the fit starts, dropped at its end."""

from collections.abc import Sequence

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_mgpu.core.step_service import StepService, step_service
from lightning_mgpu.stability.bad_steps import BadStepTest
from lightning_mgpu.stability.nan_skip_config import NaNSkipConfig
from lightning_mgpu.stability.skip_reports import LaggedRead, SkipReports
from lightning_mgpu.stability.skip_tally import SkipTally
from lightning_mgpu.stability.spike_rollback import SpikeRollback
from lightning_mgpu.stability.step_skipper import StepSkipper


class NaNSkipFit:
    """One fit's collaborators of NaNSkip, each holding its own per-fit state.

    Made at ``on_fit_start``, after ``configure_model`` (which may build layers after ``setup``) and once the
    optimizers exist; every optimizer's per-step verdict is then :attr:`test`'s (the one source of "this step is bad"
    for the pack's callbacks). :meth:`close` at the fit's end, or its exception, leaves the optimizers it hooked as
    they were and lets the rollback snapshot's host memory go; a construction that raises closes what it built.

    Args:
        owner: the callback's class name, for messages.
        config: the callback's options.
        tally: what the callback keeps from fit to fit; its counters move to the fit's device.
        trainer: the trainer whose fit starts.
        pl_module: its module.

    Attributes:
        optimizers: the optimizers of the fit, which it hooks.
        service: the fit's step service, where :attr:`test` is every optimizer's decider.
        test: the verdict of each optimizer step, and the spike test.
        skipper: how each optimizer's bad steps are skipped.
        reports: the info lines and events.
        rollback: the snapshots and rollbacks, with ``spike_action="rollback"``; else ``None``.
        lagged: reads the count of bad steps in a row one step late, where the skip needs no host read.
    """

    def __init__(
        self,
        owner: str,
        config: NaNSkipConfig,
        tally: SkipTally,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
    ) -> None:
        device = pl_module.device
        tally.to(device)
        self.service: StepService = step_service(trainer)
        self.service.new_gradients()
        self.optimizers = list(trainer.optimizers)  # the ones it hooks, unhooked at close whatever the trainer holds
        self.test = BadStepTest(
            config,
            tally,
            owner,
            device,
            self.service,
            distributed=trainer.world_size > 1,
            names={id(p): name for name, p in pl_module.named_parameters()},
            optimizer_index={id(optimizer): i for i, optimizer in enumerate(self.optimizers)},
        )
        self.rollback: SpikeRollback | None = None
        self.skipper = StepSkipper(owner, config.skip_on_device, trainer, pl_module)  # unhooks itself if it raises
        try:
            self.reports = SkipReports(owner, tally)
            if config.rollback:
                self.rollback = SpikeRollback(owner, config, tally, trainer)
            self.lagged = LaggedRead()
            for optimizer in self.optimizers:
                self.service.decide_steps(optimizer, self.test.decide)
        except BaseException:
            self.close()  # the hooks the skipper attached stay on the user's optimizers otherwise
            raise

    def close(self, current: Sequence[Optimizer] = ()) -> None:
        """Unregister the verdicts, take found_inf, fused routes and masks off the optimizers, drop the snapshot.

        ``current``: the trainer's optimizers now, where one built after the fit started may hold a ``found_inf``.
        """
        self.rollback = None
        optimizers = self.optimizers + [optimizer for optimizer in current if optimizer not in self.optimizers]
        for optimizer in optimizers:
            self.service.stop_deciding(optimizer, self.test.decide)
        self.skipper.remove(optimizers)
