"""step_pieces: the logs and outputs of a step run in pieces, one set of rules for OOMBackoff and DataParallel."""

import dataclasses
import threading
from collections import namedtuple
from typing import Any, NamedTuple

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torchmetrics import MeanMetric

from lightning_mgpu.core.step_pieces import (
    LogCall,
    capture_logs,
    combine_log_calls,
    log_call,
    merge_outputs,
    replay_logs,
)
from tests.helpers.trainer import RecordingLogger

# ------------------------------------------------------------------------------------ capture and replay in a fit
SAMPLES = (3, 1)  # the two pieces of every step
VALUES = [(5.0, 1.0), (1.0, 5.0)]  # per step, the value each piece logs: the larger one first, then last
BATCH_SIZES = [(3, 1), (1, 3)]  # per step, the explicit batch_size each piece passes for "epoch_mean"


def _weighted(values: tuple[float, float], weights: tuple[int, int] = SAMPLES) -> float:
    return sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)


class PieceLogging(BoringModel):
    """Runs each training_step's logging as two captured pieces, then replays it once."""

    def __init__(self) -> None:
        super().__init__()
        self.captured: list[list[LogCall]] = []
        self.shadowed_after: list[bool] = []

    def _log_piece(self, batch_idx: int, piece: int) -> None:
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
        calls: list[LogCall] = []
        for piece, samples in enumerate(SAMPLES):
            with capture_logs(self, calls, samples):
                self._log_piece(batch_idx, piece)
            self.shadowed_after.append("log" in self.__dict__)
        with capture_logs(self, [], samples=2):
            self.log("dropped", 1.0)  # captured into a list nobody replays: never logged
        self.captured.append(calls)
        replay_logs(self, calls, "training_step")
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> tuple[PieceLogging, RecordingLogger]:
    torch.manual_seed(0)
    model = PieceLogging()
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
        default_root_dir=tmp_path_factory.mktemp("step_pieces"),
    )
    trainer.fit(model)
    assert trainer.global_step == len(VALUES)
    return model, logger


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("mean", [4.0, 2.0]),  # weighted by samples 3 and 1
        ("mean_tensor", [4.0, 2.0]),
        ("dict_a", [4.0, 2.0]),
        ("dict_b", [-40.0, -20.0]),
        ("sum", [6.0, 6.0]),
        ("sum_fn", [6.0, 6.0]),
        ("max", [5.0, 5.0]),
        ("min", [1.0, 1.0]),
        ("single", [7.0, 8.0]),  # logged by one piece: replayed unchanged
    ],
)
def test_each_key_reaches_the_logger_once_a_step_combined(fitted, key, expected):
    _, logger = fitted
    assert logger.values(key) == pytest.approx(expected)
    assert logger.values("dropped") == [], "a captured call must not reach the logger by itself"


def test_explicit_batch_sizes_weigh_the_mean_and_are_summed_for_the_epoch(fitted):
    _, logger = fitted
    # step values weighted by the explicit sizes: 4.0 (3 and 1), then 4.0 (1 and 3); the epoch weighs the steps by
    # their summed sizes, 4 and 4
    step_values = [_weighted(v, sizes) for v, sizes in zip(VALUES, BATCH_SIZES, strict=True)]
    assert step_values == [4.0, 4.0]
    assert logger.values("epoch_mean") == pytest.approx([4.0])


def test_calls_are_captured_by_name_in_order_with_their_samples(fitted):
    model, _ = fitted
    first_step = model.captured[0]
    assert first_step[0] == LogCall({"name": "mean", "value": 5.0}, samples=3)
    sum_call = next(c for c in first_step if c.name == "sum")
    assert sum_call.arguments == {"name": "sum", "value": 5.0, "reduce_fx": "sum"}
    dict_calls = [(c.name, c.value, c.samples) for c in first_step if c.name.startswith("dict_")]
    assert dict_calls == [("dict_a", 5.0, 3), ("dict_b", -50.0, 3), ("dict_a", 1.0, 1), ("dict_b", -10.0, 1)]


def test_log_is_the_class_method_again_after_each_capture(fitted):
    model, _ = fitted
    assert model.shadowed_after == [False] * (len(VALUES) * len(SAMPLES))
    assert "log" not in model.__dict__
    assert model.log.__func__ is LightningModule.log


def test_capture_records_instead_of_logging_and_unshadows_after_an_error():
    model = BoringModel()
    calls: list[LogCall] = []
    with pytest.raises(RuntimeError, match="out of memory"), capture_logs(model, calls, samples=5):
        assert "log" not in model.__dict__ and type(model) is BoringModel  # the module itself is untouched
        model.log("loss", 2.0, prog_bar=True)  # no trainer attached: the real log would have warned and dropped it
        raise RuntimeError("out of memory")
    assert "log" not in model.__dict__
    assert model.log.__func__ is LightningModule.log
    assert calls == [LogCall({"name": "loss", "value": 2.0, "prog_bar": True}, samples=5)]
    with pytest.warns(UserWarning, match="reference is not registered"):
        model.log("after", 1.0)  # the capture ended with the error: Lightning's own log runs (and, trainerless, warns)
    assert len(calls) == 1


