"""What carrying a StepFlag in the gradient all-reduce costs: DDP's built-in reduction against the flagged hook.

Two gloo processes on the CPU, the MLP of shared/FACTS.md (1024-1024-1024-10, 2.1M parameters), batch 32 per
process, SGD, one thread each, a plain torch DDP loop (no Lightning, so that only the hook differs). For each bucket
size, the configurations alternate over rounds inside the same pair of processes; reported are the median time of
forward and backward (where the hooks run) per configuration, and each hook's ratio to the built-in reduction in the
same round. The flagged hook is a Python hook per bucket (DDP's own reduction runs in C++), and the last bucket
travels in a buffer of its own, one more pass over it. ``torch_hook`` is torch's Python ``allreduce_hook``: what any
Python hook costs. ``in_place`` is the flag as OOMBackoff carries it: one bit in the last bucket itself, and the
loss's gradient scaled by 1/world size instead of each bucket divided (no pass of the hook's own). Two processes
on two cores spread the per-round ratios over 0.85-1.3; ``--world-size 1`` times the same hooks with no peer to
wait for.

    python benchmarks/step_flag_overhead.py --rounds 9
    python benchmarks/step_flag_overhead.py --rounds 9 --world-size 1
"""

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import describe_machine
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.ddp.step_flag import StepFlag, register_flagged_hook

BUCKET_SIZES_MB = (25.0, 1.0)  # one bucket for this 8.4 MB model after the rebuild, and about nine
CONFIGS = ("builtin", "torch_hook", "flagged", "in_place")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _median_backward_ms(
    model: DistributedDataParallel, steps: int, warmup: int, rank: int, grad_scale: float = 1.0
) -> float:
    """The median time of forward and backward, where the hooks run (the optimizer step is the same for all)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 1024, generator=generator), torch.randint(0, 10, (32,), generator=generator)
    times = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        if grad_scale != 1.0:
            loss.register_hook(lambda grad: grad * grad_scale)
        loss.backward()
        times.append(time.perf_counter() - start)
        optimizer.step()
    return 1000 * statistics.median(times[warmup:])


def _worker(rank: int, port: int, args: argparse.Namespace, queue: "mp.Queue") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    results: dict[tuple[float, str], list[float]] = {}
    for round_index in range(args.rounds):
        for bucket_mb in BUCKET_SIZES_MB:
            order = CONFIGS if round_index % 2 == 0 else tuple(reversed(CONFIGS))
            for name in order:
                model = DistributedDataParallel(_model(), bucket_cap_mb=bucket_mb)
                grad_scale = 1.0
                if name == "flagged":
                    register_flagged_hook(model, StepFlag(process_group=model.process_group), "mean")
                elif name == "in_place":
                    flag = StepFlag(slots=1, process_group=model.process_group, in_place=True, divide=False)
                    register_flagged_hook(model, flag, "mean")
                    grad_scale = flag.loss_scale
                elif name == "torch_hook":  # torch's Python allreduce_hook: what any Python hook costs
                    model.register_comm_hook(model.process_group, allreduce_hook)
                step_ms = _median_backward_ms(model, args.steps, args.warmup, rank, grad_scale)
                results.setdefault((bucket_mb, name), []).append(step_ms)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--world-size", type=int, choices=(1, 2), default=2)
    args = parser.parse_args()
    print(f"machine: {describe_machine()}")
    print(
        f"{args.world_size} gloo process(es), MLP 1024-1024-1024-10, batch 32 each, {args.steps} steps, "
        f"{args.rounds} rounds"
    )
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [context.Process(target=_worker, args=(rank, port, args, queue)) for rank in range(args.world_size)]
    for process in processes:
        process.start()
    results = queue.get(timeout=1800)
    for process in processes:
        process.join()
    for bucket_mb in BUCKET_SIZES_MB:
        builtin = results[(bucket_mb, "builtin")]
        line = f"bucket_cap_mb={bucket_mb:g}, forward + backward: built-in {statistics.median(builtin):.2f} ms"
        for name in CONFIGS[1:]:
            times = results[(bucket_mb, name)]
            ratios = [ours / theirs for ours, theirs in zip(times, builtin, strict=True)]
            line += (
                f"; {name} {statistics.median(times):.2f} ms, {statistics.median(ratios):.3f}x "
                f"({min(ratios):.3f}-{max(ratios):.3f})"
            )
        print(line)


if __name__ == "__main__":
    main()
