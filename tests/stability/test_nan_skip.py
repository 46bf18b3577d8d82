"""NaNSkip with faults injected for real, against reference runs in which the bad step's batch never happened."""

import json
import logging
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_mgpu import GradientClipping, MultiGPUStrategy, NaNSkip, NonFiniteStepsError
from lightning_mgpu.stability.clip_grad import GradNormStatistics
from tests.helpers.models import BatchNormClassifier, RankStateDump, finished_fits_survive_exit_aborts, load_rank_dumps
from tests.helpers.processes import run_script
from tests.helpers.trainer import QUIET, RecordingLogger, fit_apart, in_process_start

BAD_STEP = 2
STEPS = 5


def fit_one(model, tmp_path, callbacks=(), steps=STEPS, **kwargs):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[*callbacks, RankStateDump(tmp_path)],
        **{**QUIET, **kwargs},
    )
    trainer.fit(model)
    return load_rank_dumps(tmp_path, world_size=1)[0], trainer


def assert_same_training_state(ours, reference, atol=1e-6):
    for key in ("params", "buffers"):
        for name, value in reference[key].items():
            torch.testing.assert_close(ours[key][name], value, atol=atol, rtol=0, msg=f"{key} {name}")
    for index, state in reference["optimizer_state"].items():
        for name, value in state.items():
            torch.testing.assert_close(
                ours["optimizer_state"][index][name], value, atol=atol, rtol=0, msg=f"optimizer state {index}.{name}"
            )


@pytest.mark.parametrize("check", ["both", "loss"])
def test_nan_loss_step_is_skipped_exactly(tmp_path, check):
    ours, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, inject=("loss_nan", 0, BAD_STEP)),
        tmp_path / "ours",
        callbacks=[NaNSkip(check=check)],
    )
    reference, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, drop_step=BAD_STEP), tmp_path / "ref", steps=STEPS - 1
    )
    assert ours["skipped_steps"] == 1
    assert_same_training_state(ours, reference)


def test_without_the_callback_the_nan_poisons_the_weights(tmp_path):
    poisoned, _ = fit_one(BatchNormClassifier((8,), steps=STEPS, inject=("grad_inf", 0, BAD_STEP)), tmp_path)
    assert not all(torch.isfinite(p).all() for p in poisoned["params"].values())


def test_fused_adam_skips_on_the_device_and_keeps_its_step_counter(tmp_path):
    ours, trainer = fit_one(
        BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer="adam_fused", inject=("grad_inf", 0, BAD_STEP)),
        tmp_path / "ours",
        callbacks=[NaNSkip()],
    )
    reference, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer="adam_fused", drop_step=BAD_STEP),
        tmp_path / "ref",
        steps=STEPS - 1,
    )
    assert ours["skipped_steps"] == 1
    assert float(ours["optimizer_state"][0]["step"]) == STEPS - 1  # fused kernel undid its step increment
    assert_same_training_state(ours, reference)
    assert "found_inf" not in trainer.optimizers[0].__dict__  # one step's argument only


def test_accumulation_skips_the_whole_accumulated_step(tmp_path):
    # 4 optimizer steps of 2 micro-batches; a NaN in micro-batch 2 (the first of step 1) skips micro-batches 2 and 3
    model = BatchNormClassifier((8,), steps=8, inject=("loss_nan", 0, 2))
    ours, _ = fit_one(model, tmp_path / "ours", callbacks=[NaNSkip()], steps=4, accumulate_grad_batches=2)

    class DropBoth(BatchNormClassifier):
        def train_dataloader(self):
            loader = super().train_dataloader()
            keep = [i for i in range(len(loader.dataset)) if i // 8 not in (2, 3)]
            return torch.utils.data.DataLoader(torch.utils.data.Subset(loader.dataset, keep), batch_size=8)

    reference, _ = fit_one(DropBoth((8,), steps=8), tmp_path / "ref", steps=3, accumulate_grad_batches=2)
    assert ours["skipped_steps"] == 1
    assert_same_training_state(ours, reference)


def test_counters_resume_from_a_checkpoint(tmp_path):
    skip = NaNSkip()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        default_root_dir=tmp_path,
        callbacks=[skip],
        log_every_n_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BatchNormClassifier((8,), steps=STEPS + 2, inject=("loss_nan", 0, BAD_STEP)))
    assert skip.skipped_steps == 1 and trainer.callback_metrics["skipped_steps"] == 1
    path = tmp_path / "nan.ckpt"
    trainer.save_checkpoint(path)
    resumed = NaNSkip()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=STEPS + 2, callbacks=[resumed], **QUIET)
    trainer.fit(BatchNormClassifier((8,), steps=STEPS + 2, inject=("loss_nan", 0, STEPS)), ckpt_path=path)
    assert resumed.skipped_steps == 2  # 1 restored + 1 after resuming
    assert resumed.optimizer_steps == STEPS + 2


