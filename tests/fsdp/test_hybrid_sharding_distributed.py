"""Hybrid sharding (``MultiGPUStrategy(mode="fsdp", sharding="hybrid")``) as 2 nodes x 2 processes: two ``torchrun``
agents over loopback, each starting its node's 2 processes, and ``Trainer(num_nodes=2, devices=2)``.

The model is sharded within each node and replicated across the two; the reference is stock DDP on 4 processes of one
node (the same world size, so the same batches). Both train a tied plain-torch LM and GPT-2 with an ``EMA``, and
with ``NaNSkip`` and ``GradientClipping(max_norm=0.5)``, which read the global gradient norm over the shards.
"""

import shutil
from pathlib import Path

import pytest
import torch

from lightning_mgpu.fsdp.sharded_checkpoint import export_state_dict
from tests.helpers.processes import REPO, run_script, run_torchrun_nodes

pytest.importorskip("transformers")

SCRIPT = Path(REPO) / "tests" / "helpers" / "lm_fit.py"
MODELS = ("tied", "gpt2")
NODES = [(0, 1), (2, 3)]  # the global ranks of each node


def record(out: Path, model: str) -> dict:
    return torch.load(out / model / "result.pt", weights_only=False)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def hybrid_fit(out: Path, *args: object) -> dict:
    args = ("--strategy", "hybrid", "--nodes", 2, "--devices", 2, "--guards", *args)
    result = run_torchrun_nodes(SCRIPT, "--out", out, *args)
    assert not result["hung"] and result["rc"] == 0, result["output"][-4000:]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    outs = {"hybrid": tmp_path_factory.mktemp("hybrid"), "ddp": tmp_path_factory.mktemp("ddp4")}
    outs["log"] = hybrid_fit(outs["hybrid"], "--models", *MODELS)["output"]
    ddp = run_script(SCRIPT, "--out", outs["ddp"], "--models", *MODELS, "--strategy", "ddp", "--devices", 4,
                     "--guards", timeout=240, ranks=4)  # fmt: skip
    assert not ddp["hung"] and ddp["rc"] == 0, ddp["output"][-4000:]
    return outs


@pytest.mark.parametrize("model", MODELS)
def test_hybrid_sharding_trains_like_ddp_with_half_the_elements_on_each_rank(runs, model):
    hybrid, reference = record(runs["hybrid"], model), record(runs["ddp"], model)
    assert hybrid["strategy"] == "FSDPStrategy" and hybrid["global_step"] == reference["global_step"] == 8
    assert max_difference(hybrid["params"], reference["params"]) <= 1e-5
    assert max_difference(hybrid["ema"], reference["ema"]) <= 1e-5
    assert [rank["local"] for rank in hybrid["ranks"]] == [hybrid["total_numel"] // 2] * 4
    # the global norm is summed over a node's shards only, not over the replicas too (that would read sqrt(2) times
    # more); above 0.5, so the clip acted on the last step at least
    assert hybrid["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4) and hybrid["grad_norm"] > 0.5
    assert "over 2 replicas of 2 processes (hybrid sharding)" in runs["log"]


@pytest.mark.parametrize("model", MODELS)
def test_every_all_gather_stays_within_a_node(runs, model):
    hybrid = record(runs["hybrid"], model)
    for rank, seen in enumerate(hybrid["ranks"]):
        node = NODES[rank // 2]
        assert seen["gathers"] == [node]  # the process groups of every all-gather FSDP issued on this rank
        assert seen["shard_groups"] == [node]  # the parameters' shard dimension
        assert seen["calls"] == {"barrier": 1} and seen["dispatched"] == 0  # EMA's per-step hook issued none


@pytest.mark.timeout(400)
def test_a_hybrid_run_resumes_bit_identical_and_exports(runs, tmp_path):
    # the uninterrupted run's checkpoint at step 4 (the first batch of its second epoch), resumed by a new run
    source = runs["hybrid"] / "tied" / "ckpt"
    shutil.copytree(source / "epoch=1-step=4.ckpt", tmp_path / "tied" / "ckpt" / "last.ckpt")
    hybrid_fit(tmp_path, "--models", "tied", "--resume")
    resumed, uninterrupted = record(tmp_path, "tied"), record(runs["hybrid"], "tied")
    for key in ("params", "ema"):
        for name, value in uninterrupted[key].items():
            assert torch.equal(resumed[key][name], value), (key, name)

    state = export_state_dict(source / "last.ckpt", tmp_path / "tied.pt", prefix="net.")
    for name, value in uninterrupted["params"].items():
        assert torch.equal(state[name.removeprefix("net.")], value), name
