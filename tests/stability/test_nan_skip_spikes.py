"""NaNSkip's spike detection and rollback, spikes injected for real, against runs that never had the bad steps."""

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mgpu import GradientClipping, NaNSkip, RollbackLimitError
from tests.helpers.models import BatchNormClassifier
from tests.helpers.trainer import QUIET
from tests.stability.test_nan_skip import assert_same_training_state, fit_one, fit_two

SPIKE_STEP = 30
STEPS = 36


def spike_skip(**kwargs) -> NaNSkip:
    return NaNSkip(**{"spike_zscore": 6.0, "spike_window": 20, **kwargs})


@pytest.mark.parametrize("spike_on", ["loss", "grad_norm", "both"])
def test_a_loss_spike_is_skipped_exactly_with_adam(tmp_path, spike_on):
    skip = spike_skip(spike_on=spike_on)
    ours, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer="adam", inject=("loss_spike", 0, SPIKE_STEP)),
        tmp_path / "ours",
        callbacks=[skip],
        steps=STEPS,
    )
    reference, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer="adam", drop_step=SPIKE_STEP),
        tmp_path / "ref",
        steps=STEPS - 1,
    )
    assert (ours["skipped_steps"], ours["spiked_steps"]) == (1, 1)
    assert_same_training_state(ours, reference)  # parameters, BatchNorm statistics and Adam's moments and step
    assert [event.step for event in skip.events.since(0)] == [SPIKE_STEP]
    assert "spike" in skip.events.since(0)[0].detail


def test_without_spike_detection_the_spike_is_trained_on(tmp_path):
    ours, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer="adam", inject=("loss_spike", 0, SPIKE_STEP)),
        tmp_path / "ours",
        callbacks=[NaNSkip()],
        steps=STEPS,
    )
    reference, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer="adam", drop_step=SPIKE_STEP),
        tmp_path / "ref",
        steps=STEPS - 1,
    )
    assert ours["skipped_steps"] == 0
    with pytest.raises(AssertionError):
        assert_same_training_state(ours, reference)


def test_the_window_does_not_take_in_the_spike_and_resumes_from_a_checkpoint(tmp_path):
    skip = spike_skip()
    model = BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer="adam", inject=("loss_spike", 0, SPIKE_STEP))
    fit_one(model, tmp_path, callbacks=[skip], steps=STEPS)
    window = skip._tally.loss_window
    values = window.values[0].tolist()
    assert int(window.count) == 20 and max(values) < 10  # the last 20 accepted losses, the spike (~1000x) not among
    state = skip.state_dict()
    restored = spike_skip()
    restored.load_state_dict(state)
    norm_windows = (skip._tally.norm_windows[0], restored._tally.norm_windows[0])
    for ours, theirs in ((window, restored._tally.loss_window), norm_windows):
        assert theirs.values.tolist() == ours.values.tolist()
        assert (int(theirs.next), int(theirs.count)) == (int(ours.next), int(ours.count))
        assert [t.tolist() for t in theirs.statistics()] == [t.tolist() for t in ours.statistics()]
    assert restored.spiked_steps == 1


