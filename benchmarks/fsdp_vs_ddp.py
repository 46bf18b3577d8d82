"""FSDP2 (``strategy="mgpu_fsdp"``) against DDP on 2 CPU processes: step time, memory per rank, and the plan's estimate.

The model fits both ways: a stack of 8 residual MLP blocks of width 512 (about 17M parameters, 67 MB in fp32) under an
embedding and a head, trained with AdamW on synthetic tokens, batch 8 x 64 tokens per process, gloo, one thread per
process. Setups, in alternating rounds, each a fresh pair of processes launched by Lightning:

- ``ddp``: ``MultiGPUStrategy(mode="ddp")`` (DDP with torch's default buckets);
- ``fsdp``: ``MultiGPUStrategy(mode="fsdp")`` (parameters, gradients and optimizer state sharded, ZeRO-3);
- ``fsdp_grad_op``: ``MultiGPUStrategy(mode="fsdp", sharding="grad_op")`` (parameters kept gathered from forward
  to backward).

``--model tied`` ties the head's weight to the embedding's, as language models do (the pair stays with the root
unit). ``--nodes 2`` runs every setup as 2 nodes x 2 processes, one ``torchrun`` agent a node over loopback, and
replaces ``fsdp_grad_op`` by ``hybrid``: ``MultiGPUStrategy(mode="fsdp", sharding="hybrid")``, sharded within each
node and replicated across them (4 processes share this machine's 2 cores then: compare within a run only).

Step time is the mean over the steps after the first ``--warmup``, on rank 0. Memory is each rank's resident set
(``/proc/self/statm``) sampled before every optimizer step and at every batch end after the warm-up, minus the
resident set before the model was built: what training added, in one extra run per setup with glibc's
``MALLOC_MMAP_THRESHOLD_=131072``, so that a freed tensor leaves the resident set (by default glibc raises the
threshold after a large free and keeps such memory, which would hide FSDP freeing the unsharded model). The memory
plan's per-device estimate (``lightning_mgpu.fsdp.memory_plan``, activations measured on one micro-batch) is
printed next to it.

    python benchmarks/fsdp_vs_ddp.py                     # 3 rounds of 40 steps, first 5 not timed
    python benchmarks/fsdp_vs_ddp.py --rounds 1 --steps 20
    python benchmarks/fsdp_vs_ddp.py --model tied --nodes 2
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import LAUNCHER_ENV_VARS, add_json_out, describe_machine, ratio_row, run_worker, write_rows

SETUPS = {"ddp": {"mode": "ddp", "bucket_cap_mb": None}, "fsdp": {"mode": "fsdp"}}
SETUPS["fsdp_grad_op"] = {"mode": "fsdp", "sharding": "grad_op"}
SETUPS["hybrid"] = {"mode": "fsdp", "sharding": "hybrid"}
PLAN_ROWS = {"ddp": "ddp", "fsdp": "fsdp_full", "fsdp_grad_op": "fsdp_grad_op", "hybrid": "fsdp_hybrid"}
PER_NODE = 2
RESULT_PREFIX = "FSDP_VS_DDP_RESULT "
VOCAB, CONTEXT, WIDTH, DEPTH = 256, 64, 512, 8


def build_module(batch_size: int, steps: int, tied: bool = False):
    """The benchmark's LightningModule (imports torch and Lightning when called)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(WIDTH)
            self.up = nn.Linear(WIDTH, 4 * WIDTH)
            self.down = nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
            self.head = nn.Linear(WIDTH, VOCAB, bias=not tied)
            if tied:
                self.head.weight = self.embed.weight

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, VOCAB, (4 * batch_size * steps, CONTEXT + 1), generator=generator)
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)

    return Model()


