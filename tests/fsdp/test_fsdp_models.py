"""FSDP for the models people bring, in one process: T5 and Llama from a config, tied units refused by name, hybrid
sharding's options, and the memory plan's hybrid row. Two processes: ``test_fsdp_models_distributed.py``; two nodes:
``test_hybrid_sharding_distributed.py``."""

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_mgpu import FSDPStrategy, MultiGPUStrategy
from lightning_mgpu.core.blocks import TiedParameterSplitError
from lightning_mgpu.fsdp.memory_plan import ModelMemory, plan_memory
from lightning_mgpu.fsdp.sharded_checkpoint import export_state_dict
from tests.helpers.trainer import QUIET


def lm_trainer(strategy=None, **kwargs) -> Trainer:
    strategy = strategy or MultiGPUStrategy(mode="fsdp")
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, **QUIET, **kwargs)


@pytest.mark.parametrize(
    ("name", "units"),
    [
        ("t5", ["net.encoder.block.0", "net.encoder.block.1", "net.decoder.block.0", "net.decoder.block.1", ""]),
        ("llama", ["net.model.layers.0", "net.model.layers.1", ""]),
    ],
)
def test_t5_and_llama_train_sharded_and_export_for_their_own_class(name, units, tmp_path):
    pytest.importorskip("transformers")
    from tests.helpers.lm_fit import LanguageModel, build

    torch.manual_seed(0)
    model = LanguageModel(name)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = lm_trainer()
    trainer.fit(model)
    assert trainer.strategy.units == units
    trained = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    assert any(not torch.equal(trained[n], initial[n]) for n in initial)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    export_state_dict(tmp_path / "last.ckpt", tmp_path / "net.pt", prefix="net.")
    net = build(name)
    net.load_state_dict(torch.load(tmp_path / "net.pt"))  # strict
    for n, param in net.named_parameters():
        assert torch.equal(param, trained[f"net.{n}"]), n


def test_shard_units_that_split_a_tied_parameter_are_refused_at_setup():
    pytest.importorskip("transformers")
    from tests.helpers.lm_fit import LanguageModel

    trainer = lm_trainer(MultiGPUStrategy(mode="fsdp", shard_units=["Embedding"]))
    with pytest.raises(
        TiedParameterSplitError,
        match=r"FSDPStrategy: shard_units=\['Embedding'\] would split the tied parameter "
        r"'net.transformer.wte.weight' \(also named 'net.lm_head.weight'\): module 'net.transformer.wte' is in the "
        r"unit 'net.transformer.wte' \(Embedding\) and module 'net.lm_head' is outside it",
    ):
        trainer.fit(LanguageModel("gpt2"))
    trainer = lm_trainer(MultiGPUStrategy(mode="fsdp", shard_units=["GPT2Block"]))  # the layers alone: fine
    trainer.fit(LanguageModel("gpt2"))
    assert trainer.strategy.units == ["net.transformer.h.0", "net.transformer.h.1", ""]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sharding": "hybrid", "shard_group_size": 0}, ValueError, r"shard_group_size must be an int >= 1 or None"),
        ({"sharding": "hybrid", "shard_group_size": 2.0}, TypeError, r"shard_group_size must be an int >= 1 or None"),
        (
            {"sharding": "full", "shard_group_size": 2},
            ValueError,
            r"shard_group_size=2 applies to sharding='hybrid' only, got sharding='full'",
        ),
        ({"sharding": "hsdp"}, ValueError, r"sharding must be one of 'full', 'grad_op', 'hybrid', got 'hsdp'"),
    ],
)
def test_bad_hybrid_options_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)
    with pytest.raises(error, match=match):
        MultiGPUStrategy(mode="ddp", **kwargs)  # checked in every mode


def test_a_shard_group_that_does_not_divide_the_processes_is_refused_at_setup():
    pytest.importorskip("transformers")
    from tests.helpers.lm_fit import LanguageModel

    trainer = lm_trainer(MultiGPUStrategy(mode="fsdp", sharding="hybrid", shard_group_size=2))
    with pytest.raises(ValueError, match=r"1 processes do not split into groups of shard_group_size=2; give a "):
        trainer.fit(LanguageModel("tied"))


def test_hybrid_sharding_on_one_node_of_one_process_trains():
    pytest.importorskip("transformers")
    from tests.helpers.lm_fit import LanguageModel

    trainer = lm_trainer(MultiGPUStrategy(mode="fsdp", sharding="hybrid"))
    trainer.fit(LanguageModel("tied"))
    assert trainer.strategy.shard_mesh.mesh_dim_names == ("replicate", "shard")
    assert tuple(trainer.strategy.shard_mesh.shape) == (1, 1)
    assert trainer.global_step == 2


MEMORY = ModelMemory(
    param_bytes=800 * 2**20,
    grad_bytes=800 * 2**20,
    optimizer_bytes=1600 * 2**20,
    buffer_bytes=0,
    largest_unit_bytes=50 * 2**20,
    activation_bytes=500 * 2**20,
    checkpointed_activation_bytes=100 * 2**20,
)


def test_the_plan_offers_hybrid_sharding_on_several_nodes_first_after_ddp():
    one_node = plan_memory(MEMORY, world_size=16, budget_mb=2500)
    assert "fsdp_hybrid" not in [row.option for row in one_node.rows]
    nodes = plan_memory(MEMORY, world_size=16, budget_mb=2500, node_size=8)
    assert [row.option for row in nodes.rows][:2] == ["ddp", "fsdp_hybrid"]
    hybrid = nodes.row("fsdp_hybrid")
    # a node's 8 processes share the 3,200 MB of state: 400 MB each, plus activations and 3 units in flight
    assert hybrid.params_mb + hybrid.grads_mb + hybrid.optimizer_mb == pytest.approx(3200 / 8)
    assert hybrid.total_mb == pytest.approx(400 + 500 + 150)
    assert nodes.chosen == "fsdp_hybrid"  # DDP needs 4,500 MB
    tight = plan_memory(MEMORY, world_size=16, budget_mb=1000, node_size=8)
    assert tight.chosen == "fsdp_full"  # 200 + 500 + 150 MB: sharded over all 16
    assert plan_memory(MEMORY, world_size=16, budget_mb=2500, node_size=1).chosen == "fsdp_grad_op"  # no hybrid
