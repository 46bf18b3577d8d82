"""What GPUMemoryMonitor costs the training loop (issue 5): step time, hook time per batch, sampler cost, one run.

One process, 1 thread, the MLP of shared/FACTS.md (1024-1024-1024-10), batch 64, SGD: a step takes about 10 ms on
the project's CPU machine. The model logs its loss every step to a ``CSVLogger``, which Lightning writes every
``log_every_n_steps=50`` (its default), so the monitor's rows go to a real logger on the same steps. No progress bar,
checkpointing or model summary. Four configurations:

- ``none``: no callback, the baseline of its round;
- ``monitor_2hz``: ``GPUMemoryMonitor()``, the defaults (2 samples a second, CSV timeline, plot at the end);
- ``monitor_10hz``: ``GPUMemoryMonitor(sample_hz=10)``;
- ``none_again``: no callback again, the control: its ratio to ``none`` is what this method reads when there is
  nothing to find, the resolution of the step-time ratios on this machine.

Each round is a fresh process (``OMP_NUM_THREADS=1``) that runs one untimed fit with the monitor (imports, first
CSV writes and the first plot happen there), then eight fits back to back: A B C D D C B A, and D C B A A B C D in
the next round. A configuration's figure in a round pools its two fits. On these shared 2-core machines step time
drifts by 5-10% over seconds and later fits in a process tend to run faster; the mirrored order weighs that on all
four alike, and fits close together in time see the same machine.

What each fit measures:

1. **Step time.** A timing callback, last in the callback list so that the monitor's ``on_train_batch_end`` runs
   inside its window, reads ``perf_counter`` in ``on_train_batch_start`` and ``on_train_batch_end``. "Batch" is one
   batch's start to its end; "period" is one batch start to the next, so the data fetch, Lightning's own logging and
   whatever the sampling thread takes from the training thread count too. Medians over the steps after
   ``--warmup`` of both fits (so a logging step every 50 barely moves them; the mean period does see it); each ratio
   is against ``none`` in the same round.
2. **Hook time on the training thread.** Every hook ``GPUMemoryMonitor`` overrides (``on_*``, not
   ``setup``/``teardown``) is replaced on the instance by a wrapper that times the original with ``perf_counter_ns``.
   Per batch, that is the time in ``on_train_batch_end``, over every batch of every fit (warm-up included), and
   split into the steps Lightning logs on (``should_update_logs``) and the rest. The same wrapper around an empty
   hook, present in every configuration, shows what the wrapper itself reads.
3. **The sampler.** ``MemorySampler.sample`` is wrapped to count samples and time each: wall time
   (``perf_counter_ns``, which includes waiting for the GIL) and the calling thread's CPU time (``thread_time_ns``).
   The sampling thread competes with the training thread for the GIL, and on 2 cores for a core. The last row turns
   these timings into the step-time ratio they imply, a bound far finer than the measured ratio can resolve here.

The wrappers add well under a microsecond per batch, far below what the step-time ratio can resolve.

    python benchmarks/memory_monitor_overhead.py                    # 5 rounds of 8 fits of 300 steps, about 3 minutes
    python benchmarks/memory_monitor_overhead.py --rounds 3 --steps 200
    python benchmarks/memory_monitor_overhead.py --device cuda --batch-size 512   # skipped without a GPU

Each round is ``python benchmarks/memory_monitor_overhead.py --worker none,monitor_2hz,...`` (that round's order).
"""

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time

from _common import Row, add_json_out, describe_machine, mlp, ratio_row, run_worker, write_rows

CONFIGS = {
    # name: GPUMemoryMonitor keyword arguments; None for no callback
    "none": None,
    "monitor_2hz": {},
    "monitor_10hz": {"sample_hz": 10.0},
    "none_again": None,  # the control: what the method reads between two identical configurations
}
MONITORS = tuple(name for name, kwargs in CONFIGS.items() if kwargs is not None)
COMPARED = tuple(name for name in CONFIGS if name != "none")
RESULT_PREFIX = "MEMORY_MONITOR_OVERHEAD_RESULT "
LOG_EVERY_N_STEPS = 50  # Lightning's default


