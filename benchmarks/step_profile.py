"""Where a 2-process CPU DDP training step spends its time: stock Lightning, lightning_mgpu and plain torch DDP.

Same model and method as ``benchmarks/ddp_throughput.py`` (shared/FACTS.md): an MLP 1024-1024-1024-10, batch 32 per
process, SGD lr 0.01, synthetic data, gloo, one thread per process. Three setups run in alternating rounds:

- ``stock``: ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``;
- ``ours``:  ``Trainer(..., strategy="mgpu")`` after ``import lightning_mgpu``;
- ``torch``: a plain ``DistributedDataParallel`` loop over the same kind of DataLoader (a ``DistributedSampler``
  without shuffling, as Lightning injects), launched the way Lightning launches: rank 0 starts rank 1 as a copy of
  its own command line.

On rank 0 every step is split into forward (the DDP wrapper's call, loss included: Lightning runs ``training_step``
inside it), backward (``loss.backward()``, which waits for DDP's overlapped gradient all-reduce), optimizer
(``zero_grad`` plus ``step``) and the rest of the step ("loop overhead": data fetch, hooks, progress tracking and,
for the Lightning setups, the per-batch SIGTERM check, shown on its own). A step runs from one batch start (the
batch has been fetched, ``on_train_batch_start``) to the next. The communication estimate is the torch loop's DDP
backward minus its backward under ``no_sync()`` in extra steps after the timed ones. Timers only read
``time.perf_counter``: they add no collective.

    python benchmarks/step_profile.py                   # 3 rounds of 120 steps, first 10 not timed
    python benchmarks/step_profile.py --rounds 1 --steps 40

Each measurement is a fresh ``python benchmarks/step_profile.py --worker NAME``.
"""

import argparse
import json
import os
import statistics
import time

from _common import (
    add_json_out,
    describe_machine,
    launch_second_rank,
    mlp,
    ratio_row,
    run_worker,
    synthetic_dataset,
    write_rows,
)

SETUPS = {
    # name: strategy argument given to Trainer; None for the plain torch loop
    "stock": "ddp",
    "ours": "mgpu",
    "torch": None,
}
RESULT_PREFIX = "STEP_PROFILE_RESULT "
COLUMNS = ("forward", "backward", "comm", "optimizer", "overhead", "check", "total")


