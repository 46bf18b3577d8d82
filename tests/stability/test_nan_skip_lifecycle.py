"""NaNSkip's options as attributes, and its per-fit state: started, ended and guarded at the fit's edges."""

import inspect

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_mgpu import NaNSkip
from lightning_mgpu.stability import nan_skip_fit
from lightning_mgpu.stability.nan_skip_config import NaNSkipConfig
from tests.helpers.models import BatchNormClassifier
from tests.helpers.trainer import QUIET

OPTIONS = {
    "check": "loss",
    "max_consecutive": 3,
    "log_skipped": False,
    "progress_bar": False,
    "spike_zscore": 4.0,
    "spike_window": 16,
    "spike_on": "grad_norm",
    "spike_action": "rollback",
    "snapshot_every": 7,
    "max_rollbacks": None,
    "skip_on_device": True,
}


def test_every_option_reads_back_as_an_attribute():
    assert set(OPTIONS) == set(inspect.signature(NaNSkip).parameters)  # every option of the signature
    skip = NaNSkip(**OPTIONS)
    assert {name: getattr(skip, name) for name in OPTIONS} == OPTIONS
    defaults = {name: p.default for name, p in inspect.signature(NaNSkip).parameters.items()}
    assert {name: getattr(NaNSkip(), name) for name in OPTIONS} == defaults


def test_an_option_cannot_be_changed_after_construction():
    skip = NaNSkip()
    with pytest.raises(AttributeError):
        skip.max_consecutive = 3  # validated once: a new callback takes a new value
    assert skip.max_consecutive == 25


def test_the_config_has_no_defaults_of_its_own():
    with pytest.raises(TypeError):
        NaNSkipConfig()  # the callback's signature holds the defaults, once


class GeneratorAccumulates(BatchNormClassifier):
    """Manual optimization in a GAN's rhythm: D steps every batch; G's backward runs after D's step and G steps every
    second batch, so G's loss of an even batch is still in its gradients when the next batch's D steps."""

    def __init__(self, nan_at: int, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.nan_at = nan_at

    def configure_optimizers(self):
        discriminator = [*self.net[0].parameters(), *self.net[1].parameters()]
        return [torch.optim.SGD(discriminator, lr=0.1), torch.optim.SGD(self.net[3].parameters(), lr=0.1)]

    def training_step(self, batch, batch_idx):
        d_opt, g_opt = self.optimizers()
        x, y = batch
        d_opt.zero_grad()
        self.manual_backward(torch.nn.functional.cross_entropy(self(x), y))
        d_opt.step()
        g_loss = torch.nn.functional.cross_entropy(self(x), y)
        if batch_idx == self.nan_at:
            g_loss = g_loss * float("nan")  # NaN gradients, accumulated into G's step of the next batch
        self.manual_backward(g_loss)
        if batch_idx % 2 == 1:
            g_opt.step()
            g_opt.zero_grad()


def test_a_backward_after_a_batchs_last_step_is_not_charged_to_the_next_batch():
    skip = NaNSkip()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[skip], **QUIET)
    model = GeneratorAccumulates(nan_at=2, per_rank_batch=(8,), steps=4)
    trainer.fit(model)
    assert skip.optimizer_steps == 6  # D's 4 and G's 2
    assert skip.skipped_steps == 1  # G's step of batch 3; D's step of batch 3 had a finite loss and gradients
    assert all(torch.isfinite(p).all() for p in model.parameters())


def step_hooks(optimizer: torch.optim.Optimizer) -> int:
    return len(optimizer._optimizer_step_post_hooks)


class KeepsOptimizers(BatchNormClassifier):
    """Remembers the optimizers it made (a failed fit's trainer may not hold them any more)."""

    def configure_optimizers(self):
        self.made = torch.optim.Adam(self.parameters(), lr=0.01, fused=True)  # hooked: found_inf is dropped after
        return self.made


def test_a_fit_whose_start_raises_leaves_no_hook(monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("snapshot failed")

    monkeypatch.setattr(nan_skip_fit, "SpikeRollback", fails)  # raises after the skipper hooked the optimizer
    model = KeepsOptimizers(per_rank_batch=(8,), steps=3)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[NaNSkip(spike_action="rollback")], **QUIET)
    with pytest.raises(RuntimeError, match="snapshot failed"):
        trainer.fit(model)
    assert step_hooks(model.made) == 0


class RaisesAtBatch(KeepsOptimizers):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise ValueError("the model failed")
        return super().training_step(batch, batch_idx)


class FailsOnException(Callback):
    """An on_exception that raises: Lightning calls no other callback's on_exception after it."""

    def on_exception(self, trainer, pl_module, exception):
        raise RuntimeError("on_exception failed") from exception


def test_a_fit_that_never_ended_is_closed_when_the_next_starts():
    skip = NaNSkip()
    failed = RaisesAtBatch(per_rank_batch=(8,), steps=3)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[FailsOnException(), skip], **QUIET)
    with pytest.raises(RuntimeError, match="on_exception failed"):
        trainer.fit(failed)
    assert step_hooks(failed.made) == 1  # NaNSkip's on_exception never ran

    model = KeepsOptimizers(per_rank_batch=(8,), steps=3)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[skip], **QUIET)
    trainer.fit(model)
    assert step_hooks(failed.made) == 0
    assert step_hooks(model.made) == 0
    assert skip.optimizer_steps == 1 + 3  # the failed fit's first step, then this fit's


class JoinsMidFit(Callback):
    """Adds NaNSkip to the trainer's callbacks at the second batch: its on_fit_start never ran."""

    def __init__(self, skip: NaNSkip) -> None:
        self.skip = skip

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            trainer.callbacks.append(self.skip)


def test_a_callback_added_mid_fit_stays_out_of_it():
    skip = NaNSkip()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[JoinsMidFit(skip)], **QUIET)
    trainer.fit(BatchNormClassifier(per_rank_batch=(8,), steps=3))
    assert trainer.global_step == 3
    assert skip.optimizer_steps == 0
    assert skip.save_attempt() is None  # OOMBackoff's calls too
    skip.restore_attempt(None)