def worker(name: str, args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_mgpu import MultiGPUStrategy
    from lightning_mgpu.core.host_memory import process_rss_mb

    torch.set_num_threads(1)
    torch.manual_seed(0)
    baseline = process_rss_mb()
    model = build_module(args.batch_size, args.steps, args.model == "tied")

    class Measure(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.rss: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.times.append(time.perf_counter())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step >= args.warmup:
                self.rss.append(process_rss_mb())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step > args.warmup:
                self.rss.append(process_rss_mb())

    measure = Measure()
    trainer = Trainer(
        accelerator="cpu",
        devices=PER_NODE,
        num_nodes=args.nodes,
        strategy=MultiGPUStrategy(**SETUPS[name]),
        max_steps=args.steps,
        callbacks=[measure],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    peaks = trainer.strategy.all_gather(torch.tensor(max(measure.rss) - baseline)).tolist()
    if trainer.global_rank == 0:
        steps = [b - a for a, b in zip(measure.times, measure.times[1:], strict=False)][args.warmup :]
        result = {"ms_per_step": 1000 * statistics.mean(steps), "added_rss_mb": peaks}
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def plan_estimates(args: argparse.Namespace) -> dict[str, float]:
    """The memory plan's per-device totals for the benchmark model, world size 2, activations measured here."""
    import torch

    from lightning_mgpu.core.blocks import sharding_units
    from lightning_mgpu.fsdp.memory_plan import (
        measure_activation_bytes,
        model_memory,
        optimizer_state_bytes,
        plan_memory,
    )

    torch.manual_seed(0)
    model = build_module(args.batch_size, args.steps, args.model == "tied")
    tokens, targets = next(iter(model.train_dataloader()))
    blocks = sharding_units(model)
    activations, checkpointed = measure_activation_bytes(
        lambda: model.training_step((tokens, targets), 0), blocks, model
    )
    optimizer = model.configure_optimizers()
    memory = model_memory(
        model, optimizer_state_bytes(optimizer, list(model.parameters())), activations, checkpointed, blocks
    )
    world, node_size = PER_NODE * args.nodes, PER_NODE if args.nodes > 1 else None
    plan = plan_memory(
        memory, world_size=world, budget_mb=1e9, budget_source="benchmark (no limit)", node_size=node_size
    )
    print(plan.table())
    offered = {row.option for row in plan.rows}
    return {setup: plan.row(option).total_mb for setup, option in PLAN_ROWS.items() if option in offered}


def run_nodes(worker_args: list[str], nodes: int, result_prefix: str, timeout: float = 900) -> dict:
    """Run this script's worker as ``nodes`` nodes of 2 processes: one torchrun agent a node, over loopback."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # torch 2.13: pytorch/pytorch#135712
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--node-rank={node}",
                f"--nproc-per-node={PER_NODE}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                __file__,
                "--worker",
                *worker_args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(nodes)
    ]
    outputs = [agent.communicate(timeout=timeout) for agent in agents]
    for stdout, _ in outputs:
        for line in stdout.splitlines():
            if line.startswith(result_prefix):
                return json.loads(line[len(result_prefix) :])
    raise RuntimeError(f"{worker_args[0]} produced no result:\n{outputs[0][1][-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(SETUPS), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="first steps not timed or sampled")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", choices=("mlp", "tied"), default="mlp", help="tied: the head reuses the embedding")
    parser.add_argument("--nodes", type=int, default=1, help="2: each setup as 2 nodes x 2 processes (torchrun)")
    add_json_out(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = ["ddp", "fsdp", "hybrid"] if args.nodes > 1 else ["ddp", "fsdp", "fsdp_grad_op"]
    print(f"machine: {describe_machine()}")
    print(
        f"model: {DEPTH} residual MLP blocks of width {WIDTH}, vocab {VOCAB}, head {args.model}, batch "
        f"{args.batch_size}x{CONTEXT} tokens/process, AdamW, {args.nodes} node(s) x {PER_NODE} processes (gloo, 1 "
        f"thread each), {args.steps} steps, first {args.warmup} not timed, {args.rounds} alternating rounds"
    )
    estimates = plan_estimates(args)
    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    extra += ["--model", args.model, "--nodes", str(args.nodes)]

    def run(worker_args: list[str]) -> dict:
        if args.nodes > 1:
            return run_nodes(worker_args, args.nodes, RESULT_PREFIX)
        return run_worker(__file__, worker_args, RESULT_PREFIX)

    results = []
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else list(reversed(names))
        measured = {name: run([name, *extra]) for name in order}
        results.append(measured)
        print(f"round {round_index + 1}: " + ", ".join(f"{n} {measured[n]['ms_per_step']:.1f} ms/step" for n in names))
    # memory in runs of their own: glibc raises its mmap threshold after freeing a large block and keeps such memory
    # resident; a fixed threshold returns a freed tensor's memory at once, so the resident set follows what is alive
    # (and FSDP freeing the unsharded model shows), at a cost in speed that these runs do not report
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    memory = {name: max(run([name, *extra])["added_rss_mb"]) for name in names}
    del os.environ["MALLOC_MMAP_THRESHOLD_"]
    print("memory runs: " + ", ".join(f"{n} +{memory[n]:.0f} MB/rank" for n in names))
    print(f"\n{'setup':<14}{'ms/step':>10}{'vs ddp':>9}{'added MB/rank (max over ranks)':>34}{'plan estimate MB':>18}")
    for name in names:
        step = statistics.median(r[name]["ms_per_step"] for r in results)
        ratio = statistics.median(r[name]["ms_per_step"] / r["ddp"]["ms_per_step"] for r in results)
        print(f"{name:<14}{step:>10.1f}{ratio:>9.3f}{memory[name]:>34.0f}{estimates.get(name, float('nan')):>18.0f}")
    rows = [
        ratio_row(
            "fsdp_vs_ddp",
            name if (args.model, args.nodes) == ("mlp", 1) else f"{name}_{args.model}_{args.nodes}x{PER_NODE}",
            "step time vs DDP (lower is faster)",
            [r[name]["ms_per_step"] / r["ddp"]["ms_per_step"] for r in results],
            "lower",
            'MultiGPUStrategy(mode="ddp")',
        )
        for name in names
        if name != "ddp"
    ]
    rows += [
        ratio_row(
            "fsdp_vs_ddp",
            name if (args.model, args.nodes) == ("mlp", 1) else f"{name}_{args.model}_{args.nodes}x{PER_NODE}",
            "memory added per rank vs DDP (lower is smaller)",
            [memory[name] / memory["ddp"]],
            "lower",
            'MultiGPUStrategy(mode="ddp")',
        )
        for name in names
        if name != "ddp"
    ]
    write_rows(args.json_out, rows)


if __name__ == "__main__":
    main()
