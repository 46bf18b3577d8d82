"""The memory plan's arithmetic, its choice, its errors, and its accuracy against a real step's resident set."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mgpu.fsdp.memory_plan import (
    MIB,
    MemoryPlanError,
    ModelMemory,
    measure_activation_bytes,
    model_memory,
    optimizer_state_bytes,
    plan_memory,
    require_fit,
)

MB = int(MIB)
# P=400, G=400, O=800, A=200, Ac=50, U=50 MB: DDP 2200 MB (incl. 400 of buckets), fsdp_grad_op 1450 on 2 processes,
# fsdp_full 1150, fsdp_full_ac 1000, with offload 200 (all per device)
MEMORY = ModelMemory(400 * MB, 400 * MB, 800 * MB, 0, 50 * MB, 200 * MB, 50 * MB)


@pytest.mark.parametrize(
    ("budget", "chosen"),
    [(2500, "ddp"), (1650, "fsdp_grad_op"), (1300, "fsdp_full"), (1150, "fsdp_full_ac"), (250, "fsdp_full_ac_offload")],
)
def test_the_least_sharded_option_that_fits_is_chosen(budget, chosen):
    plan = plan_memory(MEMORY, world_size=2, budget_mb=budget)
    assert plan.chosen == chosen
    assert [row.total_mb for row in plan.rows] == pytest.approx([2200, 1450, 1150, 1000, 200])


def test_the_margin_is_kept_free():
    assert plan_memory(MEMORY, world_size=2, budget_mb=2300).chosen == "fsdp_grad_op"  # 2200 > 0.9 x 2300
    assert plan_memory(MEMORY, world_size=2, budget_mb=2300, margin=0.0).chosen == "ddp"


def test_offload_is_no_choice_on_the_host_and_nothing_fitting_names_the_smallest_need():
    plan = plan_memory(
        MEMORY, world_size=2, budget_mb=250, budget_source="free memory of cpu", cpu_offload_possible=False
    )
    assert plan.chosen is None
    with pytest.raises(
        MemoryPlanError, match=r"smallest need is 1,000 MB per device \(fsdp_full_ac, 2 processes\)"
    ) as err:
        require_fit(plan)
    assert "budget is 250 MB (free memory of cpu)" in str(err.value) and "n/a (host device)" in str(err.value)


def test_the_table_holds_every_option_and_number():
    table = plan_memory(MEMORY, world_size=2, budget_mb=1000, budget_source="memory_budget_mb").table()
    assert "budget 1,000.0 MB per device (memory_budget_mb), 900.0 MB usable with a 10% margin" in table
    assert "ddp                       400.0    400.0    800.0    200.0    400.0   2,200.0  no" in table
    assert "fsdp_full_ac              200.0    200.0    400.0     50.0    150.0   1,000.0  no" in table
    assert "fsdp_full_ac_offload        0.0      0.0      0.0     50.0    150.0     200.0  yes" in table
    assert table.endswith("chosen: fsdp_full_ac_offload")


def test_optimizer_state_bytes():
    params = [torch.zeros(10), torch.zeros(3, dtype=torch.float64)]
    assert optimizer_state_bytes(torch.optim.AdamW, params) == 2 * (40 + 24)
    assert optimizer_state_bytes(torch.optim.SGD(params, lr=0.1), params) == 0
    assert optimizer_state_bytes(torch.optim.SGD(params, lr=0.1, momentum=0.9), params) == 64
    assert optimizer_state_bytes(torch.optim.Adam(params, amsgrad=True), params) == 3 * 64
    assert optimizer_state_bytes(torch.optim.RMSprop(params, centered=True), params) == 2 * 64

    class Custom(torch.optim.Optimizer):
        pass

    assert optimizer_state_bytes(Custom, params) == 2 * 64  # unknown: assumed like Adam


def test_activations_are_the_saved_storages_and_checkpointing_keeps_block_inputs():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(3)]
    model = nn.Sequential(*blocks)
    x = torch.randn(32, 64)
    total, checkpointed = measure_activation_bytes(lambda: model(x).sum(), blocks)
    narrow, wide = 32 * 64 * 4, 32 * 256 * 4
    # saved: each block's input (for its first Linear's weight gradient) and its hidden ReLU output (shared by the
    # ReLU and the second Linear: one storage)
    assert total == 3 * narrow + 3 * wide
    # checkpointed: the three block inputs, plus one block's own saved tensors while it is recomputed
    assert checkpointed == 3 * narrow + (narrow + wide)
    # no blocks: nothing to recompute; the model's parameters (saved as transposed views) are no activations
    assert measure_activation_bytes(lambda: model(x).sum(), module=model) == (total, total)


def test_model_memory_counts_parameters_gradients_buffers_and_units():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)
    memory = model_memory(
        model, optimizer_bytes=7, activation_bytes=5, checkpointed_activation_bytes=3, blocks=[model[0]]
    )
    assert memory.param_bytes == (20 + 8 + 10) * 4
    assert memory.grad_bytes == (20 + 8 + 2) * 4
    assert memory.buffer_bytes == 4 * 4 + 4 * 4 + 8  # running mean, var, num_batches_tracked
    assert memory.largest_unit_bytes == 20 * 4


@pytest.mark.slow
def test_the_estimate_is_within_25_percent_of_a_real_steps_resident_set():
    script = Path(__file__).parents[1] / "helpers" / "memory_step.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["measured_mb"] > 500  # the ~50M-parameter model really trained
    assert abs(figures["estimate_mb"] - figures["measured_mb"]) <= 0.25 * figures["measured_mb"], figures
