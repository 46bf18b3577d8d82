"""What OOMBackoff costs: throughput after a recovery, the time the recovery itself takes, memory after 100 OOMs.

One process, the MLP of shared/FACTS.md (1024-1024-1024-10), batch 64, SGD, 1 thread. Out-of-memory errors are
injected for real (``torch.cuda.OutOfMemoryError`` with a real message) in the backward, just above the first layer,
so a failed attempt has already paid a whole forward and most of the backward: the worst case for the time lost.

Configurations, each a fresh process, alternating over rounds:

- ``recovered``: OOMBackoff; every batch above 32 samples runs out of memory, so the first batch backs off to
  micro-batches of 32 and the rest of the run trains at that size.
- ``direct``: OOMBackoff started at micro-batch size 32 (from its state), never running out of memory.
- ``stock_accumulate``: no callback, batch 32 with ``accumulate_grad_batches=2``: the same optimization in stock
  Lightning.
- ``stock``: no callback, batch 64; ``backoff_idle``: OOMBackoff, batch 64, never running out of memory (its cost
  while nothing goes wrong).

Reported: steady-state step time (median after the warm-up), ``recovered`` over ``direct`` as throughput (target at
least 0.98); the recovery's extra time: the first step of ``recovered`` minus the first step of ``direct``, in
units of a steady ``direct`` step (target at most 1, the failed batch recomputed); and in ``churn``, memory and live
tensors after 100 injected OOMs (the micro-batch size is reset before every batch so each batch fails once) against
after the first 5.

    python benchmarks/oom_backoff.py --rounds 3
"""

import argparse
import gc
import itertools
import json
import statistics
import sys
import time

from _common import describe_machine, ratio_row, run_worker, single_process_arguments, write_rows

CONFIGS = ("recovered", "direct", "stock_accumulate", "stock", "backoff_idle")
RESULT_PREFIX = "OOM_BACKOFF_RESULT "