@pytest.mark.parametrize("order", ["skip_first", "clip_first"])
def test_zscore_clipping_statistics_leave_out_a_nan_loss_step_in_either_order(tmp_path, order):
    # a NaN loss with finite gradients: the clipping statistics saw a finite norm; they must leave it out all the same
    def zscore():
        return GradientClipping(mode="zscore", warmup_steps=1, z_threshold=0.5)

    # a fused optimizer skips on the device and keeps the gradients, so clipping runs on the bad step in either order
    clip = zscore()
    callbacks = [NaNSkip(), clip] if order == "skip_first" else [clip, NaNSkip()]
    ours, _ = fit_one(
        BatchNormClassifier((8,), steps=6, optimizer="adam_fused", inject=("loss_nan", 0, 2)),
        tmp_path / order,
        callbacks=callbacks,
        steps=6,
    )
    reference_clip = zscore()
    reference, _ = fit_one(
        BatchNormClassifier((8,), steps=6, optimizer="adam_fused", drop_step=2),
        tmp_path / "ref",
        steps=5,
        callbacks=[reference_clip],
    )
    assert ours["skipped_steps"] == 1
    assert clip.statistics.state_dict() == pytest.approx(reference_clip.statistics.state_dict())
    assert_same_training_state(ours, reference)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"spike_zscore": 0}, ValueError, r"spike_zscore must be a positive number or None, got 0"),
        ({"spike_zscore": "6"}, TypeError, r"spike_zscore must be a positive number or None, got '6'"),
        ({"spike_window": 1}, ValueError, r"spike_window must be an int >= 2, got 1"),
        ({"spike_on": "weights"}, ValueError, r"spike_on must be one of 'loss', 'grad_norm', 'both', got 'weights'"),
    ],
)
def test_bad_spike_input_is_named_at_construction(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        NaNSkip(**kwargs)


# --- two real processes -------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize(("spike_on", "spiked"), [("loss", [0, 1]), ("grad_norm", [1, 1])])
def test_a_spike_on_one_rank_is_skipped_on_every_rank(tmp_path, spike_on, spiked):
    ours = fit_two(
        BatchNormClassifier((8, 8), steps=STEPS, lr=0.01, optimizer="adam", inject=("loss_spike", 1, SPIKE_STEP)),
        tmp_path / "ours",
        callbacks=[spike_skip(spike_on=spike_on)],
        steps=STEPS,
        spawn=spike_on == "loss",  # one case where NaNSkip is pickled to spawned workers, as under ddp_spawn
    )
    reference = fit_two(
        BatchNormClassifier((8, 8), steps=STEPS, lr=0.01, optimizer="adam", drop_step=SPIKE_STEP),
        tmp_path / "ref",
        steps=STEPS - 1,
    )
    assert [d["skipped_steps"] for d in ours] == [1, 1], [d["events"] for d in ours]
    # a loss spike is seen by its own rank; the others receive it as NaN gradients. A norm spike is seen by all
    assert [d["spiked_steps"] for d in ours] == spiked
    assert_same_training_state(ours[0], ours[1], atol=0)
    for dump in ours:
        assert_same_training_state(dump, reference[0])
    assert all(torch.isfinite(p).all() for p in ours[0]["params"].values())


def test_no_false_positive_in_a_clean_200_step_run_of_the_example_model(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "examples"))
    sys.modules.pop("blobs", None)
    from blobs import BlobClassifier, SyntheticBlobs

    torch.manual_seed(0)
    skip = NaNSkip(spike_zscore=6.0)  # the documented threshold, the default window of 128
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=200, limit_val_batches=0, callbacks=[skip], **QUIET)
    trainer.fit(BlobClassifier(), datamodule=SyntheticBlobs())
    assert trainer.global_step == 200
    assert (skip.skipped_steps, skip.spiked_steps) == (0, 0)
    assert int(skip._tally.loss_window.count) == int(skip._tally.norm_windows[0].count) == 128  # the test did run


# --- rollback -----------------------------------------------------------------------------------------------------

ROLLBACK_SPIKE = 29  # the 30th optimizer step; snapshots every 10 steps: back to the state after step 20
DROPPED = tuple(range(20, 30))  # the batches of steps 21-30


def rollback_skip(**kwargs) -> NaNSkip:
    return spike_skip(**{"spike_action": "rollback", "snapshot_every": 10, **kwargs})


def test_rollback_restores_the_last_snapshot_and_drops_the_batches_since(tmp_path):
    # Adam, an LR scheduler stepped every step and z-score clipping: all of it must be back at step 20
    def model(**kwargs):
        return BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer="adam", lr_decay=0.97, **kwargs)

    def clip():
        return GradientClipping(mode="zscore", warmup_steps=5, z_threshold=3.0)

    skip, ours_clip = rollback_skip(), clip()
    ours, trainer = fit_one(
        model(inject=("loss_spike", 0, ROLLBACK_SPIKE)), tmp_path / "ours", callbacks=[skip, ours_clip], steps=STEPS
    )
    reference_clip = clip()
    reference, reference_trainer = fit_one(
        model(drop_step=DROPPED), tmp_path / "ref", callbacks=[reference_clip], steps=STEPS - len(DROPPED)
    )
    assert skip.rollbacks == 1 and (ours["skipped_steps"], ours["spiked_steps"]) == (1, 1)
    assert_same_training_state(ours, reference)
    assert ours["optimizer_state"][0]["step"] == STEPS - len(DROPPED)  # Adam's own counter went back to 20 too
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(
        reference_trainer.optimizers[0].param_groups[0]["lr"], rel=1e-12
    )
    assert ours_clip.statistics.state_dict() == pytest.approx(reference_clip.statistics.state_dict())
    assert trainer.global_step == STEPS  # the dropped steps still count towards max_steps
    (event,) = [e for e in skip.events.since(0) if e.kind == "rollback"]
    assert (event.step, event.detail) == (ROLLBACK_SPIKE, "to step 20: steps 21-30 dropped")


def test_the_rollback_limit_ends_the_run_with_a_clear_error(tmp_path):
    skip = rollback_skip(snapshot_every=2, max_rollbacks=2, max_consecutive=None)
    with pytest.raises(RollbackLimitError, match=r"rollback number 3, over max_rollbacks=2"):
        fit_one(BatchNormClassifier((8,), steps=STEPS, inject=("loss_nan", 0, -1)), tmp_path, callbacks=[skip])
    assert skip.rollbacks == 2  # the third was refused


def test_rollback_is_refused_with_a_grad_scaler(tmp_path):
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(MisconfigurationException, match=r"spike_action='rollback'\) cannot run with precision='16"):
        fit_one(BatchNormClassifier((8,), steps=4), tmp_path, callbacks=[rollback_skip()], steps=2, plugins=[plugin])


