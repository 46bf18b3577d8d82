"""NaNSkip skipping bad steps of non-fused optimizers on the device (``skip_on_device``), with no host read.

On the CPU a host read costs nothing, so ``skip_on_device="auto"`` reads there; these tests ask for the device path
with ``skip_on_device=True``, which is what ``"auto"`` does on a GPU. Host reads are counted as torch counts them:
every ``.item()``, ``bool()``, ``int()`` or ``float()`` of a tensor dispatches ``aten._local_scalar_dense`` (Adagrad is
left out there: its own kernel reads its host-side step counters every step, which reads no device).
"""

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MultiGPUStrategy, NaNSkip
from tests.helpers.models import BatchNormClassifier, RankStateDump, load_rank_dumps
from tests.helpers.trainer import QUIET
from tests.stability.test_nan_skip import assert_same_training_state, fit_one, fit_two
from tests.stability.test_nan_skip_spikes import SPIKE_STEP, STEPS, spike_skip

BAD_STEP = 2
FIT_STEPS = 6


@pytest.mark.parametrize(
    ("optimizer", "way"),
    [
        ("adam_foreach", "fused kernel"),
        ("adamw_forloop", "fused kernel"),
        ("sgd_foreach", "fused kernel"),
        ("rmsprop", "backup"),
        ("adagrad", "backup"),
    ],
)
def test_a_non_fused_optimizer_skips_a_nan_step_on_the_device_exactly(tmp_path, caplog, optimizer, way):
    model = BatchNormClassifier((8,), steps=FIT_STEPS, lr=0.01, optimizer=optimizer, inject=("grad_inf", 0, BAD_STEP))
    with caplog.at_level("INFO"):
        ours, trainer = fit_one(model, tmp_path / "ours", callbacks=[NaNSkip(skip_on_device=True)], steps=FIT_STEPS)
    # the reference runs the same kernels, with the bad step's batch never seen
    reference, _ = fit_one(
        BatchNormClassifier((8,), steps=FIT_STEPS, lr=0.01, optimizer=optimizer, drop_step=BAD_STEP),
        tmp_path / "ref",
        callbacks=[NaNSkip(skip_on_device=True)],
        steps=FIT_STEPS - 1,
    )
    assert ours["skipped_steps"] == 1
    assert_same_training_state(ours, reference, atol=0)
    assert way in caplog.text
    assert not any(line.startswith("NaNSkip: skipped optimizer step") for line in caplog.messages)  # no read at once
    # the user's optimizer is left as it was built
    built = type(trainer.optimizers[0])([torch.nn.Parameter(torch.zeros(1))], **_settings(optimizer))
    flags = [(g.get("foreach"), g.get("fused")) for g in (trainer.optimizers[0].param_groups[0], built.param_groups[0])]
    assert flags[0] == flags[1]


def _settings(optimizer: str) -> dict:
    return {
        "adam_foreach": {"foreach": True},
        "adamw_forloop": {"foreach": False},
        "sgd_foreach": {"foreach": True, "momentum": 0.9},
    }.get(optimizer, {})


@pytest.mark.parametrize("optimizer", ["rmsprop", "sgd_foreach"])
def test_a_bad_first_step_is_skipped_before_any_state_exists(tmp_path, optimizer):
    # no state to back up yet (RMSprop) or no momentum buffer for the fused kernel (SGD): read on the host, once
    ours, _ = fit_one(
        BatchNormClassifier((8,), steps=FIT_STEPS, lr=0.01, optimizer=optimizer, inject=("grad_inf", 0, 0)),
        tmp_path / "ours",
        callbacks=[NaNSkip(skip_on_device=True)],
        steps=FIT_STEPS,
    )
    reference, _ = fit_one(
        BatchNormClassifier((8,), steps=FIT_STEPS, lr=0.01, optimizer=optimizer, drop_step=0),
        tmp_path / "ref",
        callbacks=[NaNSkip(skip_on_device=True)],
        steps=FIT_STEPS - 1,
    )
    assert ours["skipped_steps"] == 1
    assert_same_training_state(ours, reference, atol=0)


class CountHostReads(Callback):
    """Counts ``aten._local_scalar_dense`` (every read of a tensor's value on the host) from each batch's start to
    its end: forward, backward, every callback's step hooks and the optimizer step."""

    class _Mode(TorchDispatchMode):
        def __init__(self, counter: "CountHostReads") -> None:
            super().__init__()
            self.counter = counter

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                self.counter.reads += 1
            return func(*args, **(kwargs or {}))

    def __init__(self) -> None:
        self.reads = 0
        self._mode: TorchDispatchMode | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._mode = self._Mode(self)
        self._mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._mode.__exit__(None, None, None)


@pytest.mark.parametrize(
    ("skip_on_device", "optimizer", "reads"),
    [
        (True, "adam_foreach", 0),
        (True, "adamw_forloop", 0),
        (True, "sgd_foreach", 1),  # the first step: no momentum buffer yet for the fused kernel to keep
        (True, "rmsprop", 1),  # the first step, which creates the state
        (False, "adam_foreach", None),
    ],
)
def test_no_host_read_on_the_step_path(tmp_path, skip_on_device, optimizer, reads):
    counter = CountHostReads()
    # spike detection on, a NaN step and a spike: every verdict stays on the device
    skip = NaNSkip(skip_on_device=skip_on_device, spike_zscore=6.0, spike_window=20, max_consecutive=None)
    model = BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer=optimizer, inject=("loss_spike", 0, SPIKE_STEP))
    # NaNSkip's hooks run inside the counted window: it comes after the counter
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[counter, skip], **QUIET)
    trainer.fit(model)
    assert skip.skipped_steps == 1
    if skip_on_device:
        assert counter.reads == reads
    else:  # the verdict is read every step, and the foreach kernel reads its step counters
        assert counter.reads > STEPS


