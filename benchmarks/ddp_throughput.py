"""2-process DDP throughput: lightning_mgpu's strategies against stock Lightning, measured in one run.

The model is the one in shared/FACTS.md: an MLP 1024-1024-1024-10 (2.1M parameters), batch 32 per process, SGD,
one thread per process, 120 steps, samples per second counted after step 5. Configurations run in alternating
rounds (so drift on a shared machine hits all of them alike) and the script prints, per round and as medians,
each one's throughput and its ratio to stock ``strategy="ddp"``.

    python benchmarks/ddp_throughput.py                 # 3 rounds of every configuration
    python benchmarks/ddp_throughput.py --rounds 5 --configs stock_ddp mgpu
    python benchmarks/ddp_throughput.py --accumulate-grad-batches 2 --configs stock_ddp mgpu mgpu_oom_backoff
    python benchmarks/ddp_throughput.py --gradient-as-bucket-view --accumulate-grad-batches 2 \
        --configs stock_ddp mgpu mgpu_oom_backoff
    python benchmarks/ddp_throughput.py --accelerator cuda --rounds 5 --configs stock_ddp mgpu mgpu_oom_backoff

``--accelerator cuda`` runs the 2 processes on 2 GPUs (NCCL), the clock synchronising the GPU where it starts and
stops; the plain torch loop ("torch") runs on the CPU only.

Each measurement is a fresh ``python benchmarks/ddp_throughput.py --worker NAME``: Lightning re-runs that command
line for rank 1, exactly as it does for a user's script.
"""

import argparse
import json
import os
import statistics
import time

from _common import (
    add_json_out,
    batch_clock,
    classifier_module,
    describe_machine,
    launch_second_rank,
    mlp,
    ratio_row,
    run_worker,
    synthetic_dataset,
    write_rows,
)

CONFIGS = {
    # name: strategy argument given to Trainer ("torch": no Lightning, a plain DDP loop)
    "stock_ddp": "ddp",
    "torch": None,
    "mgpu": "mgpu",
    "mgpu_fp16": "mgpu_ddp_fp16",
    "mgpu_bf16": "mgpu_ddp_bf16",
    "mgpu_powersgd": "mgpu_ddp_powersgd",
    # "mgpu" with OOMBackoff and no OOM: the price of its whole-batch path (the failure flag in DDP's reduction, the
    # copies an undo would need, the held-back self.log calls)
    "mgpu_oom_backoff": "mgpu",
    # "mgpu" carrying OOMBackoff's failure flag in its reduction (a Python hook per bucket) with no callback: about
    # the hook's share of mgpu_oom_backoff's price (this hook divides each bucket, as DDP's own reduction does;
    # OOMBackoff's steps scale the loss's gradient instead, and read the flag)
    "mgpu_step_flag": "mgpu",
    # "mgpu" without its hang watchdog (hang_timeout=None): "mgpu" against this is the watchdog's per-step price
    "mgpu_no_hang_watch": "mgpu",
}
BASELINE = "stock_ddp"
# the configurations --gradient-as-bucket-view applies to (their strategy is "ddp" or "mgpu" with default options)
BUCKET_VIEW_CONFIGS = ("stock_ddp", "mgpu", "mgpu_oom_backoff", "mgpu_step_flag")
RESULT_PREFIX = "BENCHMARK_RESULT "


