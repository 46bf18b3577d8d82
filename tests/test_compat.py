"""The compatibility module: version checks, the error at setup, and the accessors on a real Trainer."""

import warnings

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import NaNSkip
from lightning_mgpu.core import compat
from lightning_mgpu.core.compat import versions as compat_versions
from lightning_mgpu.strategies import MultiGPUStrategy


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(14, 4, generator=generator), torch.randn(14, 1, generator=generator))
        return DataLoader(data, batch_size=2)


def _trainer(**kwargs) -> pl.Trainer:
    options = dict(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    options.update(kwargs)
    return pl.Trainer(enable_model_summary=False, **options)


@pytest.mark.parametrize(
    ("version", "tested"),
    [("2.5.1", False), ("2.5.2", True), ("2.5.6", True), ("2.6.6", True), ("2.6.0rc1", True), ("2.7.0", False)],
)
def test_the_tested_range_is_read_from_the_release_number(version, tested):
    assert compat.lightning_is_tested(version) is tested


def test_the_installed_lightning_has_every_internal():
    torch.manual_seed(0)
    trainer = _trainer(max_steps=1)
    trainer.fit(_Regression())
    assert compat.missing_lightning_internals(trainer) == []
    assert compat.sigterm_internals_missing(trainer) is None


def test_a_missing_internal_stops_the_fit_at_setup_naming_each_one():
    torch.manual_seed(0)
    trainer = _trainer(callbacks=[NaNSkip()])
    del trainer.fit_loop.epoch_loop._batches_that_stepped  # as a Lightning without it would be
    model = _Regression()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(compat.UnsupportedLightningError) as error:
        trainer.fit(model)
    message = str(error.value)
    assert message.startswith("NaNSkip: Lightning ")
    assert "_TrainingEpochLoop._batches_that_stepped" in message
    assert "lightning>=2.5.2,<2.7" in message
    assert trainer.global_step == 0  # stopped before training
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_an_untested_lightning_with_every_internal_warns_once_and_runs(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setattr(lightning, "__version__", "2.7.0")
    compat_versions._warn_untested_once.cache_clear()
    trainer = _trainer(max_steps=2, callbacks=[NaNSkip()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Regression())
        compat.check_lightning_internals(trainer, "NaNSkip")  # a second fit in the process: no second warning
    untested = [w for w in caught if "Lightning 2.7.0 is installed" in str(w.message)]
    assert len(untested) == 1
    assert trainer.global_step == 2
    compat_versions._warn_untested_once.cache_clear()


def test_multi_gpu_strategy_refuses_a_lightning_that_would_not_ask_it_to_choose(monkeypatch):
    monkeypatch.delattr(LightningDDPStrategy, "_configure_launcher")
    with pytest.raises(compat.UnsupportedLightningError, match=r"MultiGPUStrategy: .*_configure_launcher"):
        MultiGPUStrategy()


class _TrainEnd(pl.Callback):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def on_train_end(self, trainer, pl_module):
        self.calls.append("on_train_end")


def _noop(*args) -> None:
    pass


def test_leaving_training_runs_the_callback_once_before_on_train_end_and_restoring_stops_it():
    torch.manual_seed(0)
    calls = []
    trainer = _trainer(max_steps=3, max_epochs=3, callbacks=[_TrainEnd(calls)])
    compat.replace_sigterm_handling(trainer, _noop, _noop, _noop, lambda: calls.append("leaving"))
    trainer.fit(_Regression())
    assert calls == ["leaving", "on_train_end"]
    compat.restore_sigterm_handling(trainer)
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(_Regression())  # goes on to step 5 and leaves training again
    assert trainer.global_step == 5
    assert calls == ["leaving", "on_train_end", "on_train_end"]
    other = _trainer(max_steps=2, callbacks=[_TrainEnd(calls)])
    other.fit(_Regression())  # the patch acts on a trainer that has the pack's signal connector only
    assert calls[-2:] == ["on_train_end", "on_train_end"] and calls.count("leaving") == 1


def test_a_restored_trainer_gets_lightnings_signal_connector_back_with_what_the_fit_recorded():
    trainer = _trainer(max_steps=1)
    lightnings = trainer._signal_connector
    compat.replace_sigterm_handling(trainer, _noop, _noop, _noop, _noop)
    compat.replace_sigterm_handling(trainer, _noop, _noop, _noop, _noop)  # a second install replaces the first
    assert trainer._signal_connector.replaced is lightnings
    trainer._signal_connector._original_handlers = {15: _noop}  # as registering the handlers records them
    compat.mark_sigterm_received(trainer)
    compat.restore_sigterm_handling(trainer)
    assert trainer._signal_connector is lightnings
    assert trainer.received_sigterm and lightnings._original_handlers == {15: _noop}
    compat.restore_sigterm_handling(trainer)  # nothing left to restore
    assert trainer._signal_connector is lightnings


class _Probe(pl.Callback):
    def __init__(self) -> None:
        self.logging, self.steps, self.accumulating = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.accumulating.append(compat.should_accumulate(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logging.append(compat.is_logging_step(trainer))
        self.steps.append(compat.logger_step(trainer))


def test_logging_step_logger_step_and_accumulation_follow_lightning():
    torch.manual_seed(0)
    probe = _Probe()
    trainer = _trainer(max_epochs=1, log_every_n_steps=2, accumulate_grad_batches=2, callbacks=[probe])
    trainer.fit(_Regression())
    # 7 batches, a step every 2nd batch and at the epoch's end: steps end at batches 2, 4, 6 and 7
    assert probe.accumulating == [True, False, True, False, True, False, False]
    # read at on_train_batch_end, before Lightning counts the step: the step under way is the logger step + 1
    assert probe.steps == [0, 0, 1, 1, 2, 2, 3]
    # the 2nd and 4th optimizer steps are logged: every batch that belongs to them says so
    assert probe.logging == [False, False, True, True, False, False, True]


def test_the_strategy_probes_see_lightnings_ddp_internals_and_report_a_missing_one():
    from lightning_mgpu import DDPStrategy

    trainer = _trainer(strategy=DDPStrategy(), callbacks=[])  # built, not fitted: no process group
    strategy_probes = [i for i in compat.LIGHTNING_INTERNALS if i.name.startswith(("DDPStrategy.", "Parallel"))]
    assert len(strategy_probes) == 10
    assert [i.name for i in strategy_probes if not i.present(trainer)] == []
    del trainer.strategy._ddp_kwargs  # as a Lightning that keeps them elsewhere
    assert [i.name for i in strategy_probes if not i.present(trainer)] == ["DDPStrategy._ddp_kwargs"]


def test_every_patch_of_lightning_is_named_in_one_place_installed_once_and_reversible():
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = _trainer(max_steps=1)
    MultiGPUStrategy()
    compat.replace_sigterm_handling(trainer, _noop, _noop, _noop, _noop)
    compat.restore_sigterm_handling(trainer)
    with compat.LogCapture(BoringModel(), _noop):
        pass
    undo_routing = compat.route_eval_steps(trainer, _noop)  # the one patch put in place per evaluation loop
    try:
        assert compat.installed_patches() == list(compat.PATCHES)
        owners = {name: compat.patched_class(name) for name in compat.PATCHES}
        patched = {name: getattr(owners[name], method) for name, (_, _, method) in compat.PATCHES.items()}
        try:
            for name, (_, _, method) in compat.PATCHES.items():
                assert compat.remove_patch(name)
                assert getattr(owners[name], method) is patched[name].__wrapped__  # Lightning's own
                assert not compat.remove_patch(name)
            assert compat.installed_patches() == []
        finally:
            for name, (_, _, method) in compat.PATCHES.items():
                setattr(owners[name], method, patched[name])
        compat.replace_sigterm_handling(trainer, _noop, _noop, _noop, _noop)  # installs nothing a second time
        compat.restore_sigterm_handling(trainer)
        assert all(getattr(owners[name], m) is patched[name] for name, (_, _, m) in compat.PATCHES.items())
    finally:
        undo_routing()  # the evaluation loop's end: Lightning's dispatch back, the others stay
    assert compat.installed_patches() == [name for name in compat.PATCHES if name not in compat.PER_LOOP_PATCHES]


def test_each_lightning_patch_is_named_in_place_and_reversible():
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    MultiGPUStrategy()  # installs the strategy replacement; `import lightning_mgpu` installed the name hint
    assert compat.installed_connector_patches() == list(compat.CONNECTOR_PATCHES)
    patched = {name: getattr(_AcceleratorConnector, method) for name, method in compat.CONNECTOR_PATCHES.items()}
    try:
        for name, method in compat.CONNECTOR_PATCHES.items():
            assert compat.remove_connector_patch(name)
            assert getattr(_AcceleratorConnector, method) is patched[name].__wrapped__  # Lightning's own
            assert not compat.remove_connector_patch(name)  # nothing left to remove
        assert compat.installed_connector_patches() == []
        with pytest.raises(ValueError) as refused:
            Trainer(strategy="mgpu_dpp", accelerator="cpu", logger=False)
        assert "did you mean" not in str(refused.value)  # Lightning's own message, without the hint
    finally:
        for name, method in compat.CONNECTOR_PATCHES.items():
            setattr(_AcceleratorConnector, method, patched[name])
    assert compat.installed_connector_patches() == list(compat.CONNECTOR_PATCHES)


def test_a_strategy_chosen_at_launch_is_the_trainers_and_the_users_object_says_why():
    from lightning.pytorch import Trainer

    from lightning_mgpu.strategies import SingleDeviceStrategy

    chooser = MultiGPUStrategy()
    trainer = Trainer(strategy=chooser, accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is SingleDeviceStrategy and type(chooser) is MultiGPUStrategy
    assert trainer.strategy.choice is chooser.choice and chooser.choice.mode == "single"


def test_a_patch_someone_else_wrapped_since_stays_and_is_not_wrapped_twice():
    import functools

    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    MultiGPUStrategy()
    method = compat.CONNECTOR_PATCHES["strategy_replacement"]
    ours = getattr(_AcceleratorConnector, method)

    @functools.wraps(ours)  # copies our marker, not our identity
    def theirs(self):
        return ours(self)

    setattr(_AcceleratorConnector, method, theirs)
    try:
        assert not compat.remove_connector_patch("strategy_replacement")  # theirs is outermost: both stay
        assert getattr(_AcceleratorConnector, method) is theirs
        assert "strategy_replacement" in compat.installed_connector_patches()  # ours, under theirs
        MultiGPUStrategy()
        assert getattr(_AcceleratorConnector, method) is theirs  # not wrapped a second time
    finally:
        setattr(_AcceleratorConnector, method, ours)


def test_a_chosen_strategy_the_trainer_never_got_stops_the_fit_naming_the_patch():
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    chooser = MultiGPUStrategy(mode="single")  # its construction installs the patch: take it out afterwards
    assert compat.remove_connector_patch("strategy_replacement")
    try:
        trainer = Trainer(strategy=chooser, accelerator="cpu", devices=1, max_steps=1, logger=False)
        assert trainer.strategy is chooser  # the Trainer kept the chooser: nothing handed it the one-device strategy
        with pytest.raises(compat.UnsupportedLightningError, match="patch 'strategy_replacement'"):
            trainer.fit(BoringModel())
    finally:
        MultiGPUStrategy()  # puts the patch back
    assert "strategy_replacement" in compat.installed_connector_patches()