def test_a_capture_holds_back_one_modules_calls_in_one_thread_and_nests():
    model, other = BoringModel(), BoringModel()
    outer: list[LogCall] = []
    inner: list[LogCall] = []

    def log_in_another_thread() -> None:
        model.log("thread", 1.0)  # Lightning's own log: no trainer attached, so it warns and drops it

    with capture_logs(model, outer, samples=2):
        with capture_logs(other, inner, samples=1):
            model.log("a", 1.0)
            other.log("b", 2.0)
        thread = threading.Thread(target=log_in_another_thread)
        with pytest.warns(UserWarning, match="trainer` reference is not registered"):
            thread.start()
            thread.join()
        model.log("c", 3.0)
    assert [call.name for call in outer] == ["a", "c"] and [call.name for call in inner] == ["b"]


def test_the_log_capture_is_a_named_reversible_patch_of_lightning():
    from lightning_mgpu.core import compat

    model = BoringModel()
    with capture_logs(model, [], samples=1):
        pass
    assert "log_capture" in compat.installed_patches()
    ours = LightningModule.log
    try:
        assert compat.remove_patch("log_capture")
        assert LightningModule.log is ours.__wrapped__  # Lightning's own
        assert "log_capture" not in compat.installed_patches()
        calls: list[LogCall] = []
        with capture_logs(model, calls, samples=1):  # puts it back, once
            model.log("x", 1.0)
        assert LightningModule.log.__wrapped__ is ours.__wrapped__
        assert [call.name for call in calls] == ["x"]
    finally:
        LightningModule.log = ours


# ------------------------------------------------------------------------------------ combining log calls
def _two_pieces(first: Any, last: Any, **options: Any) -> list[LogCall]:
    return [log_call(3, "x", first, **options), log_call(1, "x", last, **options)]


@pytest.mark.parametrize(
    ("reduce_fx", "expected"),
    [
        ("mean", 4.0),
        ("avg", 4.0),
        ("AVG", 4.0),
        (torch.mean, 4.0),
        ("sum", 6.0),
        ("Sum", 6.0),
        (torch.sum, 6.0),
        (sum, 6.0),
        ("max", 5.0),
        ("MAX", 5.0),
        (torch.max, 5.0),
        (max, 5.0),
        ("min", 1.0),
        (torch.min, 1.0),
        (min, 1.0),
    ],
)
def test_reduce_fx_accepts_what_lightning_accepts(reduce_fx, expected):
    (combined,) = combine_log_calls(_two_pieces(torch.tensor(5.0), torch.tensor(1.0), reduce_fx=reduce_fx))
    assert combined["value"].item() == pytest.approx(expected)
    assert combined["reduce_fx"] is reduce_fx  # passed on for Lightning's epoch reduction


@pytest.mark.parametrize("reduce_fx", ["median", torch.median, lambda values: values[0]])
def test_a_reduce_fx_lightning_refuses_is_refused_even_for_one_call(reduce_fx):
    with pytest.raises(ValueError, match=r"unsupported reduce_fx=.* for logged key 'x'.*'mean' \(or 'avg'\), 'sum'"):
        combine_log_calls(_two_pieces(1.0, 2.0, reduce_fx=reduce_fx))
    with pytest.raises(ValueError, match=r"unsupported reduce_fx=.* for logged key 'x'"):
        combine_log_calls([log_call(1, "x", 1.0, reduce_fx=reduce_fx)])


def test_a_mean_of_integer_counts_is_a_fraction_and_their_sum_a_count():
    counts = (torch.tensor(1), torch.tensor(2))
    samples = [1, 3]
    calls = [log_call(n, "n", value) for n, value in zip(samples, counts, strict=True)]
    (mean,) = combine_log_calls(calls)
    assert mean["value"].dtype == torch.get_default_dtype()
    assert mean["value"].item() == pytest.approx(1.75)
    calls = [log_call(n, "n", value, reduce_fx="sum") for n, value in zip(samples, counts, strict=True)]
    (total,) = combine_log_calls(calls)
    assert total["value"].dtype == torch.int64
    assert total["value"].item() == 3


def test_python_numbers_combine_into_python_numbers():
    (mean,) = combine_log_calls(_two_pieces(5.0, 1.0))
    assert mean["value"] == pytest.approx(4.0)
    assert isinstance(mean["value"], float)
    (total,) = combine_log_calls(_two_pieces(5, 1, reduce_fx="sum"))
    assert total["value"] == 6
    assert isinstance(total["value"], int)