@pytest.mark.parametrize("arithmetic", ["host", "device"])
@pytest.mark.parametrize("order", ["skip_first", "clip_first"])
def test_same_result_in_either_order_with_gradient_clipping(tmp_path, monkeypatch, order, arithmetic):
    # z = 0.5 after 1 step of warm-up: most later steps are clipped, so the statistics shape the weights. The
    # statistics are host numbers on the CPU; "device" runs the tensor arithmetic accelerators use
    if arithmetic == "device":
        monkeypatch.setattr(GradNormStatistics, "_host_device_types", ())

    def zscore():
        return GradientClipping(mode="zscore", warmup_steps=1, z_threshold=0.5)

    clip = zscore()
    callbacks = [NaNSkip(), clip] if order == "skip_first" else [clip, NaNSkip()]
    ours, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, inject=("grad_inf", 0, BAD_STEP)), tmp_path / order, callbacks=callbacks
    )
    reference_clip = zscore()
    reference, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, drop_step=BAD_STEP),
        tmp_path / "ref",
        steps=STEPS - 1,
        callbacks=[reference_clip],
    )
    assert ours["skipped_steps"] == 1
    assert_same_training_state(ours, reference)
    assert clip.statistics.state_dict() == pytest.approx(reference_clip.statistics.state_dict())
    unclipped, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, drop_step=BAD_STEP), tmp_path / "plain", steps=STEPS - 1
    )
    assert not torch.allclose(unclipped["params"]["net.0.weight"], reference["params"]["net.0.weight"])


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"check": "weights"}, ValueError, r"check must be one of 'loss', 'grads', 'both', got 'weights'"),
        ({"check": None}, TypeError, r"check must be one of 'loss', 'grads', 'both', got None"),
        (
            {"max_consecutive": 0},
            ValueError,
            r"max_consecutive must be an int >= 1 or None, got 0; use None for no limit",
        ),
        ({"max_consecutive": 2.5}, TypeError, r"max_consecutive must be an int >= 1 or None, got 2.5; use None"),
        ({"max_consecutive": True}, TypeError, r"max_consecutive must be an int >= 1 or None, got True"),
        ({"log_skipped": 1}, TypeError, r"log_skipped must be True or False, got 1"),
    ],
)
def test_bad_input_is_named_at_construction(kwargs, error, pattern):
    with pytest.raises(error, match="^NaNSkip: " + pattern):
        NaNSkip(**kwargs)


# --- two real processes -------------------------------------------------------------------------------------------


def fit_two(model, tmp_path, callbacks=(), steps=STEPS, ckpt_path=None, spawn=False, **kwargs):
    """Two processes: forked from a warm process (``fit_apart``), or with ``spawn`` Lightning's ``ddp_spawn`` from
    here (the trainer, the callbacks and their tensors pickled to each worker, in shared memory)."""
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=2,
        strategy=MultiGPUStrategy(mode="ddp_spawn" if spawn else f"ddp_{in_process_start()}"),
        max_steps=steps,
        use_distributed_sampler=False,
        callbacks=[*callbacks, RankStateDump(tmp_path)],
        **{**QUIET, **kwargs},
    )
    with finished_fits_survive_exit_aborts(tmp_path):
        if spawn:
            Trainer(**trainer_kwargs).fit(model, ckpt_path=ckpt_path)
        else:
            fit_apart(trainer_kwargs, model, ckpt_path=ckpt_path)
    return load_rank_dumps(tmp_path)


