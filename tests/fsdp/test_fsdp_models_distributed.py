"""The models people bring under ``mgpu_fsdp`` on 2 gloo processes: Hugging Face GPT-2 and BERT (from a config, no
download) and a plain-torch LM, all three with their output head tied to the input embedding, plus an ``EMA``.

Each run is ``tests/helpers/lm_fit.py`` (8 AdamW steps of each model in turn, both ranks started at once, as torchrun
would); the reference is stock Lightning's ``strategy="ddp"`` on the same data.
"""

from pathlib import Path

import pytest
import torch

from lightning_mgpu.fsdp.sharded_checkpoint import export_state_dict
from tests.helpers.processes import REPO, run_script

pytest.importorskip("transformers")

SCRIPT = Path(REPO) / "tests" / "helpers" / "lm_fit.py"
MODELS = ("gpt2", "bert", "tied")
UNITS = {
    "gpt2": ["net.transformer.h.0", "net.transformer.h.1", ""],
    "bert": ["net.bert.encoder.layer.0", "net.bert.encoder.layer.1", ""],
    "tied": ["net.layers.0", "net.layers.1", "net.layers.2", ""],
}


def fit(out: Path, *args: object, expect_ok: bool = True) -> dict:
    result = run_script(SCRIPT, "--out", out, *args, timeout=240, ranks=2)
    assert not result["hung"], result["output"][-3000:]
    if expect_ok:
        assert result["rc"] == 0, result["output"][-3000:]
    return result


def record(out: Path, model: str) -> dict:
    return torch.load(out / model / "result.pt", weights_only=False)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    outs = {"fsdp": tmp_path_factory.mktemp("fsdp"), "ddp": tmp_path_factory.mktemp("ddp")}
    outs["log"] = fit(outs["fsdp"], "--models", *MODELS)["output"]
    fit(outs["ddp"], "--models", *MODELS, "--strategy", "ddp")
    return outs


def initial_parameters(model: str) -> dict[str, torch.Tensor]:
    from tests.helpers.lm_fit import LanguageModel

    torch.manual_seed(0)
    return {name: param.detach().clone() for name, param in LanguageModel(model).named_parameters()}


@pytest.mark.parametrize("model", MODELS)
def test_a_tied_model_trains_sharded_like_stock_ddp_with_at_most_0_6_of_its_elements_per_rank(runs, model):
    sharded, reference = record(runs["fsdp"], model), record(runs["ddp"], model)
    assert sharded["strategy"] == "FSDPStrategy" and reference["strategy"] == "DDPStrategy"
    assert sharded["global_step"] == reference["global_step"] == 8
    assert max_difference(sharded["params"], reference["params"]) <= 1e-5
    assert max_difference(sharded["params"], initial_parameters(model)) > 1e-2  # the 8 steps did train
    # the layers are the units; the embedding and the head that shares its weight stay with the root
    assert sharded["units"] == UNITS[model]
    for rank in sharded["ranks"]:
        assert rank["local"] <= 0.6 * sharded["total_numel"]
    assert all(rank["local"] == reference["total_numel"] for rank in reference["ranks"])  # DDP: a whole copy


@pytest.mark.parametrize("model", MODELS)
def test_the_average_of_sharded_weights_equals_ddps_and_its_step_issues_no_collective(runs, model):
    sharded, reference = record(runs["fsdp"], model), record(runs["ddp"], model)
    assert sharded["ema"].keys() >= sharded["params"].keys()  # the tied weight under both names
    assert max_difference(sharded["ema"], reference["ema"]) <= 1e-6
    assert sharded["ema_updates"] == 8
    assert max_difference({n: sharded["ema"][n] for n in sharded["params"]}, sharded["params"]) > 1e-3  # an average
    # counted on every rank while EMA's per-step hook ran, plus the one barrier that shows the counter counts
    assert [rank["calls"] for rank in sharded["ranks"]] == [{"barrier": 1}, {"barrier": 1}]
    assert [rank["dispatched"] for rank in sharded["ranks"]] == [0, 0]  # none below Python either (CommDebugMode)


@pytest.mark.timeout(400)
def test_a_killed_rank_resumes_bit_for_bit_with_its_average(runs, tmp_path):
    # each run kills rank 1 at step 6 of the first model that starts afresh, after resuming the one killed before
    # from its step-4 checkpoint: gpt2 killed; gpt2 resumed, bert killed; bert resumed, tied killed; tied resumed
    for finished in ([], ["gpt2"], ["gpt2", "bert"]):
        result = fit(tmp_path, "--models", *MODELS, "--kill", 1, 6, "--resume", expect_ok=False)
        assert result["rc"] != 0
        assert [model for model in MODELS if (tmp_path / model / "result.pt").exists()] == finished
    fit(tmp_path, "--models", *MODELS, "--kill", 1, 6, "--resume")
    for model in MODELS:
        resumed, uninterrupted = record(tmp_path, model), record(runs["fsdp"], model)
        assert resumed["global_step"] == 8
        for name, value in uninterrupted["params"].items():
            assert torch.equal(resumed["params"][name], value), (model, name)
        for name, value in uninterrupted["ema"].items():
            assert torch.equal(resumed["ema"][name], value), (model, name)


def test_export_loads_strictly_into_the_hugging_face_class_with_or_without_the_average(runs, tmp_path):
    from tests.helpers.lm_fit import build

    sharded = record(runs["fsdp"], "gpt2")
    checkpoint = runs["fsdp"] / "gpt2" / "ckpt" / "last.ckpt"  # step 8: the end of the fit
    for ema, expected in ((False, sharded["params"]), (True, sharded["ema"])):
        export_state_dict(checkpoint, tmp_path / "gpt2.pt", prefix="net.", ema=ema)
        net = build("gpt2")
        net.load_state_dict(torch.load(tmp_path / "gpt2.pt"))  # strict
        assert net.lm_head.weight is net.transformer.wte.weight  # still tied after loading
        for name, param in net.named_parameters():
            assert torch.equal(param, expected[f"net.{name}"]), (ema, name)