class Recorder:
    """Per-step phase durations on this rank, in seconds; ``mark`` opens a phase, ``lap`` closes it."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.phases: dict[str, list[float]] = {}
        self._open: dict[str, float] = {}

    def start(self) -> None:
        self.starts.append(time.perf_counter())

    def mark(self, phase: str) -> None:
        self._open[phase] = time.perf_counter()

    def lap(self, phase: str) -> None:
        self.add(phase, time.perf_counter() - self._open.pop(phase))

    def add(self, phase: str, seconds: float) -> None:
        self.phases.setdefault(phase, []).append(seconds)

    def summary(self, warmup: int, batch_size: int, world_size: int) -> dict:
        """Means in ms over the steps from ``warmup`` on that have a next batch start to end them."""
        steps = range(warmup, len(self.starts) - 1)
        p = self.phases

        def mean_ms(values: list[float]) -> float:
            return 1000 * statistics.fmean(values)

        total = mean_ms([self.starts[i + 1] - self.starts[i] for i in steps])
        result = {
            "forward": mean_ms([p["forward"][i] for i in steps]),
            "train_step": mean_ms([p["train_step"][i] for i in steps]),
            "backward": mean_ms([p["backward"][i] for i in steps]),
            "optimizer": mean_ms([p["zero_grad"][i] + p["step"][i] for i in steps]),
            # the check before batch i + 1 runs inside step i's interval
            "check": mean_ms([p["check"][i + 1] for i in steps]) if "check" in p else 0.0,
            "total": total,
            "samples_per_s": batch_size * world_size * 1000 / total,
            "timed_steps": len(steps),
        }
        result["overhead"] = total - result["forward"] - result["backward"] - result["optimizer"]
        return result


def lightning_worker(name: str, args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    import lightning_mgpu  # noqa: F401  (registers strategy="mgpu")

    torch.set_num_threads(1)
    rec = Recorder()

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            start = time.perf_counter()
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            rec.add("train_step", time.perf_counter() - start)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class PhaseTimer(pl.Callback):
        # Lightning 2.6, automatic optimization, one step:
        #   epoch loop: SIGTERM check, next(batch), on_train_batch_start
        #   SGD.step(closure) -> closure: training_step (inside DDP's forward), on_before_zero_grad, zero_grad,
        #                                 on_before_backward, loss.backward(), on_after_backward
        #                     -> on_before_optimizer_step, the parameter update, step post-hooks
        #   on_train_batch_end, progress and logger bookkeeping
        def on_train_start(self, trainer, pl_module):
            ddp = trainer.strategy.model  # the DistributedDataParallel wrapper, set up by now
            ddp.register_forward_pre_hook(lambda *_: rec.mark("forward"))
            ddp.register_forward_hook(lambda *_: rec.lap("forward"))
            trainer.optimizers[0].register_step_post_hook(lambda *_: rec.lap("step"))
            # stock: Lightning's broadcast + .item(); ours: the store check our strategy installed in setup
            loop = trainer.fit_loop.epoch_loop
            check = loop._broadcast_sigterm_tensor

            def timed_check() -> None:
                rec.mark("check")
                check()
                rec.lap("check")

            loop._broadcast_sigterm_tensor = timed_check

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rec.start()

        def on_before_zero_grad(self, trainer, pl_module, optimizer):
            rec.mark("zero_grad")

        def on_before_backward(self, trainer, pl_module, loss):
            rec.lap("zero_grad")
            rec.mark("backward")

        def on_after_backward(self, trainer, pl_module):
            rec.lap("backward")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            rec.mark("step")

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SETUPS[name],
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PhaseTimer()],
    )
    trainer.fit(MLP(), DataLoader(synthetic_dataset(args.steps, args.batch_size), batch_size=args.batch_size))
    if trainer.is_global_zero:
        result = {"setup": name, **rec.summary(args.warmup, args.batch_size, trainer.world_size)}
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def torch_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    child = launch_second_rank()  # rank 0 starts rank 1 as a copy of this command line, as Lightning's launcher does
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rec = Recorder()

    class Net(nn.Module):
        # forward computes the loss, so the DDP call does what Lightning's training_step does inside it
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x, y):
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(self.net(x), y)
            rec.add("train_step", time.perf_counter() - start)
            return loss

    model = DistributedDataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = synthetic_dataset(args.steps, args.batch_size)
    loader = DataLoader(
        data, batch_size=args.batch_size, sampler=DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
    )

    # same phase order as Lightning's closure: forward, zero_grad, backward, step
    for x, y in loader:
        rec.start()
        rec.mark("forward")
        loss = model(x, y)
        rec.lap("forward")
        rec.mark("zero_grad")
        optimizer.zero_grad()
        rec.lap("zero_grad")
        rec.mark("backward")
        loss.backward()
        rec.lap("backward")
        rec.mark("step")
        optimizer.step()
        rec.lap("step")

    # communication estimate: the same backward with DDP's reducer idle (both ranks run these steps under no_sync,
    # so no rank waits on an all-reduce the other never starts); no optimizer step, the replicas stay equal
    local = Recorder()
    for i, (x, y) in enumerate(loader):
        if i == args.steps - 1:
            break
        with model.no_sync():
            loss = model(x, y)
            optimizer.zero_grad()
            local.mark("backward")
            loss.backward()
            local.lap("backward")
    dist.barrier()  # both ranks done before either tears down gloo
    dist.destroy_process_group()

    if child is not None:
        if child.wait() != 0:
            raise RuntimeError(f"torch rank 1 exited with {child.returncode}")
        result = {"setup": "torch", **rec.summary(args.warmup, args.batch_size, 2)}
        # the same steps as the DDP means above
        no_sync = 1000 * statistics.fmean(local.phases["backward"][args.warmup :])
        result["backward_no_sync"] = no_sync
        result["comm"] = result["backward"] - no_sync
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def measure(name: str, args: argparse.Namespace) -> dict:
    worker_args = [name, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    return run_worker(__file__, worker_args, RESULT_PREFIX)


def _span(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def report(results: list[dict[str, dict]], args: argparse.Namespace) -> None:
    names = list(SETUPS)

    def column(name: str, key: str) -> list[float]:
        return [r[name][key] for r in results if key in r[name]]

    print(f"\nms per step on rank 0: mean over {results[0]['stock']['timed_steps']} timed steps, median over rounds")
    header = ("setup", *COLUMNS, "samples/s")
    print("  " + f"{header[0]:<6}" + "".join(f"{h:>11}" for h in header[1:]))
    for name in names:
        cells = []
        for key in COLUMNS:
            values = column(name, key)
            cells.append(f"{statistics.median(values):>11.2f}" if values else f"{'-':>11}")
        cells.append(f"{statistics.median(column(name, 'samples_per_s')):>11,.0f}")
        print(f"  {name:<6}" + "".join(cells))
    print("  ranges over rounds:")
    for name in names:
        print(
            f"    {name:<6} total {_span(column(name, 'total'), '.2f')} ms, "
            f"overhead {_span(column(name, 'overhead'), '.2f')} ms, "
            f"samples/s {_span(column(name, 'samples_per_s'), ',.0f')}"
        )

    print("\nthroughput ratios (same round), median (range):")
    for a, b in (("ours", "stock"), ("ours", "torch"), ("stock", "torch")):
        ratios = [r[a]["samples_per_s"] / r[b]["samples_per_s"] for r in results]
        print(f"  {a}/{b}: {statistics.median(ratios):.2f}x ({_span(ratios, '.2f')})")

    keys = ("forward", "backward", "optimizer", "overhead", "check", "total")
    print("\nstep time minus plain torch DDP's in the same round, ms per step: median, then range over rounds")
    print("  " + f"{'setup':<6}" + "".join(f"{key:>14}" for key in keys))
    for name in ("stock", "ours"):
        extra = {key: [r[name][key] - r["torch"][key] for r in results] for key in keys}
        print(f"  {name:<6}" + "".join(f"{statistics.median(extra[key]):>+14.2f}" for key in keys))
        print(f"  {'':<6}" + "".join(f"{min(extra[key]):>+8.2f}..{max(extra[key]):<+4.2f}" for key in keys))

    inner = ", ".join(f"{n} {statistics.median(column(n, 'train_step')):.2f}" for n in names)
    no_sync = statistics.median(column("torch", "backward_no_sync"))
    print(
        "\nnotes:\n"
        f"  forward: the DDP wrapper's call; training_step (the torch module's forward) alone: {inner} ms.\n"
        f"  comm: torch backward minus its backward under no_sync() ({no_sync:.2f} ms, same batches): the all-reduce\n"
        "    time that backward does not hide, plus the reducer's bucket copies. stock and ours run the same DDP\n"
        "    reducer with the same buckets: the same cost lies inside their backward column.\n"
        "  check: Lightning's per-batch SIGTERM check (stock: a broadcast and .item(); ours: a key-value store\n"
        "    lookup), part of loop overhead. A collective there also waits for the slower rank.\n"
        "  backward on rank 0 also absorbs any wait for rank 1 to reach the all-reduce."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(SETUPS), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=10, help="first steps not timed")
    parser.add_argument("--batch-size", type=int, default=32)
    add_json_out(parser)
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps - 1:
        parser.error(f"--warmup must leave at least one timed step: got --warmup {args.warmup} --steps {args.steps}")
    if args.worker == "torch":
        torch_worker(args)
        return
    if args.worker:
        lightning_worker(args.worker, args)
        return

    names = list(SETUPS)
    print(f"machine: {describe_machine()}")
    print(
        f"model: MLP 1024-1024-1024-10, batch {args.batch_size}/process, 2 processes (gloo, 1 thread each), "
        f"{args.steps} steps, first {args.warmup} not timed, {args.rounds} alternating rounds"
    )
    results = []
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else list(reversed(names))
        measured = {name: measure(name, args) for name in order}
        results.append(measured)
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{n} {measured[n]['total']:.2f} ms/step {measured[n]['samples_per_s']:,.0f}/s" for n in names)
        )
    report(results, args)
    # the one ratio against stock this script prints: ours/stock throughput; the phases are compared in ms only
    ratios = [r["ours"]["samples_per_s"] / r["stock"]["samples_per_s"] for r in results]
    metric = "samples/s (mean step time, rank 0) vs stock DDP"
    write_rows(args.json_out, [ratio_row("step_profile", "ours", metric, ratios, "higher", 'stock strategy="ddp"')])


if __name__ == "__main__":
    main()