def worker(name: str, args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mgpu import OOMBackoff
    from lightning_mgpu.core.host_memory import process_rss_mb
    from tests.helpers.oom_models import _OOMInBackward

    torch.set_num_threads(1)
    cuda = args.accelerator == "cuda"
    batch = args.batch_size
    oom_above = batch // 2 if name in ("recovered", "churn") else None

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.first = nn.Linear(1024, 1024)
            self.rest = nn.Sequential(nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            hidden = self.first(x)
            if oom_above is not None and len(x) > oom_above:
                hidden = _OOMInBackward.apply(hidden)
            return nn.functional.cross_entropy(self.rest(hidden), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not self.times:
                self.times.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    class Churn(pl.Callback):
        """Start every batch at the full size again, so that every batch runs out of memory once."""

        def __init__(self, backoff: OOMBackoff) -> None:
            self.backoff, self.samples = backoff, {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx in (5, 105):
                gc.collect()
                tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
                allocated = torch.cuda.memory_allocated() / 2**20 if cuda else 0.0
                self.samples[batch_idx] = {"rss_mb": process_rss_mb(), "tensors": tensors, "cuda_mb": allocated}
            self.backoff.micro_batch_size = None

    callbacks: list[pl.Callback] = []
    loader_batch, accumulate = batch, 1
    backoff = None
    if name in ("recovered", "direct", "backoff_idle", "churn"):
        backoff = OOMBackoff()
        if name == "direct":
            backoff.load_state_dict({"micro_batch_size": batch // 2})
        callbacks.append(backoff)
    if name == "stock_accumulate":
        loader_batch, accumulate = batch // 2, 2
    if name == "churn":
        callbacks.append(Churn(backoff))
    clock = Clock()
    steps = 106 if name == "churn" else args.steps
    g = torch.Generator().manual_seed(0)
    samples = steps * batch
    data = TensorDataset(torch.randn(samples, 1024, generator=g), torch.randint(0, 10, (samples,), generator=g))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, clock],
    )
    trainer.fit(Net(), DataLoader(data, batch_size=loader_batch))
    # one optimizer step spans `accumulate` loader batches
    ends = clock.times[::accumulate] if accumulate > 1 else clock.times
    step_times = [b - a for a, b in itertools.pairwise(ends)]
    result = {
        "config": name,
        "first_step_ms": 1000 * step_times[0],
        "step_ms": 1000 * statistics.median(step_times[args.warmup :]),
        "recoveries": backoff.recoveries if backoff else 0,
    }
    if name == "churn":
        result["memory"] = callbacks[-1].samples  # type: ignore[attr-defined]
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def main() -> None:
    args = single_process_arguments(__doc__.splitlines()[0], (*CONFIGS, "churn"), rounds=3, steps=80)
    if args.worker:
        worker(args.worker, args)
        return

    print(f"machine: {describe_machine()}")
    print(
        f"model: MLP 1024-1024-1024-10, batch {args.batch_size} (micro-batches of {args.batch_size // 2} after the"
        f" backoff), 1 process on {args.accelerator}, {args.steps} steps, median after step {args.warmup},"
        f" {args.rounds} alternating rounds"
    )
    worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    worker_args += ["--accelerator", args.accelerator]
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for round_index in range(args.rounds):
        order = CONFIGS if round_index % 2 == 0 else tuple(reversed(CONFIGS))
        for name in order:
            results[name].append(run_worker(__file__, [name, *worker_args], RESULT_PREFIX))
        line = ", ".join(f"{n} {results[n][-1]['step_ms']:.2f} ms" for n in CONFIGS)
        print(f"round {round_index + 1}: {line}")

    def ratios(a: str, b: str, key: str = "step_ms") -> list[float]:
        return [x[key] / y[key] for x, y in zip(results[a], results[b], strict=True)]

    def show(label: str, values: list[float]) -> None:
        print(f"  {label:<58} {statistics.median(values):.3f}  (range {min(values):.3f}-{max(values):.3f})")

    print("\nmedians over rounds (each ratio from one round):")
    after_recovery = [1 / r for r in ratios("recovered", "direct")]
    show("throughput recovered / direct (target >= 0.98)", after_recovery)
    lost = [
        (r["first_step_ms"] - d["first_step_ms"]) / d["step_ms"]
        for r, d in zip(results["recovered"], results["direct"], strict=True)
    ]
    show("recovery extra time, in steady direct steps (target <= 1)", lost)
    micro_batched = [1 / r for r in ratios("direct", "stock_accumulate")]
    show("throughput direct / stock_accumulate (same optimization)", micro_batched)
    idle = [1 / r for r in ratios("backoff_idle", "stock")]
    show("throughput backoff_idle / stock (no OOM, batch 64)", idle)
    print(f"  recoveries per run: recovered {[r['recoveries'] for r in results['recovered']]}")

    churn = run_worker(__file__, ["churn", *worker_args], RESULT_PREFIX)
    before, after = churn["memory"]["5"], churn["memory"]["105"]
    print(
        f"\nchurn: {churn['recoveries']} recoveries; after 5 -> after 105 batches: RSS {before['rss_mb']:.1f} ->"
        f" {after['rss_mb']:.1f} MiB, live tensors {before['tensors']} -> {after['tensors']},"
        f" CUDA allocated {before['cuda_mb']:.1f} -> {after['cuda_mb']:.1f} MiB"
    )
    # the ratios against a baseline; the recovery's extra time (in steps, target <= 1) and the churn are not ratios
    half = args.batch_size // 2
    rows = [
        ratio_row(
            "oom_backoff",
            "recovered",
            "throughput after a recovery vs started there",
            after_recovery,
            "higher",
            f"OOMBackoff started at micro-batch {half}, no OOM",
            ">= 0.98",
        ),
        ratio_row(
            "oom_backoff",
            "direct",
            f"throughput, micro-batches of {half} vs stock accumulation",
            micro_batched,
            "higher",
            f"stock, batch {half}, accumulate_grad_batches=2",
        ),
        ratio_row(
            "oom_backoff",
            "backoff_idle",
            "throughput, no OOM vs no callback",
            idle,
            "higher",
            f"stock, batch {args.batch_size}",
        ),
    ]
    write_rows(args.json_out, rows)


if __name__ == "__main__":
    sys.exit(main())