def test_explicit_batch_size_weighs_the_mean_and_is_summed():
    calls = [log_call(3, "x", 1.0, batch_size=2), log_call(1, "x", 5.0, batch_size=6)]
    (combined,) = combine_log_calls(calls)
    assert combined["value"] == pytest.approx((2 * 1.0 + 6 * 5.0) / 8)
    assert combined["batch_size"] == 8


def test_without_a_batch_size_on_every_call_samples_weigh_and_none_is_added():
    (none_given,) = combine_log_calls(_two_pieces(5.0, 1.0))
    assert none_given == {"name": "x", "value": pytest.approx(4.0)}  # Lightning measures the whole batch itself
    mixed = [log_call(3, "x", 5.0, batch_size=2), log_call(1, "x", 1.0)]
    (combined,) = combine_log_calls(mixed)
    assert combined == {"name": "x", "value": pytest.approx(4.0)}


def test_a_logged_metric_is_logged_once_as_the_last_calls_object():
    metric, other = MeanMetric(), MeanMetric()
    calls = [log_call(3, "m", other, prog_bar=False), log_call(1, "m", metric, prog_bar=True)]
    (combined,) = combine_log_calls(calls)
    assert combined["value"] is metric
    assert combined["prog_bar"] is True


def test_keys_keep_their_first_call_order_and_the_last_calls_options():
    calls = [
        log_call(3, "a", 2.0, prog_bar=False),
        log_call(3, "b", 1.0),
        log_call(1, "c", 4.0),
        log_call(1, "b", 5.0, on_epoch=True),
        log_call(1, "a", 6.0, prog_bar=True),
    ]
    combined = combine_log_calls(calls)
    assert [arguments["name"] for arguments in combined] == ["a", "b", "c"]
    assert combined[0] == {"name": "a", "value": pytest.approx(3.0), "prog_bar": True}
    assert combined[1] == {"name": "b", "value": pytest.approx(2.0), "on_epoch": True}


def test_a_key_logged_once_keeps_its_arguments_and_value_object():
    value = torch.tensor(3, dtype=torch.int64)
    call = log_call(2, "k", value, reduce_fx="sum", batch_size=5, prog_bar=True)
    (combined,) = combine_log_calls([call])
    assert combined == {"name": "k", "value": value, "reduce_fx": "sum", "batch_size": 5, "prog_bar": True}
    assert combined["value"] is value


def test_the_graph_is_kept_only_with_enable_graph():
    weight = torch.tensor(2.0, requires_grad=True)
    (detached,) = combine_log_calls(_two_pieces(weight * 1, weight * 3))
    assert not detached["value"].requires_grad
    (kept,) = combine_log_calls(_two_pieces(weight * 1, weight * 3, enable_graph=True))
    (grad,) = torch.autograd.grad(kept["value"], weight)
    assert grad.item() == pytest.approx((3 * 1 + 1 * 3) / 4)


def test_a_tensor_of_several_elements_is_refused():
    with pytest.raises(ValueError, match=r"self.log\('x', ...\)` was called with a tensor of 2 elements"):
        combine_log_calls(_two_pieces(torch.zeros(2), torch.zeros(2)))


class _StubModule:
    """Records what replay_logs passes to ``log``, and the hook it was named for."""

    def __init__(self) -> None:
        self._current_fx_name: str | None = "on_train_batch_start"
        self.logged: list[tuple[dict[str, Any], str | None]] = []

    def log(self, **kwargs: Any) -> None:
        self.logged.append((kwargs, self._current_fx_name))


def test_replay_logs_each_combined_key_as_from_the_hook_and_restores_it():
    module = _StubModule()
    replay_logs(module, [*_two_pieces(5.0, 1.0), log_call(1, "y", 2.0)], "validation_step")
    assert module.logged == [
        ({"name": "x", "value": pytest.approx(4.0)}, "validation_step"),
        ({"name": "y", "value": 2.0}, "validation_step"),
    ]
    assert module._current_fx_name == "on_train_batch_start"
    replay_logs(module, [], "training_step")
    assert len(module.logged) == 2


# ------------------------------------------------------------------------------------ merging step outputs
class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    path: list[str]
    source: str = "disk"


def test_a_single_output_is_returned_unchanged():
    output = {"a": torch.zeros(2)}
    assert merge_outputs([output], [2]) is output


