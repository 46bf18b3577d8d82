"""OOMBackoff across 2 real gloo processes (Lightning re-runs a script for rank 1), with out-of-memory errors
injected on rank 1 only: in the forward, in the backward, and in the optimizer step."""

from pathlib import Path

import pytest
import torch

from tests.helpers.models import load_rank_dumps
from tests.helpers.processes import run_script

SCRIPT = Path(__file__).parents[1] / "helpers" / "oom_fit.py"
NUM_SAMPLES = 32


def run_fit(out: Path, *args: object, timeout: float = 150) -> tuple[dict, list[dict]]:
    result = run_script(SCRIPT, "--out", out, *args, timeout=timeout)
    assert not result["hung"], result["output"][-3000:]
    return result, load_rank_dumps(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """Stock Lightning, no callback: micro-batches of 4 with gradient accumulation from the start."""
    out = tmp_path_factory.mktemp("reference")
    result, dumps = run_fit(out, "--inject", "none", "--batch-size", 4, "--accumulate", 2, "--no-backoff")
    assert result["rc"] == 0, result["output"][-3000:]
    return dumps


def assert_params_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def every_index_once_per_epoch(dumps: list[dict]) -> None:
    for epoch in range(2):
        union = sorted(i for dump in dumps for i in dump["epoch_indices"][epoch])
        assert union == list(range(NUM_SAMPLES)), f"epoch {epoch}"


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_on_one_rank_is_recovered_on_both(tmp_path, reference, where):
    result, dumps = run_fit(tmp_path, "--inject", where, "--rank", 1)
    assert result["rc"] == 0, result["output"][-3000:]
    assert "rank 1 ran out of memory at micro-batch size 8" in result["output"]

    assert [d["exception"] for d in dumps] == [None, None]
    assert [d["micro_batch_size"] for d in dumps] == [4, 4]
    assert [d["recoveries"] for d in dumps] == [1, 1]
    assert_params_close(dumps[0]["params"], dumps[1]["params"], atol=0)  # identical replicas
    assert_params_close(dumps[0]["params"], reference[0]["params"], atol=1e-5)  # the trajectory asked for
    # the metric that records indices (undone after a failed attempt) holds every sample once per epoch
    every_index_once_per_epoch(dumps)
    # rank 0 never ran out of memory: its training_step saw each of its samples once, never recomputed
    rank0_seen = [i for batch in dumps[0]["seen"] for i in batch]
    assert sorted(rank0_seen) == sorted(i for epoch in dumps[0]["epoch_indices"] for i in epoch)
    rank1_seen = [i for batch in dumps[1]["seen"] for i in batch]
    if where == "forward":
        # the failed attempt stopped before the list was appended to: every sample once on rank 1 too
        assert sorted(rank1_seen) == sorted(i for epoch in dumps[1]["epoch_indices"] for i in epoch)
    else:
        # the failed attempt's forward finished: the plain list (not undone) holds its 8 samples once more
        assert len(rank1_seen) == NUM_SAMPLES + 8


@pytest.mark.distributed
def test_an_oom_in_the_optimizer_step_on_one_rank_stops_both_within_seconds(tmp_path):
    result, dumps = run_fit(tmp_path, "--inject", "step", "--rank", 1, timeout=120)
    assert result["rc"] != 0
    assert result["seconds"] < 60, "the ranks waited for a collective timeout instead of stopping together"
    assert [d["exception"]["type"] for d in dumps] == ["OOMRecoveryError", "OOMRecoveryError"]
    assert "rank 1 ran out of memory inside the optimizer step; every rank stops" in dumps[0]["exception"]["message"]
    assert "inside the optimizer step (step 2)" in dumps[1]["exception"]["message"]
    assert "CUDA out of memory" in dumps[1]["exception"]["message"]


@pytest.mark.distributed
def test_an_oom_in_the_last_optimizer_step_on_one_rank_stops_both(tmp_path):
    # the step that reaches max_steps: without an agreement right after the step, rank 0 would end training while
    # rank 1, one step behind, waited for another batch
    result, dumps = run_fit(tmp_path, "--inject", "step", "--rank", 1, "--step-oom-at", 3, "--max-steps", 3)
    assert result["rc"] != 0
    assert [d["exception"]["type"] for d in dumps] == ["OOMRecoveryError", "OOMRecoveryError"]
    assert dumps[0]["global_step"] == 3  # rank 0 finished the step rank 1 failed