@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "rank"), [("loss_nan", 1), ("grad_inf", 0)])
def test_fault_on_one_rank_is_skipped_on_every_rank(tmp_path, kind, rank):
    ours = fit_two(
        BatchNormClassifier((4, 4), steps=STEPS, inject=(kind, rank, BAD_STEP)),
        tmp_path / "ours",
        callbacks=[NaNSkip()],
    )
    reference = fit_two(BatchNormClassifier((4, 4), steps=STEPS, drop_step=BAD_STEP), tmp_path / "ref", steps=STEPS - 1)
    assert [d["skipped_steps"] for d in ours] == [1, 1]
    assert_same_training_state(ours[0], ours[1], atol=0)  # identical on both ranks
    for dump in ours:
        assert_same_training_state(dump, reference[0])


@pytest.mark.distributed
def test_max_consecutive_raises_on_every_rank_without_a_hang(tmp_path):
    result = run_script(
        Path(__file__).parents[1] / "helpers" / "nan_fit.py", "--out", tmp_path, "--max-consecutive", 3, timeout=120
    )
    assert not result["hung"], result["output"][-3000:]
    records = [json.loads((tmp_path / f"exception{r}.json").read_text()) for r in (0, 1)]
    assert [r["type"] for r in records] == ["NonFiniteStepsError", "NonFiniteStepsError"]
    assert records[0]["step"] == records[1]["step"]
    assert "3 optimizer steps in a row" in records[0]["message"]
    assert "the first non-finite tensor was the loss" in records[1]["message"]  # rank 1 saw its own NaN loss
    assert result["rc"] != 0


def test_max_consecutive_error_names_the_step_and_tensor(tmp_path):
    model = BatchNormClassifier((8,), steps=10, inject=("grad_inf", 0, -1))
    with pytest.raises(NonFiniteStepsError, match=r"2 optimizer steps in a row.*gradient of 'net.3.weight'"):
        fit_one(model, tmp_path, callbacks=[NaNSkip(max_consecutive=2)], steps=10)


def test_bf16_mixed_precision(tmp_path):
    ours, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, inject=("grad_inf", 0, BAD_STEP)),
        tmp_path / "ours",
        callbacks=[NaNSkip()],
        precision="bf16-mixed",
    )
    reference, _ = fit_one(
        BatchNormClassifier((8,), steps=STEPS, drop_step=BAD_STEP),
        tmp_path / "ref",
        steps=STEPS - 1,
        precision="bf16-mixed",
    )
    assert ours["skipped_steps"] == 1
    assert_same_training_state(ours, reference)


