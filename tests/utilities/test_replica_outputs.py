from collections import namedtuple

import pytest
import torch

from lightning_mgpu.utilities.replica_outputs import (
    LogCall,
    ReplicaRecord,
    merge_log_calls,
    merge_replica_outputs,
    weighted_mean,
)


def test_weighted_mean_of_chunk_losses_is_the_full_batch_loss_and_its_gradient():
    torch.manual_seed(0)
    weight = torch.randn(5, 1, requires_grad=True)
    x, y = torch.randn(7, 5), torch.randn(7, 1)
    full = torch.nn.functional.mse_loss(x @ weight, y)
    (full_grad,) = torch.autograd.grad(full, weight)

    chunks = [(x[:4], y[:4]), (x[4:], y[4:])]
    losses = [torch.nn.functional.mse_loss(cx @ weight, cy) for cx, cy in chunks]
    merged = weighted_mean(losses, [4, 3])
    (merged_grad,) = torch.autograd.grad(merged, weight)

    torch.testing.assert_close(merged, full)
    torch.testing.assert_close(merged_grad, full_grad)
    # an unweighted mean (what DataParallel's gather + .mean() gives) is wrong for uneven chunks
    assert not torch.allclose(torch.stack(losses).mean(), full)


def test_weighted_mean_keeps_dtype_and_rejects_empty_weights():
    half = weighted_mean([torch.tensor(1.0, dtype=torch.float16), torch.tensor(3.0, dtype=torch.float16)], [1, 1])
    assert half.dtype == torch.float16 and float(half) == 2.0
    assert weighted_mean([1.0, 4.0], [1, 2]) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="positive"):
        weighted_mean([1.0], [0])


def test_merge_replica_outputs_by_structure():
    Out = namedtuple("Out", ["loss", "preds"])
    outputs = [
        {
            "loss": torch.tensor(1.0),
            "preds": torch.zeros(3, 2),
            "extra": Out(torch.tensor(2.0), torch.ones(3)),
            "tag": "a",
            "step": 5,
            "none": None,
        },
        {
            "loss": torch.tensor(4.0),
            "preds": torch.ones(1, 2),
            "extra": Out(torch.tensor(6.0), torch.zeros(1)),
            "tag": "b",
            "step": 5,
            "none": None,
        },
    ]
    merged = merge_replica_outputs(outputs, [3, 1], "cpu")
    torch.testing.assert_close(merged["loss"], torch.tensor(1.75))
    assert torch.equal(merged["preds"], torch.cat([torch.zeros(3, 2), torch.ones(1, 2)]))
    assert isinstance(merged["extra"], Out)
    torch.testing.assert_close(merged["extra"].loss, torch.tensor(3.0))
    assert merged["extra"].preds.shape == (4,)
    assert merged["tag"] == ["a", "b"]
    assert merged["step"] == 5
    assert merged["none"] is None
    assert merge_replica_outputs([None, None], [1, 1], "cpu") is None
    with pytest.raises(ValueError, match="2 replica outputs but 1 weights"):
        merge_replica_outputs([1, 2], [1], "cpu")


def test_merge_log_calls_is_weighted_ordered_and_honours_reduce_fx():
    first = ReplicaRecord(
        batch_size=6,
        calls=[
            LogCall("loss", torch.tensor(1.0), {"prog_bar": True}),
            LogCall("seen", 6.0, {"reduce_fx": "sum"}),
            LogCall("peak", torch.tensor(3.0), {"reduce_fx": torch.max}),
            LogCall("low", torch.tensor(3.0), {"reduce_fx": "min"}),
            LogCall("given", torch.tensor(0.0), {"batch_size": 1}),
        ],
    )
    second = ReplicaRecord(
        batch_size=2,
        calls=[
            LogCall("given", torch.tensor(10.0), {"batch_size": 4}),
            LogCall("loss", torch.tensor(5.0), {"prog_bar": True}),
            LogCall("seen", 2.0, {"reduce_fx": "sum"}),
            LogCall("peak", torch.tensor(7.0), {"reduce_fx": torch.max}),
            LogCall("low", torch.tensor(-1.0), {"reduce_fx": "min"}),
            LogCall("only_second", torch.tensor(9.0), {}),
        ],
    )
    merged = {call.name: call for call in merge_log_calls([first, second], "cpu")}
    assert list(merged) == ["loss", "seen", "peak", "low", "given", "only_second"]
    torch.testing.assert_close(merged["loss"].value, torch.tensor(2.0))  # (6*1 + 2*5) / 8
    assert merged["loss"].kwargs == {"prog_bar": True, "batch_size": 8}
    assert merged["seen"].value == pytest.approx(8.0)
    assert float(merged["peak"].value) == 7.0
    assert float(merged["low"].value) == -1.0
    torch.testing.assert_close(merged["given"].value, torch.tensor(8.0))  # explicit batch sizes 1 and 4
    assert merged["given"].kwargs["batch_size"] == 5
    torch.testing.assert_close(merged["only_second"].value, torch.tensor(9.0))


def test_merge_log_calls_rejects_unknown_reduction():
    record = ReplicaRecord(1, [LogCall("x", 1.0, {"reduce_fx": "median"})])
    with pytest.raises(ValueError, match="unsupported reduce_fx='median' for logged key 'x'"):
        merge_log_calls([record], "cpu")
