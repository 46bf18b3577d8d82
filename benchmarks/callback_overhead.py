"""Step-time cost of the pack's stability callbacks against no callback, measured in one run.

NaNSkip alone, NaNSkip with spike detection (``spike_zscore=6``), the same with rollback snapshots every 10 steps
(whose cost falls on one step in 10: the ratios use the mean step time, not the median), and NaNSkip with
GradientClipping (norm, z-score). On the CPU z-score clipping keeps its statistics as host numbers;
``nanskip+clip_zscore_device`` runs the tensor arithmetic an accelerator runs instead, to show what it costs.

One process, the MLP of shared/FACTS.md (1024-1024-1024-10) with a BatchNorm after each hidden layer (so NaNSkip
has running statistics to guard), batch 64 so that a CPU step takes well over 10 ms, SGD with momentum, 1 thread.
Configurations alternate over rounds; the ratio is the median step time with the callbacks over the one without,
measured in the same round. ``--accelerator cuda`` runs the same on a GPU (fused Adam there, so that NaNSkip skips
on the device).

Each run also times the pack callbacks' own hooks (wall time inside them, per optimizer step, each callback
separately): on the CPU every op they queue runs before they return, so that is their whole cost, read without the
run-to-run noise of the step-time ratio. It is printed as a share of the no-callback step of the same round.

    python benchmarks/callback_overhead.py --rounds 5
    python benchmarks/callback_overhead.py --accelerator cuda --batch-size 512
"""

import argparse
import json
import statistics
import sys
import time

from _common import describe_machine, ratio_row, run_worker, single_process_arguments, write_rows

CONFIGS = (
    "none",
    "nanskip",
    "nanskip+spikes",
    "nanskip+rollback",
    "nanskip+clip_norm",
    "nanskip+clip_zscore",
    "nanskip+clip_zscore_device",
)
RESULT_PREFIX = "CALLBACK_OVERHEAD_RESULT "