def test_a_checkpoint_holds_the_users_optimizer_settings_and_resumes_exactly(tmp_path):
    def fit(directory, ckpt_path=None):
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            strategy=MultiGPUStrategy(),  # resumes mid-epoch exactly
            max_steps=FIT_STEPS,
            callbacks=[NaNSkip(skip_on_device=True), checkpoints, RankStateDump(directory)],
            **{**QUIET, "enable_checkpointing": True},
        )
        model = BatchNormClassifier((8,), steps=FIT_STEPS, lr=0.01, optimizer="adam_foreach", inject=("grad_inf", 0, 4))
        trainer.fit(model, ckpt_path=ckpt_path)
        return load_rank_dumps(directory, world_size=1)[0]

    uninterrupted = fit(tmp_path / "full")
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]
    assert (saved["param_groups"][0]["foreach"], saved["param_groups"][0]["fused"]) == (True, None)
    assert all(state["step"].device.type == "cpu" for state in saved["state"].values())
    resumed = fit(tmp_path / "resumed", ckpt_path=path)
    assert resumed["skipped_steps"] == uninterrupted["skipped_steps"] == 1
    assert_same_training_state(resumed, uninterrupted, atol=0)


@pytest.mark.distributed
def test_a_spike_on_one_rank_is_skipped_on_every_rank_on_the_device(tmp_path):
    ours = fit_two(
        BatchNormClassifier(
            (8, 8), steps=STEPS, lr=0.01, optimizer="adam_foreach", inject=("loss_spike", 1, SPIKE_STEP)
        ),
        tmp_path / "ours",
        callbacks=[spike_skip(spike_on="loss", skip_on_device=True)],
        steps=STEPS,
    )
    reference = fit_two(
        BatchNormClassifier((8, 8), steps=STEPS, lr=0.01, optimizer="adam_foreach", drop_step=SPIKE_STEP),
        tmp_path / "ref",
        callbacks=[NaNSkip(skip_on_device=True)],
        steps=STEPS - 1,
    )
    assert [d["skipped_steps"] for d in ours] == [1, 1]
    assert_same_training_state(ours[0], ours[1], atol=0)
    for dump in ours:
        assert_same_training_state(dump, reference[0], atol=0)


def test_bad_skip_on_device_is_named_at_construction():
    with pytest.raises(ValueError, match=r"^NaNSkip: skip_on_device must be one of 'auto', True, False, got 'yes'"):
        NaNSkip(skip_on_device="yes")
    with pytest.raises(TypeError, match=r"^NaNSkip: skip_on_device must be one of"):
        NaNSkip(skip_on_device=1)


class RaiseAfterNaNSkip(Callback):
    """Takes the optimizer's state_dict in a later callback's on_before_optimizer_step of step 3, then raises."""

    def __init__(self) -> None:
        self.flags = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 3:
            groups = optimizer.state_dict()["param_groups"]
            self.flags = (groups[0]["foreach"], groups[0]["fused"])
            raise RuntimeError("stop")


def test_a_step_that_raises_after_the_route_was_taken_leaves_the_users_settings(tmp_path):
    raiser = RaiseAfterNaNSkip()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=FIT_STEPS, callbacks=[NaNSkip(skip_on_device=True), raiser], **QUIET
    )
    with pytest.raises(RuntimeError, match="stop"):
        trainer.fit(BatchNormClassifier((8,), steps=FIT_STEPS, lr=0.01, optimizer="adam_foreach"))
    assert raiser.flags == (True, None)  # a checkpoint written then holds the user's settings
    group = trainer.optimizers[0].param_groups[0]
    assert (group["foreach"], group["fused"]) == (True, None)


class LateLayer(BatchNormClassifier):
    """The first layer gets no gradient for the first two steps: its momentum buffer starts later than the others'."""

    def on_before_optimizer_step(self, optimizer):
        if self.global_step < 2:
            for param in self.net[0].parameters():
                param.grad = None


def test_sgd_with_a_parameter_that_starts_stepping_late(tmp_path):
    def fit(directory, **kwargs):
        model = LateLayer((8,), steps=FIT_STEPS, lr=0.01, optimizer="sgd_foreach", **kwargs)
        return fit_one(
            model, directory, callbacks=[NaNSkip(skip_on_device=True)], steps=FIT_STEPS - ("drop_step" in kwargs)
        )[0]

    ours = fit(tmp_path / "ours", inject=("grad_inf", 0, 4))
    reference = fit(tmp_path / "ref", drop_step=4)
    assert ours["skipped_steps"] == 1
    assert_same_training_state(ours, reference, atol=0)


class SparseEmbedding(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4, sparse=True)

    def training_step(self, batch, batch_idx):
        loss = self.embedding(batch[0]).pow(2).mean()
        return loss * float("nan") if batch_idx == 2 else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(10).repeat(4).view(-1, 2)), batch_size=1)


def test_sparse_gradients_are_not_routed_through_a_fused_kernel():
    torch.manual_seed(0)
    skip = NaNSkip(check="loss", skip_on_device=True)  # the gradient check takes no sparse gradient either
    model = SparseEmbedding()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=5, callbacks=[skip], **QUIET)
    trainer.fit(model)  # the fused kernels take no sparse gradient: read on the host instead
    assert skip.skipped_steps == 1
    assert torch.isfinite(model.embedding.weight).all()