class ManualSteps(BatchNormClassifier):
    """Manual optimization: NaNSkip skips the optimizer step the training_step calls."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        if self._injecting("loss_nan", batch_idx):
            loss = loss * float("nan")
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimization_skips_the_called_step(tmp_path):
    ours, _ = fit_one(
        ManualSteps(per_rank_batch=(8,), steps=STEPS, inject=("loss_nan", 0, BAD_STEP)),
        tmp_path / "ours",
        callbacks=[NaNSkip()],
    )
    reference, _ = fit_one(
        ManualSteps(per_rank_batch=(8,), steps=STEPS, drop_step=BAD_STEP), tmp_path / "ref", steps=STEPS - 1
    )
    assert ours["skipped_steps"] == 1
    assert_same_training_state(ours, reference)


def test_under_our_dataparallel(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from tests.ddp.test_data_parallel import BATCH, CPUDataParallelStrategy, Regressor, data

    class NaNInBatch1(Regressor):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if batch_idx == 1:
                out["loss"] = out["loss"] + float("nan")  # in every replica: the merged loss is NaN
            return out

    def fit_dp(model, x, y, callbacks):
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            strategy=CPUDataParallelStrategy(),
            callbacks=callbacks,
            max_steps=len(x) // BATCH,
            **QUIET,
        )
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))

    x, y = data(3 * BATCH)
    ours, reference = NaNInBatch1(), Regressor()
    fit_dp(ours, x, y, [NaNSkip()])
    keep = torch.cat([torch.arange(BATCH), torch.arange(2 * BATCH, 3 * BATCH)])  # batch 1 never happened
    fit_dp(reference, x[keep], y[keep], [])
    torch.testing.assert_close(ours.layer.weight, reference.layer.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.layer.bias, reference.layer.bias, atol=1e-6, rtol=0)


def test_16_mixed_with_a_fused_optimizer_unscales_once_and_skips(tmp_path):
    """GradScaler with a fused optimizer: Lightning leaves the gradients scaled, the kernel would unscale them."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    skip, clip = NaNSkip(), GradientClipping(mode="norm", max_norm=1.0)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        plugins=[scaler_plugin],
        callbacks=[skip, clip],
        log_every_n_steps=1,
        **QUIET,
    )
    trainer.fit(
        BatchNormClassifier((8,), steps=STEPS, lr=0.01, optimizer="adam_fused", inject=("grad_inf", 0, BAD_STEP))
    )
    assert skip.skipped_steps == 1
    assert float(trainer.callback_metrics["grad_norm"]) < 100  # unscaled: the loss scale is 65536
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_fused_sgd_with_momentum_skipping_its_first_step(tmp_path):
    model = BatchNormClassifier((8,), steps=STEPS, inject=("grad_inf", 0, 0))
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    ours, _ = fit_one(model, tmp_path / "ours", callbacks=[NaNSkip()])
    reference = BatchNormClassifier((8,), steps=STEPS, drop_step=0)
    reference.configure_optimizers = lambda: torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, fused=True)
    ref, _ = fit_one(reference, tmp_path / "ref", steps=STEPS - 1)
    assert ours["skipped_steps"] == 1
    assert_same_training_state(ours, ref)


