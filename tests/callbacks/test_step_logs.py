"""capture_logs and replay_logs: a step run as two micro-batches logs each key once, combined as reduce_fx asks."""

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mgpu.callbacks._step_logs import LoggedCall, capture_logs, replay_logs
from tests.helpers.trainer import RecordingLogger

SAMPLES = (3, 1)  # the two fake micro-batches of every step
VALUES = [(5.0, 1.0), (1.0, 5.0)]  # per step, the value each micro-batch logs: the larger one first, then last
BATCH_SIZES = [(3, 1), (1, 1)]  # per step, the explicit batch_size each micro-batch passes: 4 in all, then 2


def _weighted_mean(values: tuple[float, float]) -> float:
    return sum(s * v for s, v in zip(SAMPLES, values, strict=True)) / sum(SAMPLES)


class MicroBatchLogging(BoringModel):
    """Runs each training_step's logging as two captured micro-batches, then replays it once."""

    def __init__(self) -> None:
        super().__init__()
        self.captured: list[list[LoggedCall]] = []
        self.shadowed_after: list[bool] = []

    def _log_micro_batch(self, batch_idx: int, piece: int) -> None:
        value = VALUES[batch_idx][piece]
        self.log("mean", value)
        self.log("mean_tensor", torch.tensor(value))
        self.log("sum", value, reduce_fx="sum")
        self.log("sum_fn", torch.tensor(value), reduce_fx=torch.sum)
        self.log("max", value, reduce_fx="max")
        self.log("min", torch.tensor(value), reduce_fx="min")
        self.log_dict({"dict_a": value, "dict_b": -10 * value})
        self.log("epoch_mean", value, on_step=False, on_epoch=True, batch_size=BATCH_SIZES[batch_idx][piece])
        if piece == 0:
            self.log("single", 7.0 + batch_idx, reduce_fx="sum")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        calls: list[LoggedCall] = []
        for piece, samples in enumerate(SAMPLES):
            with capture_logs(self, calls, samples):
                self._log_micro_batch(batch_idx, piece)
            self.shadowed_after.append("log" in self.__dict__)
        with capture_logs(self, [], samples=2):
            self.log("dropped", 1.0)  # captured into a list nobody replays: never logged
        self.captured.append(calls)
        replay_logs(self, calls, "training_step")
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> tuple[MicroBatchLogging, RecordingLogger]:
    model = MicroBatchLogging()
    logger = RecordingLogger()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=len(VALUES),
        limit_train_batches=len(VALUES),
        limit_val_batches=0,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=tmp_path_factory.mktemp("step_logs"),
    )
    trainer.fit(model)
    assert trainer.global_step == len(VALUES)
    return model, logger


@pytest.mark.parametrize("key", ["mean", "mean_tensor"])
def test_default_reduce_logs_the_mean_weighted_by_samples(fitted, key):
    _, logger = fitted
    assert logger.values(key) == pytest.approx([_weighted_mean(v) for v in VALUES])  # 4.0, then 2.0


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("sum", [6.0, 6.0]),
        ("sum_fn", [6.0, 6.0]),
        ("max", [5.0, 5.0]),
        ("min", [1.0, 1.0]),
    ],
)
def test_reduce_fx_combines_the_micro_batches(fitted, key, expected):
    _, logger = fitted
    assert logger.values(key) == pytest.approx(expected)


def test_log_dict_calls_are_captured_and_combined(fitted):
    model, logger = fitted
    assert logger.values("dict_a") == pytest.approx([_weighted_mean(v) for v in VALUES])
    assert logger.values("dict_b") == pytest.approx([-10 * _weighted_mean(v) for v in VALUES])
    dict_calls = [call for call in model.captured[0] if call.arguments["name"].startswith("dict_")]
    assert [(c.arguments["name"], c.arguments["value"], c.samples) for c in dict_calls] == [
        ("dict_a", 5.0, 3),
        ("dict_b", -50.0, 3),
        ("dict_a", 1.0, 1),
        ("dict_b", -10.0, 1),
    ]


def test_positional_arguments_are_captured_by_name(fitted):
    model, _ = fitted
    first_step = model.captured[0]
    assert first_step[0].arguments == {"name": "mean", "value": 5.0}
    assert first_step[0].samples == 3
    sum_call = next(c for c in first_step if c.arguments["name"] == "sum")
    assert sum_call.arguments == {"name": "sum", "value": 5.0, "reduce_fx": "sum"}
    assert [c.samples for c in first_step if c.arguments["name"] == "mean"] == list(SAMPLES)