def torch_worker(steps: int, warmup: int, batch_size: int) -> None:
    """The same training as the Lightning configurations, as a plain torch DDP loop over the same data loader."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    child = launch_second_rank()  # rank 0 starts rank 1 from the same command line, as Lightning's launcher does
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = nn.parallel.DistributedDataParallel(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = synthetic_dataset(steps, batch_size)
    loader = DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, 2, rank, shuffle=False))
    start = stop = 0.0
    for batch_idx, (x, y) in enumerate(loader):
        if batch_idx == steps:
            break
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if batch_idx + 1 == warmup:
            start = time.perf_counter()
        elif batch_idx + 1 == steps:
            stop = time.perf_counter()
    dist.barrier()  # both ranks done before either tears down gloo
    dist.destroy_process_group()
    if child is not None and child.wait() == 0:
        measured = steps - warmup
        result = {"config": "torch", "samples_per_s": measured * batch_size * 2 / (stop - start)}
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def worker(
    name: str,
    steps: int,
    warmup: int,
    batch_size: int,
    accumulate: int = 1,
    bucket_view: bool = False,
    accelerator: str = "cpu",
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if name == "torch":
        if accumulate != 1:
            raise SystemExit("the plain torch loop does not accumulate: leave --accumulate-grad-batches at 1")
        torch_worker(steps, warmup, batch_size)
        return
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    import lightning_mgpu

    torch.set_num_threads(1)

    data = synthetic_dataset(steps, batch_size)
    clock = batch_clock(warmup, steps)
    strategy = CONFIGS[name]
    if name == "mgpu_powersgd":  # the mgpu_ddp_powersgd preset, with a warm-up that fits a short run
        strategy = lightning_mgpu.MultiGPUStrategy(
            mode="ddp", comm_hook="powersgd", gradient_as_bucket_view=True, powersgd_warmup_steps=warmup
        )
    if name == "mgpu_no_hang_watch":
        strategy = lightning_mgpu.MultiGPUStrategy(hang_timeout=None)
    if bucket_view and strategy == "ddp":
        strategy = pl.strategies.DDPStrategy(gradient_as_bucket_view=True)
    elif bucket_view and strategy == "mgpu":
        strategy = lightning_mgpu.MultiGPUStrategy(gradient_as_bucket_view=True)
    callbacks = [clock]
    if name == "mgpu_oom_backoff":
        callbacks.append(lightning_mgpu.OOMBackoff())
    if name == "mgpu_step_flag":
        callbacks.append(step_flag_carrier())
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=2,
        strategy=strategy,
        max_steps=steps // accumulate,  # optimizer steps: ``steps`` batches either way
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(classifier_module(mlp()), DataLoader(data, batch_size=batch_size))
    if trainer.is_global_zero:
        measured = steps - warmup
        result = {
            "config": name,
            "samples_per_s": measured * batch_size * trainer.world_size / (clock.stop - clock.start),
            "steps_per_s": measured / (clock.stop - clock.start),
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def step_flag_carrier():
    """A callback that asks the strategy to carry a StepFlag in its reduction, as OOMBackoff does, and nothing else."""
    import lightning.pytorch as pl

    from lightning_mgpu.ddp.step_flag import StepFlag

    class StepFlagCarrier(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            flag = StepFlag(slots=1, in_place=True)
            try:
                from lightning_mgpu.core.step_service import step_service
            except ImportError:  # an install from before the step service (compare_installs.py runs one)
                trainer.strategy.step_flag = flag
            else:
                step_service(trainer).carry_flag(flag)

    return StepFlagCarrier()


def measure(name: str, args: argparse.Namespace) -> dict:
    worker_args = [name, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    worker_args += ["--accumulate-grad-batches", str(args.accumulate_grad_batches)]
    if args.gradient_as_bucket_view:
        worker_args.append("--gradient-as-bucket-view")
    worker_args += ["--accelerator", args.accelerator]
    return run_worker(__file__, worker_args, RESULT_PREFIX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--accumulate-grad-batches", type=int, default=1, help="batches per optimizer step (steps must be a multiple)"
    )
    parser.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help=f"gradients as views of DDP's buckets, for {', '.join(BUCKET_VIEW_CONFIGS)} (mgpu_powersgd: always)",
    )
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu", help="cuda: 2 GPUs, NCCL")
    add_json_out(parser)
    args = parser.parse_args()
    if args.accelerator == "cuda" and "torch" in args.configs:
        if not args.worker:
            print("leaving out 'torch': the plain torch loop runs on the CPU only")
        args.configs = [c for c in args.configs if c != "torch"]
    accumulate = args.accumulate_grad_batches
    if accumulate < 1:
        parser.error(f"--accumulate-grad-batches must be at least 1, got {accumulate}")
    if accumulate > 1 and "torch" in args.configs:
        if not args.worker:
            print("leaving out 'torch': the plain torch loop does not accumulate")
        args.configs = [c for c in args.configs if c != "torch"]
    args.warmup = -(-args.warmup // accumulate) * accumulate  # timing starts at a window's first batch
    unsupported = [c for c in args.configs if c not in (*BUCKET_VIEW_CONFIGS, "mgpu_powersgd")]
    if args.gradient_as_bucket_view and unsupported:
        parser.error(f"--gradient-as-bucket-view is not built for {', '.join(unsupported)}: leave them out")
    if args.steps % args.accumulate_grad_batches:
        parser.error(
            f"--steps {args.steps} is not a multiple of --accumulate-grad-batches {args.accumulate_grad_batches}"
        )
    if args.worker:
        worker(
            args.worker,
            args.steps,
            args.warmup,
            args.batch_size,
            args.accumulate_grad_batches,
            args.gradient_as_bucket_view,
            args.accelerator,
        )
        return

    configs = [BASELINE] + [c for c in args.configs if c != BASELINE]
    print(f"machine: {describe_machine()}")
    print(
        f"model: MLP 1024-1024-1024-10, batch {args.batch_size}/process, 2 processes on {args.accelerator},"
        f" {args.steps} batches "
        f"({args.accumulate_grad_batches} per optimizer step), timed after batch {args.warmup}, "
        f"{'gradients as bucket views, ' if args.gradient_as_bucket_view else ''}"
        f"{args.rounds} alternating rounds"
    )
    samples: dict[str, list[float]] = {c: [] for c in configs}
    ratios: dict[str, list[float]] = {c: [] for c in configs}
    for round_index in range(args.rounds):
        order = configs if round_index % 2 == 0 else list(reversed(configs))
        results = {name: measure(name, args)["samples_per_s"] for name in order}
        for name in configs:
            samples[name].append(results[name])
            ratios[name].append(results[name] / results[BASELINE])
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{name} {results[name]:,.0f}/s ({results[name] / results[BASELINE]:.2f}x)" for name in configs)
        )
    print("\nmedian over rounds (samples/s, ratio to stock ddp measured in the same round):")
    for name in configs:
        print(
            f"  {name:<14} {statistics.median(samples[name]):>8,.0f}  "
            f"{statistics.median(ratios[name]):.2f}x  (range {min(ratios[name]):.2f}-{max(ratios[name]):.2f})"
        )

    rows = [
        ratio_row(
            "ddp_throughput", name, "samples/s vs stock DDP", ratios[name], "higher", 'stock Lightning strategy="ddp"'
        )
        for name in configs[1:]
    ]
    # (ours, against): mgpu against a plain torch loop; OOMBackoff with no OOM against mgpu alone (issue 22's target)
    pairs = (
        ("mgpu", "torch", "plain torch DDP loop"),
        ("mgpu_oom_backoff", "mgpu", "mgpu"),
        ("mgpu_step_flag", "mgpu", "mgpu"),
    )
    for ours, against, label in pairs:
        if ours in samples and against in samples:
            pair = [m / t for m, t in zip(samples[ours], samples[against], strict=True)]
            print(
                f"  {ours} / {label}, same round: median {statistics.median(pair):.3f}x "
                f"(range {min(pair):.3f}-{max(pair):.3f})"
            )
            target = ">= 0.98" if ours == "mgpu_oom_backoff" else None
            rows.append(ratio_row("ddp_throughput", ours, f"samples/s vs {label}", pair, "higher", label, target))
    write_rows(args.json_out, rows)


if __name__ == "__main__":
    main()