@pytest.mark.distributed
def test_a_spike_on_one_rank_rolls_every_rank_back(tmp_path):
    ours = fit_two(
        BatchNormClassifier((8, 8), steps=STEPS, lr=0.01, optimizer="adam", inject=("loss_spike", 1, ROLLBACK_SPIKE)),
        tmp_path / "ours",
        callbacks=[rollback_skip(spike_on="loss")],
        steps=STEPS,
    )
    reference = fit_two(
        BatchNormClassifier((8, 8), steps=STEPS, lr=0.01, optimizer="adam", drop_step=DROPPED),
        tmp_path / "ref",
        steps=STEPS - len(DROPPED),
    )
    assert [d["skipped_steps"] for d in ours] == [1, 1]
    assert [d["rollbacks"] for d in ours] == [1, 1]
    assert_same_training_state(ours[0], ours[1], atol=0)
    for dump in ours:
        assert_same_training_state(dump, reference[0])


@pytest.mark.parametrize("optimizer", ["adam", "adam_fused"])
def test_under_gradient_accumulation_the_whole_step_is_skipped_or_rolled_back(tmp_path, optimizer):
    # 2 micro-batches a step: the spike is in the second micro-batch of the 30th step (batches 58 and 59)
    for action, dropped in (("skip", (58, 59)), ("rollback", tuple(range(40, 60)))):
        skip = spike_skip(spike_action=action, snapshot_every=10, spike_on="loss")
        ours, _ = fit_one(
            BatchNormClassifier((8,), steps=2 * STEPS, lr=0.01, optimizer=optimizer, inject=("loss_spike", 0, 59)),
            tmp_path / action,
            callbacks=[skip],
            steps=STEPS,
            accumulate_grad_batches=2,
        )
        reference, _ = fit_one(
            BatchNormClassifier((8,), steps=2 * STEPS, lr=0.01, optimizer=optimizer, drop_step=dropped),
            tmp_path / f"ref_{action}",
            steps=STEPS - len(dropped) // 2,
            accumulate_grad_batches=2,
        )
        assert (ours["skipped_steps"], ours["spiked_steps"]) == (1, 1)
        assert skip.rollbacks == (1 if action == "rollback" else 0)
        assert_same_training_state(ours, reference)


class TwoOptimizers(BatchNormClassifier):
    """Manual optimization: the first layer's optimizer steps every batch, the head's every 5th, on gradients 100x
    larger: each optimizer's gradient norms are a series of their own."""

    def __init__(self) -> None:
        super().__init__((8,), steps=200, lr=0.01)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        body, head = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.manual_backward(loss)
        body.step()
        if batch_idx % 5 == 4:
            for p in self.net[3].parameters():
                p.grad.mul_(100.0)
            head.step()
            head.zero_grad()
        body.zero_grad()

    def configure_optimizers(self):
        head = list(self.net[3].parameters())
        body = [p for p in self.parameters() if all(p is not q for q in head)]
        return [torch.optim.SGD(body, lr=0.01), torch.optim.SGD(head, lr=1e-4)]


def test_each_optimizer_has_its_own_gradient_norm_window(tmp_path):
    skip = spike_skip(spike_on="grad_norm")
    fit_one(TwoOptimizers(), tmp_path, callbacks=[skip], steps=240)
    assert (skip.skipped_steps, skip.optimizer_steps) == (0, 240)
    assert [int(window.count) for window in skip._tally.norm_windows] == [20, 20]  # both tested, neither flagged


@pytest.mark.distributed
def test_each_rank_resumes_its_own_loss_window_from_a_checkpoint(tmp_path):
    def fit(directory, steps, checkpoint=None, save_every=None):
        callbacks = [spike_skip(spike_on="loss")]
        if save_every is not None:
            callbacks.append(ModelCheckpoint(dirpath=directory / "ckpt", every_n_train_steps=save_every))
        model = BatchNormClassifier(
            (8, 8), steps=STEPS, lr=0.01, optimizer="adam", inject=("loss_spike", 1, SPIKE_STEP)
        )
        return fit_two(
            model, directory, callbacks, steps, ckpt_path=checkpoint, enable_checkpointing=save_every is not None
        )

    uninterrupted = fit(tmp_path / "whole", STEPS)
    fit(tmp_path / "first", 25, save_every=25)
    (checkpoint,) = (tmp_path / "first" / "ckpt").iterdir()
    resumed = fit(tmp_path / "resumed", STEPS, checkpoint=str(checkpoint))
    windows = [dump["rank_state"]["loss_window"] for dump in uninterrupted]
    assert windows[0] != windows[1]  # the ranks' losses differ, so a shared window would be wrong for one of them
    assert [dump["rank_state"]["loss_window"] for dump in resumed] == windows
    assert [dump["skipped_steps"] for dump in resumed] == [1, 1]  # the spike after the resume, skipped on both
    for ours, reference in zip(resumed, uninterrupted, strict=True):
        assert_same_training_state(ours, reference, atol=0)
