import copy
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mgpu import GradientClipping
from tests.helpers.trainer import QUIET, fit_apart, in_process_start

TRAINER = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}


class LoudModel(BoringModel):
    """BoringModel with large gradients, so that every clipping mode actually clips."""

    def training_step(self, batch, batch_idx):
        return {"loss": self.step(batch) * 100.0}


def fit(model, steps=5, ckpt_path=None, **kwargs):
    torch.manual_seed(123)  # BoringModel draws its data when the loader is built: the same data for every fit
    trainer = Trainer(max_steps=steps, enable_checkpointing=False, **TRAINER, **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize(("mode", "option", "value"), [("norm", "max_norm", 0.5), ("value", "clip_value", 0.01)])
def test_same_parameters_as_lightnings_own_clipping(mode, option, value):
    torch.manual_seed(0)
    ours = LoudModel()
    theirs, unclipped = copy.deepcopy(ours), copy.deepcopy(ours)
    fit(ours, callbacks=[GradientClipping(mode=mode, **{option: value})])
    fit(theirs, gradient_clip_val=value, gradient_clip_algorithm=mode)
    fit(unclipped)
    for (name, a), b, c in zip(ours.named_parameters(), theirs.parameters(), unclipped.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)
        assert not torch.allclose(a, c), "clipping changed nothing: the test would not notice a broken clip"


def test_logged_norm_is_the_norm_before_clipping():
    seen = {}

    class Spy(GradientClipping):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            seen["norm"] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    trainer = fit(LoudModel(), steps=1, callbacks=[Spy(mode="norm", max_norm=0.5)], log_every_n_steps=1)
    torch.testing.assert_close(trainer.callback_metrics["grad_norm"], seen["norm"])
    assert float(seen["norm"]) > 0.5


def test_agc_leaves_excluded_layers_alone():
    torch.manual_seed(0)
    model = LoudModel()
    reference, start = copy.deepcopy(model), copy.deepcopy(model)
    fit(model, steps=1, callbacks=[GradientClipping(mode="agc", clip_factor=1e-3, exclude=["layer.bias"])])
    fit(reference, steps=1)
    assert torch.equal(model.layer.bias, reference.layer.bias)  # excluded: the plain SGD step
    assert not torch.allclose(model.layer.weight, reference.layer.weight)
    # clipped: each weight row moved by at most lr * clip_factor * |row| (lr 0.1 in BoringModel)
    moved = (model.layer.weight - start.layer.weight).norm(dim=1)
    limit = 0.1 * 1e-3 * start.layer.weight.norm(dim=1)
    assert torch.all(moved <= limit * (1 + 1e-4))


def test_agc_warns_once_about_exclude_patterns_that_match_nothing():
    clipping = GradientClipping(mode="agc", clip_factor=1e-3, exclude=["head.*", "layer.bias"])
    with pytest.warns(
        UserWarning, match=r"exclude pattern\(s\) \['head\.\*'\] match no parameter of LoudModel.*layer\.weight"
    ):
        fit(LoudModel(), steps=1, callbacks=[clipping])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*match no parameter.*")  # a second fit of it stays quiet
        fit(LoudModel(), steps=1, callbacks=[clipping])


def test_agc_exclude_patterns_that_match_say_nothing():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*match no parameter.*")
        fit(LoudModel(), steps=1, callbacks=[GradientClipping(mode="agc", clip_factor=1e-3, exclude=["layer.*"])])


def test_zscore_statistics_resume_from_checkpoint(tmp_path):
    clip = GradientClipping(mode="zscore", z_threshold=1.0, warmup_steps=3)
    trainer = fit(LoudModel(), steps=6, callbacks=[clip], default_root_dir=tmp_path, log_every_n_steps=1)
    assert int(clip.statistics.count) == 6
    assert "grad_norm_threshold" in trainer.callback_metrics
    path = tmp_path / "z.ckpt"
    trainer.save_checkpoint(path)

    resumed = GradientClipping(mode="zscore", z_threshold=1.0, warmup_steps=3)
    fit(LoudModel(), steps=7, callbacks=[resumed], default_root_dir=tmp_path, ckpt_path=path)
    assert int(resumed.statistics.count) == 7  # 6 restored + 1 new step
    state = torch.load(path, weights_only=False)["callbacks"][clip.state_key]["statistics"]
    assert state["count"] == 6 and state["mean"] == pytest.approx(float(clip.statistics.mean))


def test_conflict_with_trainer_clipping_is_named_at_setup():
    with pytest.raises(MisconfigurationException, match=r"GradientClipping\(mode='norm'\).*gradient_clip_val=1\.0"):
        fit(BoringModel(), steps=1, gradient_clip_val=1.0, callbacks=[GradientClipping(mode="norm", max_norm=1.0)])


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"mode": "l2"}, ValueError, r"mode must be one of 'norm', 'value', 'agc', 'zscore', got 'l2'"),
        ({"mode": "norm"}, ValueError, r"GradientClipping\(mode='norm'\) needs max_norm"),
        ({"mode": "value"}, ValueError, r"needs clip_value"),
        ({"mode": "norm", "max_norm": 0}, ValueError, r"max_norm must be a positive number, got 0"),
        ({"mode": "norm", "max_norm": -1.0}, ValueError, r"max_norm must be a positive number, got -1.0"),
        ({"mode": "norm", "max_norm": "1"}, TypeError, r"max_norm must be a positive number, got '1'"),
        ({"mode": "value", "clip_value": float("nan")}, ValueError, r"clip_value must be a positive number"),
        ({"mode": "norm", "max_norm": 1.0, "clip_value": 0.5}, ValueError, r"clip_value belongs to mode='value'"),
        ({"mode": "agc", "clip_factor": 0.0}, ValueError, r"clip_factor must be a positive number, got 0.0"),
        ({"mode": "zscore", "z_threshold": -2}, ValueError, r"z_threshold must be a positive number, got -2"),
        ({"mode": "zscore", "warmup_steps": -1}, ValueError, r"warmup_steps must be an int >= 0, got -1"),
        ({"mode": "zscore", "warmup_steps": 2.0}, TypeError, r"warmup_steps must be an int >= 0, got 2.0"),
        ({"mode": "zscore", "decay": 1.0}, ValueError, r"decay must be a number in \(0, 1\), got 1.0"),
        ({"mode": "zscore", "decay": "0.9"}, TypeError, r"decay must be a number in \(0, 1\), got '0.9'"),
        ({"mode": None}, TypeError, r"mode must be one of 'norm', 'value', 'agc', 'zscore', got None"),
        ({"mode": "norm", "max_norm": 1.0, "exclude": ["fc.*"]}, ValueError, r"exclude belongs to mode='agc'"),
        ({"mode": "agc", "exclude": "fc.*"}, TypeError, r"exclude must be a list of name patterns"),
        (
            {"mode": "agc", "exclude": ["fc.*", 0]},
            TypeError,
            r"exclude must be .*, got \['fc.\*', 0\]; 0 is of type int$",
        ),
        ({"mode": "norm", "max_norm": 1.0, "norm_type": 0}, ValueError, r"norm_type must be a positive number"),
    ],
)
def test_bad_input_is_named_at_construction(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        GradientClipping(**kwargs)


def one_process_fit(callbacks: list) -> dict[str, torch.Tensor]:
    """The reference of the 2-process fit below: one process, each step on the global batch (rank 0's 4 samples and
    rank 1's 4), BatchNorm over all 8, as the ranks' synchronised BatchNorm normalises them."""
    from tests.helpers.models import BatchNormClassifier

    model = BatchNormClassifier(per_rank_batch=(8,), steps=4, lr=1.0)  # the same seeded initial weights
    Trainer(accelerator="cpu", devices=1, max_steps=4, callbacks=callbacks, **QUIET).fit(model)
    return {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "mode_kwargs",
    # z_threshold=1: the last 2 of the 4 steps clip (at the default 2.5, none would)
    [{"mode": "zscore", "warmup_steps": 2, "z_threshold": 1.0}, {"mode": "agc", "clip_factor": 1e-3}],
)
def test_two_processes_clip_alike(tmp_path, mode_kwargs):
    from lightning_mgpu import MultiGPUStrategy
    from tests.helpers.models import BatchNormClassifier, RankStateDump, load_rank_dumps

    trainer_kwargs = dict(
        accelerator="cpu",
        devices=2,
        strategy=MultiGPUStrategy(mode=f"ddp_{in_process_start()}"),
        max_steps=4,
        use_distributed_sampler=False,
        callbacks=[GradientClipping(**mode_kwargs), RankStateDump(tmp_path)],
        **QUIET,
    )
    fit_apart(trainer_kwargs, BatchNormClassifier(per_rank_batch=(4, 4), steps=4, lr=1.0))
    dumps = load_rank_dumps(tmp_path)
    for name, value in dumps[0]["params"].items():
        assert torch.equal(value, dumps[1]["params"][name]), name
    # both ranks clipped the averaged gradients as one process clips the global batch's ...
    clipped = one_process_fit([GradientClipping(**mode_kwargs)])
    unclipped = one_process_fit([])
    for name, value in dumps[0]["params"].items():
        torch.testing.assert_close(value, clipped[name], rtol=0, atol=1e-5, msg=name)
    # ... and the clip acted: far from the same fit without it
    assert max((clipped[name] - unclipped[name]).abs().max().item() for name in clipped) > 0.1


def test_agc_exclude_finds_layers_built_in_configure_model():
    class LateHead(LoudModel):
        def __init__(self):
            super().__init__()
            self.head = None

        def configure_model(self):
            if self.head is None:
                self.head = torch.nn.Linear(2, 2)

        def step(self, x):
            return torch.nn.functional.mse_loss(self.head(self.layer(x)), torch.ones(len(x), 2))

    torch.manual_seed(0)
    model = LateHead()
    reference = copy.deepcopy(model)
    fit(model, steps=1, callbacks=[GradientClipping(mode="agc", clip_factor=1e-6, exclude=["head.*"])])
    fit(reference, steps=1)  # both heads are built inside fit, after the same seed: the same initial head
    torch.testing.assert_close(model.head.weight, reference.head.weight)  # excluded: the plain SGD step
    assert not torch.allclose(model.layer.weight, reference.layer.weight)  # clipped hard