def worker(name: str, args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mgpu import GradientClipping, NaNSkip

    torch.set_num_threads(1)
    cuda = args.accelerator == "cuda"

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(1024, 1024),
                nn.BatchNorm1d(1024),
                nn.ReLU(),
                nn.Linear(1024, 1024),
                nn.BatchNorm1d(1024),
                nn.ReLU(),
                nn.Linear(1024, 10),
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            if cuda:
                return torch.optim.Adam(self.parameters(), lr=1e-3, fused=True)
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()  # the benchmark's own clock, not the callbacks under test
            self.times.append(time.perf_counter())

    callbacks: list[pl.Callback] = []
    if name != "none":
        # spike detection on the loss and the gradient norm at the documented threshold and window
        if name == "nanskip+spikes":
            callbacks.append(NaNSkip(spike_zscore=6.0))
        elif name == "nanskip+rollback":
            callbacks.append(NaNSkip(spike_zscore=6.0, spike_action="rollback", snapshot_every=10))
        else:
            callbacks.append(NaNSkip())
    if "+clip" in name:
        mode = name.split("+clip_")[-1].removesuffix("_device")
        if name.endswith("_device"):
            # the tensor arithmetic an accelerator runs, here on the CPU (whose statistics are otherwise host numbers)
            from lightning_mgpu.stability.clip_grad import GradNormStatistics

            GradNormStatistics._host_device_types = ()
        callbacks.append(GradientClipping(mode=mode, **({"max_norm": 1.0} if mode == "norm" else {})))
    hook_seconds = {type(callback).__name__: 0.0 for callback in callbacks}

    def timed(callback: pl.Callback, hook: str) -> None:
        inner = getattr(callback, hook)
        owner = type(callback).__name__

        def call(*hook_args, **hook_kwargs):
            start = time.perf_counter()
            try:
                return inner(*hook_args, **hook_kwargs)
            finally:
                if len(clock.times) > args.warmup:  # steady steps only
                    hook_seconds[owner] += time.perf_counter() - start

        setattr(callback, hook, call)  # Lightning calls the instance's attribute

    hooks = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step")
    for callback in callbacks:
        for hook in (*hooks, "on_before_zero_grad", "on_train_batch_end"):
            timed(callback, hook)
    clock = Clock()
    g = torch.Generator().manual_seed(0)
    samples = args.steps * args.batch_size
    data = TensorDataset(torch.randn(samples, 1024, generator=g), torch.randint(0, 10, (samples,), generator=g))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, clock],
    )
    trainer.fit(Net(), DataLoader(data, batch_size=args.batch_size))
    steps = [b - a for a, b in zip(clock.times[args.warmup :], clock.times[args.warmup + 1 :], strict=False)]
    counted = max(1, len(steps))
    result = {
        "config": name,
        "step_ms": 1000 * statistics.median(steps),
        "mean_ms": 1000 * statistics.fmean(steps),
        "hook_us": {owner: 1e6 * seconds / counted for owner, seconds in hook_seconds.items()},
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def main() -> None:
    args = single_process_arguments(__doc__.splitlines()[0], CONFIGS, rounds=5, steps=100)
    if args.worker:
        worker(args.worker, args)
        return

    print(f"machine: {describe_machine()}")
    print(
        f"model: MLP 1024-BN-1024-BN-10, batch {args.batch_size}, 1 process on {args.accelerator}, "
        f"{args.steps} steps, median step time after step {args.warmup}, {args.rounds} alternating rounds"
    )
    worker_args = [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--accelerator",
        args.accelerator,
    ]
    ratios: dict[str, list[float]] = {name: [] for name in CONFIGS}
    hook_shares: dict[tuple[str, str], list[float]] = {}
    hook_us: dict[tuple[str, str], list[float]] = {}
    mean_ratios: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for round_index in range(args.rounds):
        order = CONFIGS if round_index % 2 == 0 else tuple(reversed(CONFIGS))
        results = {name: run_worker(__file__, [name, *worker_args], RESULT_PREFIX) for name in order}
        times = {name: result["step_ms"] for name, result in results.items()}
        for name in CONFIGS:
            ratios[name].append(times[name] / times["none"])
            mean_ratios[name].append(results[name]["mean_ms"] / results["none"]["mean_ms"])
            for owner, micros in results[name]["hook_us"].items():
                hook_us.setdefault((name, owner), []).append(micros)
                hook_shares.setdefault((name, owner), []).append(micros / 1000 / times["none"])
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{n} {times[n]:.2f} ms ({times[n] / times['none']:.3f}x)" for n in CONFIGS)
        )
    print("\nmedian step-time ratio to no callback (same round):")
    for name in CONFIGS[1:]:
        print(
            f"  {name:<22} {statistics.median(ratios[name]):.3f}x  "
            f"(range {min(ratios[name]):.3f}-{max(ratios[name]):.3f})"
        )
    print("mean step-time ratio to no callback (same round; snapshot steps included):")
    for name in CONFIGS[1:]:
        print(f"  {name:<22} {statistics.median(mean_ratios[name]):.3f}x")
    print("time inside each callback's hooks per optimizer step, and 1 + its share of the no-callback step:")
    for (name, owner), micros in hook_us.items():
        share = statistics.median(hook_shares[(name, owner)])
        print(
            f"  {name:<22} {owner:<17} {statistics.median(micros):7.0f} us  {1 + share:.3f}x  "
            f"(range {1 + min(hook_shares[(name, owner)]):.3f}-{1 + max(hook_shares[(name, owner)]):.3f})"
        )
    rows = [
        ratio_row("callback_overhead", name, "step time vs no callback", ratios[name], "lower", "no callback")
        for name in CONFIGS[1:]
    ]
    rows += [
        ratio_row(
            "callback_overhead",
            f"{name}: {owner} hooks",
            "1 + hook time / no-callback step",
            [1 + share for share in shares],
            "lower",
            "no callback",
        )
        for (name, owner), shares in hook_shares.items()
    ]
    rows.append(
        ratio_row(
            "callback_overhead",
            "nanskip+rollback (mean)",
            "mean step time vs no callback",
            mean_ratios["nanskip+rollback"],
            "lower",
            "no callback",
        )
    )
    write_rows(args.json_out, rows)


if __name__ == "__main__":
    sys.exit(main())