def worker(order: list[str], args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mgpu.memory.gpu_memory_monitor import GPUMemoryMonitor
    from lightning_mgpu.memory.memory_sampler import MemorySampler

    torch.set_num_threads(1)
    cuda = args.device == "cuda"

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
            self.ends: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()  # the benchmark's own clock, not the callback under test
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    # (taken on the main thread?, wall ns, that thread's CPU ns) of every sample of the current fit
    samples: list[tuple[bool, int, int]] = []
    original_sample = MemorySampler.sample

    def timed_sample(self):
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        result = original_sample(self)
        cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
        samples.append((threading.current_thread() is threading.main_thread(), wall, cpu))
        return result

    MemorySampler.sample = timed_sample

    total_steps = args.warmup + args.steps + 1  # one more batch start closes the last timed period
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(total_steps * args.batch_size, 1024, generator=g),
        torch.randint(0, 10, (total_steps * args.batch_size,), generator=g),
    )

    def fit(name: str, steps: int) -> dict:
        samples.clear()
        hook_ns: dict[str, list[int]] = {}
        logging_step: list[bool] = []
        callbacks: list[pl.Callback] = []
        if CONFIGS[name] is not None:
            monitor = GPUMemoryMonitor(**CONFIGS[name])
            overridden = sorted(
                hook
                for hook in vars(pl.Callback)
                if hook.startswith("on_") and getattr(type(monitor), hook) is not getattr(pl.Callback, hook)
            )
            for hook in overridden:
                hook_ns[hook] = []
                setattr(monitor, hook, _timed_hook(hook, getattr(monitor, hook), hook_ns[hook], logging_step))
            callbacks.append(monitor)
        # the same wrapper around an empty hook, in every configuration: the floor of what the wrapper can read
        floor_ns: list[int] = []
        empty = pl.Callback()
        empty.on_train_batch_end = _timed_hook("on_train_batch_end", empty.on_train_batch_end, floor_ns, [])
        clock = Clock()
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(
                accelerator=args.device,
                devices=1,
                max_steps=steps,
                default_root_dir=root,
                logger=CSVLogger(root),
                log_every_n_steps=LOG_EVERY_N_STEPS,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[empty, *callbacks, clock],
            )
            trainer.fit(Net(), DataLoader(data, batch_size=args.batch_size))
        w = args.warmup
        batch = [end - start for start, end in zip(clock.starts[w:], clock.ends[w:], strict=False)][: args.steps]
        period = [b - a for a, b in zip(clock.starts[w:], clock.starts[w + 1 :], strict=False)]
        return {
            "batch": batch,
            "period": period,
            "train_s": clock.ends[-1] - clock.starts[0],
            "hook_ns": hook_ns,
            "floor_ns": floor_ns,
            "logging_step": logging_step,
            "samples": list(samples),
        }

    # an untimed fit with the monitor first: imports, first CSV writes and the first plot happen there
    fit(MONITORS[0], args.warmup + LOG_EVERY_N_STEPS + 1)
    fits: dict[str, list[dict]] = {name: [] for name in order}
    for name in order:
        fits[name].append(fit(name, total_steps))
    print(RESULT_PREFIX + json.dumps({name: _merge(runs) for name, runs in fits.items()}), flush=True)


def _merge(fits: list[dict]) -> dict:
    """One configuration's fits in a round, as one: medians over all their timed steps, everything else pooled."""
    batch = [t for fit in fits for t in fit["batch"]]
    period = [t for fit in fits for t in fit["period"]]
    return {
        "fits": len(fits),
        "batch_ms": 1000 * statistics.median(batch),
        "period_ms": 1000 * statistics.median(period),
        "period_mean_ms": 1000 * statistics.fmean(period),
        "train_s": sum(fit["train_s"] for fit in fits),
        "hook_ns": {hook: [t for fit in fits for t in fit["hook_ns"][hook]] for hook in fits[0]["hook_ns"]},
        "floor_ns": [t for fit in fits for t in fit["floor_ns"]],
        "logging_step": [flag for fit in fits for flag in fit["logging_step"]],
        "samples": [sample for fit in fits for sample in fit["samples"]],
    }


def _timed_hook(hook: str, original, times: list[int], logging_step: list[bool]):
    """``original`` timed into ``times``; for ``on_train_batch_end`` also whether Lightning logs on this step."""
    per_batch = hook == "on_train_batch_end"

    def timed(trainer, *args, **kwargs):
        if per_batch:
            # read before the clock starts: the monitor asks the same question inside the timed call
            logging_step.append(trainer._logger_connector.should_update_logs)
        start = time.perf_counter_ns()
        original(trainer, *args, **kwargs)
        times.append(time.perf_counter_ns() - start)

    return timed