def test_each_key_is_logged_once_a_step(fitted):
    _, logger = fitted
    step_keys = ["mean", "mean_tensor", "sum", "sum_fn", "max", "min", "dict_a", "dict_b", "single"]
    for key in step_keys:
        assert len(logger.values(key)) == len(VALUES), key
    assert logger.values("dropped") == [], "a captured call must not reach the logger by itself"


def test_explicit_batch_size_is_summed_over_micro_batches(fitted):
    _, logger = fitted
    # the epoch value weighs each step by its batch_size: 3 + 1 = 4, then 1 + 1 = 2 (taking the last micro-batch's
    # size would weigh the steps equally, the first one's 3 to 1)
    step_means = [_weighted_mean(v) for v in VALUES]
    totals = [sum(sizes) for sizes in BATCH_SIZES]
    expected = sum(m * t for m, t in zip(step_means, totals, strict=True)) / sum(totals)
    assert logger.values("epoch_mean") == pytest.approx([expected])  # 20 / 6


def test_key_captured_once_is_replayed_unchanged(fitted):
    _, logger = fitted
    assert logger.values("single") == pytest.approx([7.0, 8.0])


def test_log_is_the_class_method_again_after_each_capture(fitted):
    model, _ = fitted
    assert model.shadowed_after == [False] * (len(VALUES) * len(SAMPLES))
    assert "log" not in model.__dict__
    assert model.log.__func__ is LightningModule.log


def test_capture_records_instead_of_logging_and_unshadows_after_an_error():
    model = BoringModel()
    calls: list[LoggedCall] = []
    with pytest.raises(RuntimeError, match="out of memory"), capture_logs(model, calls, samples=5):
        assert "log" in model.__dict__
        model.log("loss", 2.0, prog_bar=True)  # no trainer attached: the real log would have failed
        raise RuntimeError("out of memory")
    assert "log" not in model.__dict__
    assert model.log.__func__ is LightningModule.log
    assert len(calls) == 1
    assert calls[0].arguments == {"name": "loss", "value": 2.0, "prog_bar": True}
    assert calls[0].samples == 5


class _StubModule:
    """Records what replay_logs passes to ``log``, and the hook it was named for."""

    def __init__(self) -> None:
        self._current_fx_name: str | None = "on_train_batch_start"
        self.logged: list[tuple[dict[str, Any], str | None]] = []

    def log(self, **kwargs: Any) -> None:
        self.logged.append((kwargs, self._current_fx_name))


def test_single_calls_are_replayed_with_their_arguments_untouched():
    module = _StubModule()
    value = torch.tensor(3, dtype=torch.int64)
    arguments = {"name": "k", "value": value, "reduce_fx": "sum", "batch_size": 5, "prog_bar": True}
    replay_logs(module, [LoggedCall(dict(arguments), samples=2), LoggedCall({"name": "j", "value": 1}, 1)], "hook")
    assert [kwargs for kwargs, _ in module.logged] == [arguments, {"name": "j", "value": 1}]
    assert module.logged[0][0]["value"] is value
    assert [fx for _, fx in module.logged] == ["hook", "hook"]
    assert module._current_fx_name == "on_train_batch_start"


def test_replay_keeps_the_last_call_arguments_and_sums_batch_size_only_when_all_have_one():
    module = _StubModule()
    calls = [
        LoggedCall({"name": "a", "value": 2.0, "batch_size": 3, "prog_bar": False}, 3),
        LoggedCall({"name": "b", "value": 1.0, "batch_size": 2}, 3),
        LoggedCall({"name": "a", "value": 6.0, "batch_size": 1, "prog_bar": True}, 1),
        LoggedCall({"name": "b", "value": 5.0}, 1),
    ]
    replay_logs(module, calls, "validation_step")
    (a, fx_a), (b, _) = module.logged
    assert fx_a == "validation_step"
    assert a["batch_size"] == 4
    assert a["prog_bar"] is True
    torch.testing.assert_close(a["value"], torch.tensor(3.0))  # (3 * 2 + 1 * 6) / 4
    assert "batch_size" not in b
    torch.testing.assert_close(b["value"], torch.tensor(2.0))  # (3 * 1 + 1 * 5) / 4


def test_replay_of_nothing_logs_nothing():
    module = _StubModule()
    replay_logs(module, [], "training_step")
    assert module.logged == []
    assert module._current_fx_name == "on_train_batch_start"


def test_a_weighted_mean_of_integer_counts_stays_a_fraction():
    from lightning_mgpu.callbacks._step_logs import _combine_values

    calls = [
        LoggedCall({"name": "n", "value": torch.tensor(1)}, samples=1),
        LoggedCall({"name": "n", "value": torch.tensor(2)}, samples=3),
    ]
    assert _combine_values(calls, "mean").item() == pytest.approx(1.75)
    assert _combine_values(calls, "sum").item() == 3
