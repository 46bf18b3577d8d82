"""One real CPU training step of a ~50M-parameter block model in a fresh process: the plan's estimate and the RSS.

Prints one JSON line: the single-process estimate (parameters, gradients, AdamW state, activations of the measured
micro-batch) and the peak resident-set growth (VmHWM) from before the model was built to after the optimizer step.

    python tests/helpers/memory_step.py
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from lightning_mgpu.core.blocks import find_repeated_blocks
from lightning_mgpu.fsdp.memory_plan import (
    measure_activation_bytes,
    model_memory,
    optimizer_state_bytes,
    plan_memory,
)
from tests.helpers.tiny_transformer import TinyTransformer


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokens = torch.randint(0, 32, (8, 8))
    targets = torch.randint(0, 32, (8, 8))
    baseline = peak_rss_mb()
    model = TinyTransformer(depth=6, dim=1024)
    model.log = lambda *args, **kwargs: None  # no Trainer here
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    blocks = find_repeated_blocks(model)
    activations, checkpointed = measure_activation_bytes(
        lambda: model.training_step((tokens, targets), 0), blocks, model
    )
    memory = model_memory(model, optimizer_state_bytes(optimizer, list(model.parameters())), activations, checkpointed)
    row = plan_memory(memory, world_size=1, budget_mb=1e9).row("ddp")
    loss = model.training_step((tokens, targets), 0)
    loss.backward()
    optimizer.step()
    measured = peak_rss_mb() - baseline
    # one process has no DDP gradient buckets: the estimate without the working memory
    print(json.dumps({"estimate_mb": row.total_mb - row.working_mb, "measured_mb": measured}))


if __name__ == "__main__":
    main()
