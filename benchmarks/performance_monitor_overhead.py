"""What PerformanceMonitor costs the training loop (issue 20): step time against no callback, hook time per batch.

The MLP of shared/FACTS.md (1024-1024-1024-10), batch 64, SGD, 1 thread per process, on ``--processes`` CPU
processes (1, or 2 under ``strategy="mgpu"``'s DDP on gloo). Lightning logs every ``log_every_n_steps=50`` (its
default) to a ``CSVLogger``. Configurations:

- ``none``: no callback, the baseline of its round;
- ``monitor``: ``PerformanceMonitor()``, the defaults (FLOPs counted on the first batch, the reduction timed through
  a DDP communication hook under 2 processes);
- ``monitor_untimed_comm``: ``PerformanceMonitor(comm_timing=False)`` (2 processes only: DDP's reduction as without
  the monitor, from C++);
- ``none_again``: no callback again, the control: its ratio to ``none`` is the method's resolution here.

Each round is one fresh launch (under 2 processes, Lightning starts rank 1 and both run the same fits) that runs an
untimed fit, then every configuration twice in mirrored order (A B C D D C B A, reversed the next round). Step time is
the median period from one batch start to the next on rank 0, after ``--warmup`` steps; hook time is what the
monitor's hooks (``on_train_batch_start``, ``on_before_optimizer_step``, ``on_train_batch_end``) take per batch on the
training thread, timed with ``perf_counter_ns`` around each.

    python benchmarks/performance_monitor_overhead.py                 # 1 process, 4 rounds of 200 steps, ~2 min
    python benchmarks/performance_monitor_overhead.py --processes 2   # DDP on 2 CPU processes
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from _common import Row, add_json_out, describe_machine, mlp, ratio_row, run_worker, write_rows

RESULT_PREFIX = "PERFORMANCE_MONITOR_OVERHEAD_RESULT "
LOG_EVERY_N_STEPS = 50
PER_BATCH_HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


def configs(processes: int) -> dict[str, dict | None]:
    names: dict[str, dict | None] = {"none": None, "monitor": {}}
    if processes > 1:
        names["monitor_untimed_comm"] = {"comm_timing": False}
    names["none_again"] = None
    return names


def worker(order: list[str], args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mgpu import MultiGPUStrategy, PerformanceMonitor

    torch.set_num_threads(1)
    settings = configs(args.processes)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

    total = args.warmup + args.steps + 1
    g = torch.Generator().manual_seed(0)
    samples = total * args.batch_size * args.processes
    data = TensorDataset(torch.randn(samples, 1024, generator=g), torch.randint(0, 10, (samples,), generator=g))

    class Empty(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pass

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pass

    def fit(name: str, steps: int, root: str) -> dict:
        hook_ns: list[int] = []
        # the same timing around three empty hooks, in every configuration: what the method reads for nothing
        floor_ns: list[int] = []
        empty, floor_batch = Empty(), [0]
        for hook in PER_BATCH_HOOKS:
            setattr(empty, hook, _timed(getattr(empty, hook), floor_batch, floor_ns, hook == PER_BATCH_HOOKS[-1]))
        callbacks: list[pl.Callback] = []
        if settings[name] is not None:
            monitor = PerformanceMonitor(**settings[name])
            per_batch: list[int] = [0]
            for hook in PER_BATCH_HOOKS:
                setattr(monitor, hook, _timed(getattr(monitor, hook), per_batch, hook_ns, hook == PER_BATCH_HOOKS[-1]))
            callbacks.append(monitor)
        clock = Clock()
        torch.manual_seed(0)
        strategy = MultiGPUStrategy(mode="ddp") if args.processes > 1 else "auto"
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=args.processes,
            strategy=strategy,
            max_steps=steps,
            default_root_dir=root,
            logger=CSVLogger(root),
            log_every_n_steps=LOG_EVERY_N_STEPS,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            # the monitor first: the first Python after the step's compute pays the cache misses, as it would alone
            callbacks=[*callbacks, empty, clock],
        )
        trainer.fit(Net(), DataLoader(data, batch_size=args.batch_size))
        period = [b - a for a, b in zip(clock.starts[args.warmup :], clock.starts[args.warmup + 1 :], strict=False)]
        return {
            "period": period,
            "hook_ns": hook_ns[args.warmup :],
            "floor_ns": floor_ns[args.warmup :],
            "rank": trainer.global_rank,
        }

    with tempfile.TemporaryDirectory() as root:
        fit("monitor", args.warmup + LOG_EVERY_N_STEPS + 1, root)  # untimed: imports, first writes
        fits: dict[str, list[dict]] = {name: [] for name in order}
        for name in order:
            fits[name].append(fit(name, total, root))
    if fits[order[0]][0]["rank"] == 0:
        result = {
            name: {
                "period_ms": 1000 * statistics.median(p for run in runs for p in run["period"]),
                "hook_us": [t / 1000 for run in runs for t in run["hook_ns"]],
                "floor_us": [t / 1000 for run in runs for t in run["floor_ns"]],
            }
            for name, runs in fits.items()
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def _timed(original, per_batch: list[int], times: list[int], closes_batch: bool):
    """``original`` timed; the batch's total goes into ``times`` when its last hook (``closes_batch``) returns."""

    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        original(*args, **kwargs)
        per_batch[0] += time.perf_counter_ns() - start
        if closes_batch:
            times.append(per_batch[0])
            per_batch[0] = 0

    return timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, choices=(1, 2), default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    add_json_out(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker.split(","), args)
        return 0

    machine = describe_machine()
    names = tuple(configs(args.processes))
    compared = tuple(name for name in names if name != "none")
    monitors = tuple(name for name in names if configs(args.processes)[name] is not None)
    print(f"machine: {machine}")
    load_before = os.getloadavg()
    worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    worker_args += ["--processes", str(args.processes)]
    ratios: dict[str, list[float]] = {name: [] for name in compared}
    hooks: dict[str, list[float]] = {name: [] for name in monitors}
    floor: list[float] = []
    baseline: list[float] = []
    for round_index in range(args.rounds):
        half = names if round_index % 2 == 0 else tuple(reversed(names))
        order = (*half, *reversed(half))
        res = run_worker(__file__, [",".join(order), *worker_args], RESULT_PREFIX, timeout=1200)
        baseline.append(res["none"]["period_ms"])
        for name in compared:
            ratios[name].append(res[name]["period_ms"] / res["none"]["period_ms"])
        for name in monitors:
            hooks[name] += res[name]["hook_us"]
        floor += [t for name in names for t in res[name]["floor_us"]]
        print(
            f"round {round_index + 1}: "
            + "; ".join(f"{n} {res[n]['period_ms']:.2f} ms ({ratios[n][-1]:.3f}x)" for n in compared)
            + f"; none {res['none']['period_ms']:.2f} ms",
            flush=True,
        )
    load_after = os.getloadavg()
    print()
    print(f"- **Machine:** {machine}")
    print(
        f"- **Setup:** {args.processes} CPU process(es), 1 thread each; MLP 1024-1024-1024-10, "
        f"batch {args.batch_size}, SGD; CSVLogger, log_every_n_steps={LOG_EVERY_N_STEPS}; "
        f"no callback: {min(baseline):.2f}-{max(baseline):.2f} ms per step over {args.rounds} rounds "
        f"of {args.steps} steps"
    )
    print(
        f"- **Load average:** before {', '.join(f'{x:.2f}' for x in load_before)}; after "
        f"{', '.join(f'{x:.2f}' for x in load_after)}"
    )
    print()
    print(
        "| configuration | step-time ratio vs no callback: median of rounds (range) "
        "| hooks per batch (us): median, mean, p99 |"
    )
    print("|---|---|---|")
    print(f"| (three empty hooks, timed alike: the method's floor) | | {statistics.median(floor):.1f} |")
    for name in compared:
        times = sorted(hooks.get(name, []))
        hook = (
            f"{statistics.median(times):.1f}, {statistics.fmean(times):.1f}, {times[int(0.99 * len(times))]:.0f}"
            if times
            else ""
        )
        print(
            f"| {name} | {statistics.median(ratios[name]):.3f}x ({min(ratios[name]):.3f}-{max(ratios[name]):.3f}) "
            f"| {hook} |"
        )
    bench = f"performance_monitor_overhead_{args.processes}p"
    rows = [
        ratio_row(bench, name, "step time vs no callback", ratios[name], "lower", "no callback", "<= 1.01")
        for name in compared
    ]
    for name in monitors:
        mean = statistics.fmean(hooks[name])
        rows.append(Row(bench, name, "hooks per batch (us)", mean, None, None, "lower", "", "< 20", args.rounds))
    write_rows(args.json_out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