def _p(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}x ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per fit, after the warm-up steps")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps at the start of every fit")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_json_out(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker.split(","), args)
        return 0

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("skipped: --device cuda, but torch sees no CUDA device here")
            return 0
    machine = describe_machine()
    print(f"machine: {machine}")
    print(
        f"model: MLP 1024-1024-1024-10, batch {args.batch_size}, SGD, 1 process on {args.device}, 1 thread; "
        f"CSVLogger, log_every_n_steps={LOG_EVERY_N_STEPS}; {args.steps} timed steps after {args.warmup}, "
        f"{args.rounds} rounds of {2 * len(CONFIGS)} fits in mirrored order"
    )
    load_before = os.getloadavg()
    worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    worker_args += ["--device", args.device]
    names = tuple(CONFIGS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    ratios: dict[str, dict[str, list[float]]] = {
        figure: {m: [] for m in COMPARED} for figure in ("batch_ms", "period_ms", "period_mean_ms")
    }
    for round_index in range(args.rounds):
        # A B C D D C B A, then D C B A A B C D: a drift within the process, or a faster later fit, weighs on all
        # alike
        half = names if round_index % 2 == 0 else tuple(reversed(names))
        order = (*half, *reversed(half))
        res = run_worker(__file__, [",".join(order), *worker_args], RESULT_PREFIX)
        for name in names:
            runs[name].append(res[name])
        for figure, by_monitor in ratios.items():
            for m in COMPARED:
                by_monitor[m].append(res[m][figure] / res["none"][figure])
        print(
            f"round {round_index + 1} ({' '.join(order)}): "
            + "; ".join(
                f"{n} batch {res[n]['batch_ms']:.2f} ms ({res[n]['batch_ms'] / res['none']['batch_ms']:.3f}x), "
                f"period {res[n]['period_ms']:.2f} ms ({res[n]['period_ms'] / res['none']['period_ms']:.3f}x)"
                for n in names
            ),
            flush=True,
        )
    load_after = os.getloadavg()

    baseline_ms = [run["batch_ms"] for run in runs["none"]]
    columns = {m: _monitor_figures(runs[m], statistics.median(run["period_ms"] for run in runs[m])) for m in MONITORS}
    rows = [
        ("step-time ratio, batch start to end: median of rounds (range)", "batch_ms", "<= 1.005"),
        ("step-time ratio, batch start to next batch start", "period_ms", ""),
        ("mean step-period ratio (logging steps and sampler ticks weigh in)", "period_mean_ms", ""),
    ]
    print()
    print(f"- **Machine:** {machine}")
    print(
        f"- **Setup:** 1 process on {args.device}, 1 thread; MLP 1024-1024-1024-10, batch {args.batch_size}, SGD; "
        f"CSVLogger, log_every_n_steps={LOG_EVERY_N_STEPS}; no callback: {min(baseline_ms):.2f}-"
        f"{max(baseline_ms):.2f} ms per batch over the rounds"
    )
    print(
        f"- **Measure:** {args.rounds} rounds, each one process running {2 * len(names)} fits back to back "
        f"(A B C D D C B A, then D C B A A B C D) after an untimed one; {args.steps} timed steps per fit after "
        f"{args.warmup}; ratios against no callback in the same round"
    )
    print(
        f"- **Load average** (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load_before)}; after "
        f"{', '.join(f'{x:.2f}' for x in load_after)}"
    )
    print()
    print(
        "| figure | `GPUMemoryMonitor()` (2 Hz) | `GPUMemoryMonitor(sample_hz=10)` | control: no callback again "
        "| target |"
    )
    print("|---|---|---|---|---|")
    for label, figure, target in rows:
        print(f"| {label} | {' | '.join(_ratio(ratios[figure][m]) for m in COMPARED)} | {target} |")
    for key, (label, target) in FIGURE_LABELS.items():
        print(f"| {label} | {' | '.join(columns[m][key] for m in MONITORS)} | | {target} |")

    bench = "memory_monitor_overhead"
    rows = [
        ratio_row(
            bench,
            m,
            "step time (batch start to end) vs no callback",
            ratios["batch_ms"][m],
            "lower",
            "no callback",
            "<= 1.005" if m in MONITORS else None,
        )
        for m in COMPARED
    ]
    for m in MONITORS:  # the estimate as printed: one figure over all rounds, no range
        estimate = float(columns[m]["estimate"].rstrip("x"))
        metric = "step time estimated from hook + sampler timings vs no callback"
        rows.append(Row(bench, m, metric, estimate, None, None, "lower", "no callback", "<= 1.005", args.rounds))
    write_rows(args.json_out, rows)
    return 0


FIGURE_LABELS = {
    "hook_mean": ("monitor hooks per batch, mean (us), all batches", "< 20"),
    "floor": ("the timing wrapper around an empty hook, mean (us)", ""),
    "hook_p99": ("monitor hooks per batch, p99 (us)", ""),
    "hook_max": ("monitor hooks per batch, max (us)", ""),
    "hook_quiet": ("per batch on non-logging steps, mean (us)", ""),
    "hook_logged": (f"per batch on logging steps (every {LOG_EVERY_N_STEPS}th), mean (us)", ""),
    "once": ("once-per-fit hooks, mean per call (us)", ""),
    "samples": ("samples per fit", ""),
    "sample_wall": ("sampler thread, wall time per sample, mean (p99) (us)", ""),
    "sample_cpu": ("sampler thread, its own CPU time per sample, mean (us)", ""),
    "sample_main": ("samples on the training thread (at setup and teardown), wall mean (us)", ""),
    "estimate": ("estimated ratio from these timings: 1 + (hooks + sampler CPU per step) / step", "<= 1.005"),
}


def _monitor_figures(runs: list[dict], period_ms: float) -> dict[str, str]:
    """The table's cells for one monitor configuration, over all its fits; ``period_ms`` is its median step."""
    per_batch = [t / 1000 for run in runs for t in run["hook_ns"]["on_train_batch_end"]]
    logging = [flag for run in runs for flag in run["logging_step"]]
    logged = [t for t, flag in zip(per_batch, logging, strict=True) if flag]
    quiet = [t for t, flag in zip(per_batch, logging, strict=True) if not flag]
    once = {
        hook: statistics.fmean(t / 1000 for run in runs for t in run["hook_ns"][hook])
        for hook in runs[0]["hook_ns"]
        if hook != "on_train_batch_end" and any(run["hook_ns"][hook] for run in runs)
    }
    background = [s for run in runs for s in run["samples"] if not s[0]]
    on_main = [s for run in runs for s in run["samples"] if s[0]]
    train_s = sum(run["train_s"] for run in runs)
    fits = sum(run["fits"] for run in runs)
    # what the sampler thread took per step, at most, if every microsecond of its CPU came off the training thread
    sampler_us_per_step = sum(s[2] for s in background) / 1000 / train_s * period_ms / 1000
    hook_mean = statistics.fmean(per_batch)
    return {
        "hook_mean": f"{hook_mean:.1f}",
        "floor": f"{statistics.fmean(t / 1000 for run in runs for t in run['floor_ns']):.2f}",
        "hook_p99": f"{_p(per_batch, 0.99):.1f}",
        "hook_max": f"{max(per_batch):.0f}",
        "hook_quiet": f"{statistics.fmean(quiet):.1f} ({len(quiet)} batches)",
        "hook_logged": f"{statistics.fmean(logged):.0f} ({len(logged)} batches)" if logged else "none",
        "once": ", ".join(f"{hook} {us:.0f}" for hook, us in once.items()) or "none",
        "samples": (
            f"{len(background) / fits:.1f} on the thread ({len(background) / train_s:.1f}/s) + "
            f"{len(on_main) / fits:.0f} on the training thread"
        ),
        "sample_wall": (
            f"{statistics.fmean(s[1] for s in background) / 1000:.0f} "
            f"({_p([s[1] / 1000 for s in background], 0.99):.0f})"
            if background
            else "none"
        ),
        "sample_cpu": f"{statistics.fmean(s[2] for s in background) / 1000:.0f}" if background else "none",
        "sample_main": f"{statistics.fmean(s[1] for s in on_main) / 1000:.0f}" if on_main else "none",
        "estimate": f"{1 + (hook_mean + sampler_us_per_step) / (1000 * period_ms):.4f}x",
    }


if __name__ == "__main__":
    sys.exit(main())