def test_the_weighted_mean_of_piece_losses_is_the_full_batch_loss_and_its_gradient():
    torch.manual_seed(0)
    weight = torch.randn(5, 1, requires_grad=True)
    x, y = torch.randn(7, 5), torch.randn(7, 1)
    full = torch.nn.functional.mse_loss(x @ weight, y)
    (full_grad,) = torch.autograd.grad(full, weight)

    losses = [torch.nn.functional.mse_loss(px @ weight, py) for px, py in ((x[:4], y[:4]), (x[4:], y[4:]))]
    merged = merge_outputs(losses, [4, 3])
    (merged_grad,) = torch.autograd.grad(merged, weight)

    torch.testing.assert_close(merged, full)
    torch.testing.assert_close(merged_grad, full_grad)
    assert not torch.allclose(torch.stack(losses).mean(), full)  # an unweighted mean is wrong for uneven pieces


def test_a_scalar_keeps_a_float_dtype_and_a_mean_of_integers_is_a_float():
    half = merge_outputs([torch.tensor(1.0, dtype=torch.float16), torch.tensor(3.0, dtype=torch.float16)], [1, 1])
    assert half.dtype == torch.float16
    assert half.item() == 2.0
    counts = merge_outputs([torch.tensor(1), torch.tensor(2)], [1, 3])
    assert counts.dtype == torch.get_default_dtype()
    assert counts.item() == pytest.approx(1.75)


def test_merge_by_structure():
    Out = namedtuple("Out", ["loss", "preds"])
    outputs = [
        {
            "loss": torch.tensor(1.0),
            "preds": torch.zeros(3, 2),
            "extra": Out(torch.tensor(2.0), torch.ones(3)),
            "acc": 0.5,
            "names": ["a", "b", "c"],
            "tag": "first",
            "step": 5,
            "none": None,
        },
        {
            "loss": torch.tensor(4.0),
            "preds": torch.ones(1, 2),
            "extra": Out(torch.tensor(6.0), torch.zeros(1)),
            "acc": 1.0,
            "names": ["d"],
            "tag": "second",
            "step": 5,
            "none": None,
        },
    ]
    merged = merge_outputs(outputs, [3, 1])
    torch.testing.assert_close(merged["loss"], torch.tensor(1.75))
    assert torch.equal(merged["preds"], torch.cat([torch.zeros(3, 2), torch.ones(1, 2)]))
    assert type(merged["extra"]) is Out
    torch.testing.assert_close(merged["extra"].loss, torch.tensor(3.0))
    assert torch.equal(merged["extra"].preds, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert merged["acc"] == pytest.approx(0.625)
    assert merged["names"] == ["a", "b", "c", "d"]  # per sample: concatenated
    assert merged["tag"] == ["first", "second"]  # differing: one per piece, in order
    assert merged["step"] == 5
    assert type(merged["step"]) is int  # equal in every piece: kept as it is
    assert merged["none"] is None
    assert merge_outputs([None, None], [1, 1]) is None


def test_a_namedtuple_and_a_dataclass_keep_their_types():
    pair = merge_outputs([Pair(torch.zeros(2), torch.ones(2)), Pair(torch.zeros(1), torch.ones(1))], [2, 1])
    assert type(pair) is Pair
    assert pair.x.shape == (3,)
    sample = merge_outputs([Sample(torch.zeros(1, 2), ["p"]), Sample(torch.ones(2, 2), ["q", "r"])], [1, 2])
    assert type(sample) is Sample
    assert sample.image.shape == (3, 2)
    assert sample.path == ["p", "q", "r"]
    assert sample.source == "disk"


def test_a_list_that_is_not_per_sample_is_merged_item_by_item():
    whole_batch = [f"file{i}" for i in range(7)]  # DataParallel gives every replica the batch's whole list
    assert merge_outputs([{"files": whole_batch}, {"files": list(whole_batch)}], [4, 3]) == {"files": whole_batch}
    assert merge_outputs([[0.5, "x"], [1.0, "x"]], [3, 1]) == [pytest.approx(0.625), "x"]
    repeated = merge_outputs([["cat", "cat"], ["cat", "cat"]], [2, 2])  # per sample, however equal
    assert repeated == ["cat"] * 4


def test_outputs_that_differ_in_structure_become_one_per_piece():
    loss = torch.tensor(1.0)
    assert merge_outputs([loss, None], [1, 1]) == [loss, None]
    assert merge_outputs([{"a": 1}, {"b": 1}], [1, 1]) == [{"a": 1}, {"b": 1}]


def test_merge_outputs_refuses_mismatched_lengths_and_no_samples():
    with pytest.raises(ValueError, match="got 2 outputs but 1 sample counts"):
        merge_outputs([torch.zeros(1), torch.zeros(1)], [1])
    with pytest.raises(ValueError, match=r"sample counts must sum to a positive number, got \[0, 0\]"):
        merge_outputs([torch.tensor(1.0), torch.tensor(2.0)], [0, 0])
