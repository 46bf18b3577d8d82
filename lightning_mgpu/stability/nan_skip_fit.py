"""What NaNSkip holds for one fit: made when the fit starts, dropped at its end."""

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_mgpu.stability._grad_norms import clear_gradient_norms
from lightning_mgpu.stability._step_verdict import clear_step_verdicts, register_step_decider, unregister_step_decider
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
    for the pack's callbacks). :meth:`close` at the fit's end, or its exception, leaves the optimizers as they were
    and lets the rollback snapshot's host memory go.

    Args:
        owner: the callback's class name, for messages.
        config: the callback's options.
        tally: what the callback keeps from fit to fit; its counters move to the fit's device.
        trainer: the trainer whose fit starts.
        pl_module: its module.

    Attributes:
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
        clear_gradient_norms()
        clear_step_verdicts()
        self.test = BadStepTest(
            config,
            tally,
            owner,
            device,
            distributed=trainer.world_size > 1,
            names={id(p): name for name, p in pl_module.named_parameters()},
            optimizer_index={id(optimizer): i for i, optimizer in enumerate(trainer.optimizers)},
        )
        self.skipper = StepSkipper(owner, config.skip_on_device, trainer, pl_module)
        self.reports = SkipReports(owner, tally)
        self.rollback = SpikeRollback(owner, config, tally, trainer) if config.rollback else None
        self.lagged = LaggedRead()
        for optimizer in trainer.optimizers:
            register_step_decider(optimizer, self.test.decide)

    def close(self, optimizers: list[Optimizer]) -> None:
        """Unregister the verdicts, take found_inf, fused routes and masks off ``optimizers``, drop the snapshot."""
        self.rollback = None
        for optimizer in optimizers:
            unregister_step_decider(optimizer, self.test.decide)
        self.skipper.remove(optimizers)
