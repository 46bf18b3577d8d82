"""FSDP2 sharding of an unmodified module (``strategy="mgpu_fsdp"``) on 2 gloo processes, against a DDP reference.

Each fit runs ``tests/helpers/sharded_fit.py`` as a user's script (Lightning re-runs it for rank 1); rank 0 writes
the full parameters gathered from the shards. The runs are shared by the tests of this module.
"""

from pathlib import Path

import pytest
import torch

from lightning_mgpu.fsdp.sharded_checkpoint import export_state_dict
from tests.helpers.processes import run_recorded_script, run_script
from tests.helpers.tiny_transformer import PlainTransformer, TinyTransformer

SCRIPT = Path(__file__).parents[1] / "helpers" / "sharded_fit.py"


def fit(out: Path, *args: object) -> dict:
    return run_recorded_script(SCRIPT, out, *args, ranks=2)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cache: dict = {}

    def get(name: str, *args: object) -> dict:
        if name not in cache:
            cache[name] = fit(tmp_path_factory.mktemp(name), *args)
        return cache[name]

    return get


def test_fsdp_trains_like_ddp_with_half_the_parameters_per_rank(runs):
    sharded = runs("fsdp20", "--steps", 20)
    reference = runs("ddp20", "--strategy", "ddp", "--steps", 20)
    assert sharded["strategy"] == "FSDPStrategy" and reference["strategy"] == "MultiGPUStrategy"
    assert sharded["global_step"] == reference["global_step"] == 20
    assert max_difference(sharded["params"], reference["params"]) <= 1e-6
    torch.manual_seed(0)
    initial = {name: param.detach() for name, param in TinyTransformer().named_parameters()}
    assert max_difference(sharded["params"], initial) > 1e-2  # the 20 steps did train
    # each rank holds half of every parameter (sizes here are even), DDP a full copy
    assert sharded["local_numel"] == [sharded["total_numel"] // 2] * 2
    assert reference["local_numel"] == [reference["total_numel"]] * 2
    assert sharded["units"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", ""]
    assert "in 5 units: blocks.0, blocks.1, blocks.2, blocks.3, <root>" in sharded["output"]


def test_sharded_checkpoint_resumes_exactly_and_exports_for_a_plain_module(runs, tmp_path):
    first = fit(tmp_path / "first", "--steps", 10, "--save-at", 10)
    (checkpoint,) = (tmp_path / "first" / "ckpt").iterdir()
    # a folder of per-rank shards: nothing was gathered on one rank
    assert checkpoint.is_dir() and sorted(p.name for p in checkpoint.glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    resumed = fit(tmp_path / "resumed", "--steps", 20, "--resume", checkpoint)
    assert resumed["global_step"] == 20
    assert max_difference(resumed["params"], runs("fsdp20", "--steps", 20)["params"]) == 0.0

    state = export_state_dict(checkpoint, tmp_path / "model.pt")
    net = PlainTransformer()
    net.load_state_dict(torch.load(tmp_path / "model.pt"))
    assert max_difference(dict(net.named_parameters()), first["params"]) == 0.0
    assert state.keys() == first["params"].keys()


def test_a_nan_in_one_ranks_shard_is_skipped_on_both_ranks(runs):
    # the NaN is in one element of rank 1's gradient shard only; a NaN loss on rank 1 poisons every gradient
    shard = runs("nan_shard", "--steps", 12, "--nan-shard", 1, 5)
    loss = runs("nan_loss", "--steps", 12, "--nan-at", 1, 5)
    assert shard["skipped"] == loss["skipped"] == [1, 1]
    assert max_difference(shard["params"], loss["params"]) == 0.0
    assert all(torch.isfinite(p).all() for p in shard["params"].values())


def test_norm_clipping_under_fsdp_equals_ddp(runs):
    sharded = runs("clip_fsdp", "--steps", 12, "--clip", 0.05)
    reference = runs("clip_ddp", "--strategy", "ddp", "--steps", 12, "--clip", 0.05)
    unclipped = runs("fsdp12", "--steps", 12)  # the same fit without the clip, and nothing else changed
    assert max_difference(sharded["params"], reference["params"]) <= 1e-6
    assert max_difference(sharded["params"], unclipped["params"]) > 1e-3  # the clip did act


def test_activation_checkpointing_recomputes_dropout_exactly(runs):
    sharded = runs("ac_fsdp", "--steps", 12, "--activation-checkpointing", "--dropout", 0.1)
    ddp_ac = runs("ac_ddp", "--strategy", "ddp", "--steps", 12, "--activation-checkpointing", "--dropout", 0.1)
    reference = runs("dropout_ddp", "--strategy", "ddp", "--steps", 12, "--dropout", 0.1)
    assert sharded["checkpointed"] == ddp_ac["checkpointed"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert max_difference(sharded["params"], reference["params"]) <= 1e-6
    assert max_difference(ddp_ac["params"], reference["params"]) <= 1e-6


def test_memory_budget_keeps_ddp_when_it_fits(runs):
    record = runs("auto_large", "--strategy", "auto", "--budget", 1000, "--steps", 20)
    assert record["strategy"] == "MultiGPUStrategy" and record["plan"].chosen == "ddp"
    assert record["choice"].mode == "ddp"
    assert max_difference(record["params"], runs("ddp20", "--strategy", "ddp", "--steps", 20)["params"]) <= 1e-6


def test_memory_budget_shards_when_only_the_sharded_setup_fits(runs):
    plan = runs("auto_large", "--strategy", "auto", "--budget", 1000, "--steps", 20)["plan"]
    ddp, grad_op = plan.row("ddp").total_mb, plan.row("fsdp_grad_op").total_mb
    budget = 0.99 * ddp / (1 - plan.margin)  # DDP misses by 1%, the sharded setup fits
    assert grad_op < 0.99 * ddp
    record = runs("auto_small", "--strategy", "auto", "--budget", budget, "--steps", 20)
    assert record["strategy"] == "FSDPStrategy" and record["plan"].chosen == "fsdp_grad_op"
    assert "the memory plan chose 'fsdp_grad_op'" in record["choice"].reason
    assert record["local_numel"] == [record["total_numel"] // 2] * 2  # resharded after validation too
    assert max_difference(record["params"], runs("fsdp20", "--steps", 20)["params"]) <= 1e-6
    assert "chosen: fsdp_grad_op" in record["output"]


def test_memory_budget_that_nothing_fits_stops_every_rank_with_the_smallest_need(tmp_path):
    result = run_script(SCRIPT, "--out", tmp_path, "--strategy", "auto", "--budget", 0.001, timeout=150, ranks=2)
    assert not result["hung"] and result["rc"] != 0
    assert result["output"].count("MemoryPlanError: no way to train this model fits: the smallest need is") == 2
    assert "fsdp_full_ac" in result["output"] and "a larger memory_budget_mb" in result["output"]


def test_a_callback_that_cannot_run_sharded_stops_when_the_plan_switches_to_fsdp(runs, tmp_path):
    plan = runs("auto_large", "--strategy", "auto", "--budget", 1000, "--steps", 20)["plan"]
    budget = 0.99 * plan.row("ddp").total_mb / (1 - plan.margin)
    # OOMBackoff's setup saw a DDP strategy; the plan switched to FSDP after it, and fit start refuses
    result = run_script(
        SCRIPT, "--out", tmp_path, "--strategy", "auto", "--budget", budget, "--oom-backoff", timeout=150, ranks=2
    )
    assert not result["hung"] and result["rc"] != 0
    assert result["output"].count("OOMBackoff does not run under FSDPStrategy") == 2


def test_a_run_the_plan_sharded_resumes_from_its_sharded_checkpoint(runs, tmp_path):
    plan = runs("auto_large", "--strategy", "auto", "--budget", 1000, "--steps", 20)["plan"]
    budget = 0.99 * plan.row("ddp").total_mb / (1 - plan.margin)
    fit(tmp_path / "first", "--strategy", "auto", "--budget", budget, "--steps", 10, "--save-at", 10)
    (checkpoint,) = (tmp_path / "first" / "ckpt").iterdir()
    assert checkpoint.is_dir()
    resumed = fit(tmp_path / "resumed", "--strategy", "auto", "--budget", budget, "--steps", 20, "--resume", checkpoint)
    assert resumed["strategy"] == "FSDPStrategy" and resumed["global_step"] == 20
    assert max_difference(resumed["params"], runs("fsdp20", "--steps", 20)["params"]) <= 1e-6
    # a budget that keeps DDP cannot read the shards: every rank says so instead of training from scratch
    refused = run_script(SCRIPT, "--out", tmp_path / "refused", "--strategy", "auto", "--budget", 1000, "--resume",
                         checkpoint, timeout=150, ranks=2)  # fmt: skip
    assert not refused["hung"] and refused["rc"] != 0
    assert refused["output"].count("is sharded (a folder of FSDP shards), but the memory plan chose DDP") == 2


def test_a_nan_step_is_skipped_on_the_device_with_the_optimizer_on_its_fused_kernel(runs):
    # AdamW(foreach=False) steps through its fused kernel with found_inf, on the sharded parameters
    on_device = runs("nan_shard_on_device", "--steps", 12, "--nan-shard", 1, 5, "--skip-on-device")
    host_read = runs("nan_shard", "--steps", 12, "--nan-shard", 1, 5)
    assert on_device["skipped"] == [1, 1]
    assert "optimizer 0 (AdamW) steps through its fused kernel" in on_device["output"]
    assert max_difference(on_device["params"], host_read["params"]) <= 1e-6  # the two kernels round differently