class TwoOptimizers(BatchNormClassifier):
    """Manual optimization with two optimizers over different parameter sets, stepped in turn (a GAN's shape)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[3].parameters(), lr=0.1)]

    def training_step(self, batch, batch_idx):
        x, y = batch
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self(x), y)
            if self._injecting("loss_nan", batch_idx):
                loss = loss * float("nan")
            self.manual_backward(loss)
            optimizer.step()


def test_two_optimizers_of_different_sizes(tmp_path):
    skip = NaNSkip()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2 * STEPS, callbacks=[skip], **QUIET)
    trainer.fit(TwoOptimizers(per_rank_batch=(8,), steps=STEPS, inject=("loss_nan", 0, BAD_STEP)))
    assert skip.skipped_steps == 2  # both optimizer steps of the bad batch


# --- one line on rank 0 when a step is skipped ---------------------------------------------------------------------


def skip_lines(caplog) -> list[str]:
    messages = [record.getMessage() for record in caplog.records]
    return [
        m for m in messages if m.startswith("NaNSkip: ") and ("skipped optimizer step" in m or "skipped since" in m)
    ]


class LinesSoFar(Callback):
    """The number of NaNSkip lines logged before each batch starts: when each line came."""

    def __init__(self, caplog) -> None:
        self.caplog = caplog
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counts.append(len(skip_lines(self.caplog)))


def test_a_skipped_step_gets_one_line_as_soon_as_it_happens(tmp_path, caplog):
    torch.manual_seed(0)
    seen = LinesSoFar(caplog)
    with caplog.at_level(logging.INFO):
        fit_one(
            BatchNormClassifier((8,), steps=STEPS, inject=("loss_nan", 0, BAD_STEP)),
            tmp_path,
            callbacks=[NaNSkip(), seen],
        )
    assert skip_lines(caplog) == ["NaNSkip: skipped optimizer step 2: the loss is NaN or Inf; 1 skipped so far."]
    assert seen.counts == [0, 0, 0, 1, 1]  # printed during step 2, not at the end of fit


def test_a_gradient_skip_names_the_gradients(tmp_path, caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO):
        fit_one(BatchNormClassifier((8,), steps=STEPS, inject=("grad_inf", 0, 1)), tmp_path, callbacks=[NaNSkip()])
    assert skip_lines(caplog) == ["NaNSkip: skipped optimizer step 1: NaN or Inf gradients; 1 skipped so far."]


@pytest.mark.parametrize(
    ("log_every", "logger", "counts", "through"),
    [(4, True, [0, 0, 0, 0, 1, 1, 1, 1, 1, 1], 3), (4, False, [0] * 10, 9), (0, True, [0] * 10, 9)],
)
def test_a_fused_optimizer_skip_is_told_at_the_next_logging_step(tmp_path, caplog, log_every, logger, counts, through):
    torch.manual_seed(0)
    seen, skip = LinesSoFar(caplog), NaNSkip()
    model = BatchNormClassifier((8,), steps=10, lr=0.01, optimizer="adam_fused", inject=("grad_inf", 0, BAD_STEP))
    loggers = {"logger": RecordingLogger()} if logger else {}
    with caplog.at_level(logging.INFO):
        fit_one(model, tmp_path, callbacks=[skip, seen], steps=10, log_every_n_steps=log_every, **loggers)
    # no host read of its own: the count is read at logging steps where a logger reads it anyway (3, 7 with
    # log_every_n_steps=4), else at the end of training
    assert skip_lines(caplog) == [
        f"NaNSkip: 1 optimizer step skipped since step 0 (through step {through}; skipped on the device, read at "
        "logging steps); 1 skipped so far."
    ]
    assert seen.counts == counts
    assert [(event.step, event.detail) for event in skip.events.since(0)] == [(through, f"1 in steps 0-{through}")]


def test_a_storm_of_skips_is_rate_limited(tmp_path, caplog):
    torch.manual_seed(0)
    skip = NaNSkip(max_consecutive=None)
    model = BatchNormClassifier((8,), steps=130, inject=("loss_nan", 0, -1))  # every step from step 1 on
    with caplog.at_level(logging.INFO):
        fit_one(model, tmp_path, callbacks=[skip], steps=130)
    lines = skip_lines(caplog)
    assert skip.skipped_steps == 129
    assert len(lines) == 11  # the first 10 skips, then one per 100
    assert lines[0] == "NaNSkip: skipped optimizer step 1: the loss is NaN or Inf; 1 skipped so far."
    assert lines[9].endswith("10 skipped so far; from now on one line per 100 skipped steps.")
    assert lines[10] == (
        "NaNSkip: skipped optimizer step 100: the loss is NaN or Inf; 100 skipped so far (one line per 100 skipped "
        "steps)."
    )
    assert skip.events.recorded == 129  # every skip is recorded for the memory timeline


@pytest.mark.distributed
def test_two_ranks_skip_together_and_rank_zero_prints_one_line(tmp_path):
    result = run_script(Path(__file__).parents[1] / "helpers" / "nan_fit.py", "--out", tmp_path, "--nan-at", 2)
    assert result["rc"] == 0 and not result["hung"], result["output"][-3000:]
    output = result["output"].decode() if isinstance(result["output"], bytes) else result["output"]
    lines = [line for line in output.splitlines() if line.startswith("NaNSkip: skipped optimizer step")]
    # rank 1's NaN loss reaches rank 0 through the gradient all-reduce: rank 0 names the gradients
    assert lines == [
        "NaNSkip: skipped optimizer step 2: NaN or Inf gradients (after the all-reduce: this rank's gradients, or "
        "another rank's loss); 1 skipped so far."
    ]
    events = [json.loads((tmp_path / f"events{rank}.json").read_text()) for rank in (0, 1)]
    assert events == [[[2, "skipped_steps", "NaN/Inf gradients"]], [[2, "skipped_steps", "NaN/Inf loss"]]]
