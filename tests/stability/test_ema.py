"""``EMA`` in one process: the average against one computed by hand, evaluation with it, checkpoints and export (one
device, and FSDP's sharded and one-file checkpoints). Two processes and hybrid sharding:
``tests/fsdp/test_fsdp_models_distributed.py`` and ``test_hybrid_sharding_distributed.py``."""

import copy

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.fsdp import fully_shard

from lightning_mgpu import EMA, FSDPStrategy, MultiGPUStrategy
from lightning_mgpu.fsdp.sharded_checkpoint import export_state_dict
from tests.helpers.tiny_transformer import PlainTransformer, TinyTransformer, Tokens
from tests.helpers.trainer import QUIET


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"decay": 1.0}, ValueError, r"EMA: decay must be a number in \(0.0, 1.0\), got 1.0; e.g. 0.999"),
        ({"decay": 0}, ValueError, r"decay must be a number in \(0.0, 1.0\), got 0"),
        ({"decay": "0.9"}, TypeError, r"decay must be a number"),
        ({"every_n_steps": 0}, ValueError, r"every_n_steps must be an int >= 1, got 0"),
        ({"start_step": -1}, ValueError, r"start_step must be an int >= 0, got -1"),
        ({"evaluate": "yes"}, TypeError, r"evaluate must be True or False, got 'yes'"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        EMA(**kwargs)


class Trajectory(Callback):
    """The weights after every optimizer step (listed before EMA, so it sees the step EMA averages)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({name: p.detach().clone() for name, p in pl_module.named_parameters()})


def trainer_for(callbacks, strategy="auto", max_steps=6, **kwargs) -> Trainer:
    kwargs = {**QUIET, "limit_val_batches": 0, **kwargs}
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, callbacks=callbacks, **kwargs)


def test_the_average_is_the_one_computed_by_hand():
    torch.manual_seed(0)
    model = TinyTransformer()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trajectory, ema = Trajectory(), EMA(decay=0.8, every_n_steps=2, start_step=2)
    trainer_for([trajectory, ema]).fit(model)
    expected = dict(initial)
    for step, weights in enumerate(trajectory.steps, start=1):
        if step % 2:
            continue
        if step <= 2:
            expected = dict(weights)  # copied until start_step
        else:
            expected = {name: torch.lerp(expected[name], weights[name], 0.2) for name in weights}
    assert ema.weights.keys() == expected.keys()
    for name, value in ema.weights.items():
        assert torch.equal(value, expected[name]), name
    assert ema.state_dict()["updates"] == 2  # steps 4 and 6
    assert any(not torch.equal(ema.weights[n], trajectory.steps[-1][n]) for n in expected)  # an average, not a copy


class ValidationLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_validation_end(self, trainer, pl_module):
        self.losses.append(float(trainer.callback_metrics["val_loss"]))


def loss_with(model: TinyTransformer, weights: dict[str, torch.Tensor]) -> float:
    evaluated = copy.deepcopy(model)
    evaluated.load_state_dict(weights, strict=False)
    tokens, targets = next(iter(evaluated.val_dataloader()))
    logits = evaluated(tokens)
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("evaluate", [True, False])
def test_validation_runs_on_the_average_and_training_resumes_on_the_trained_weights(evaluate):
    torch.manual_seed(0)
    model = TinyTransformer()
    trajectory, ema, losses = Trajectory(), EMA(decay=0.5, evaluate=evaluate), ValidationLosses()
    trainer = trainer_for(
        [trajectory, ema, losses], max_steps=4, limit_val_batches=1, val_check_interval=4, num_sanity_val_steps=0
    )
    trainer.fit(model)
    trained = trajectory.steps[-1]
    assert all(torch.equal(p, trained[name]) for name, p in model.named_parameters())  # put back, bit for bit
    evaluated_with = ema.weights if evaluate else trained
    assert losses.losses == [pytest.approx(loss_with(model, evaluated_with), abs=1e-6)]
    assert loss_with(model, ema.weights) != pytest.approx(loss_with(model, trained), abs=1e-4)
    (result,) = trainer.validate(model, verbose=False)  # after the fit too
    assert result["val_loss"] == pytest.approx(loss_with(model, evaluated_with), abs=1e-6)
    assert all(torch.equal(p, trained[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(lambda: MultiGPUStrategy(), id="one_device"),  # the pack's: its exact mid-epoch resume
        pytest.param(lambda: MultiGPUStrategy(mode="fsdp"), id="fsdp_sharded_checkpoint"),
        pytest.param(lambda: FSDPStrategy(save_distributed_checkpoint=False), id="fsdp_one_file_checkpoint"),
    ],
)
def test_a_resumed_fit_continues_the_same_average(strategy, tmp_path):
    torch.manual_seed(0)
    reference = EMA(decay=0.7)
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    trainer_for([reference, saves], strategy(), max_steps=8, enable_checkpointing=True).fit(TinyTransformer())
    torch.manual_seed(0)
    resumed = EMA(decay=0.7)
    model = TinyTransformer()
    trainer_for([resumed], strategy(), max_steps=8).fit(model, ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    assert resumed.state_dict()["updates"] == reference.state_dict()["updates"] == 8
    for name, value in reference.full_weights().items():
        assert torch.equal(resumed.full_weights()[name], value), name


def test_a_sharded_checkpoint_holds_the_average_beside_the_shards_and_export_writes_it(tmp_path):
    torch.manual_seed(0)
    model, ema = TinyTransformer(), EMA(decay=0.7)
    trainer = trainer_for([ema], MultiGPUStrategy(mode="fsdp"), max_steps=5)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert (tmp_path / "last.ckpt" / "callback_states" / ".metadata").is_file()
    averages = ema.full_weights()
    trained = {name: p.full_tensor() for name, p in model.named_parameters()}

    for with_ema, expected in ((True, averages), (False, trained)):
        out = tmp_path / f"model_{with_ema}.pt"
        export_state_dict(tmp_path / "last.ckpt", out, ema=with_ema)
        net = PlainTransformer()
        net.load_state_dict(torch.load(out))  # strict: every key, nothing more
        for name, param in net.named_parameters():
            assert torch.equal(param, expected[name]), (with_ema, name)


def test_export_of_a_checkpoint_without_an_average_says_so(tmp_path):
    torch.manual_seed(0)
    trainer = trainer_for([], max_steps=2)
    trainer.fit(TinyTransformer())
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(KeyError, match=r"holds no EMA average; train with callbacks=\[EMA\(...\)\]"):
        export_state_dict(tmp_path / "plain.ckpt", tmp_path / "out.pt", ema=True)


def test_lightnings_own_sharded_strategy_is_refused():
    class SelfSharded(TinyTransformer):
        def configure_model(self):
            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self, mesh=self.device_mesh["data_parallel"])

    trainer = trainer_for([EMA()], ModelParallelStrategy(), max_steps=1)
    refusal = r"EMA averages the weights under one device, DataParallel, DDP or the pack's FSDPStrategy, which save "
    with pytest.raises(MisconfigurationException, match=refusal + r"each rank's shards; got ModelParallelStrategy"):
        trainer.fit(SelfSharded())


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(lambda: MultiGPUStrategy(), id="one_device"),
        pytest.param(lambda: MultiGPUStrategy(mode="fsdp"), id="fsdp_sharded_checkpoint"),
        pytest.param(lambda: FSDPStrategy(save_distributed_checkpoint=False), id="fsdp_one_file_checkpoint"),
    ],
)
def test_an_average_added_when_resuming_starts_from_the_resumed_weights(strategy, tmp_path):
    # under FSDP the checkpoint is loaded after on_fit_start: an average taken there would be of the initial weights
    torch.manual_seed(0)
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    trainer_for([saves], strategy(), max_steps=4, enable_checkpointing=True).fit(TinyTransformer())
    torch.manual_seed(0)
    model, trajectory, ema = TinyTransformer(), Trajectory(), EMA(decay=0.5)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer_for([trajectory, ema], strategy(), max_steps=5).fit(model, ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    (resumed_step,) = trajectory.steps  # step 5, from the weights at step 4
    full = ema.full_weights()
    for name, weights in resumed_step.items():
        step_5 = weights.full_tensor() if hasattr(weights, "full_tensor") else weights
        # one update of an average that started at step 4's weights lies between them and step 5's
        assert (full[name] - step_5).abs().max() < (initial[name] - step_5).abs().max() / 4, name


class AtTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.weights = {name: p.detach().clone() for name, p in pl_module.named_parameters()}


def test_bf16_weights_are_averaged_in_float32():
    torch.manual_seed(0)
    model, start, ema = TinyTransformer(), AtTrainStart(), EMA(decay=0.999)
    trainer_for([start, ema], precision="bf16-true", max_steps=3).fit(model)
    assert {weight.dtype for weight in ema.weights.values()} == {torch.float32}
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
    # three thousandths of the steps: below bfloat16's resolution (a bfloat16 average stays where it started)
    moved = max((ema.weights[name] - weights.float()).abs().max().item() for name, weights in start.weights.items())
    assert 0 < moved < 1e-2


def test_the_tokens_helper_is_deterministic():  # the references above rely on it
    assert torch.equal(Tokens(8).tokens, Tokens(8).tokens)
