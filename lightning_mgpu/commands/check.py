"""``python -m lightning_mgpu check``: measure and verify, on the hardware at hand, what a multi-GPU run relies on.

One process per visible GPU (NCCL), or 2 CPU processes (gloo) where there is none, started by ``torchrun
--standalone`` (the pack has no launcher of its own). Every process runs the same checks; rank 0 gathers the
results and the command prints them:

- all-reduce latency and bandwidth from 4 KB to ``--max-mb`` MB, the slowest rank's time per size; bus bandwidth is
  computed as nccl-tests does (``algbw x 2 (n - 1) / n``), and every result is checked;
- a matmul's achieved FLOP/s on each device, its result checked against float64;
- host-to-device copy speed from pinned memory (GPUs only), the copy checked;
- the pack's synchronized BatchNorm against one-process BatchNorm on the whole batch: outputs, running statistics
  and the gradients summed over ranks;
- NaNSkip's agreement: a Lightning fit under ``MultiGPUStrategy`` with a NaN loss on the last rank only must skip
  that step on every rank and leave the parameters equal everywhere;
- the NVML device behind each rank's CUDA device, by UUID (GPUs only).

With ``--gpu-tests``, from a checkout of the repository, the command also runs the test suite's CUDA-marked tests
(``pytest -m cuda``) and reports them as one more line. A check that fails prints FAIL with what differed, and the
command exits with status 1. The environment variable
``LIGHTNING_MGPU_CHECK_FAULT=bn_stats`` corrupts the last rank's BatchNorm statistics, to see a failure reported.
"""

import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CHECKS = ("all-reduce", "matmul", "host-to-device", "sync-batchnorm", "nan-skip", "nvml")
FAULT_VARIABLE = "LIGHTNING_MGPU_CHECK_FAULT"
_KIB = 1024


def run_check(
    processes: int | None = None, max_mb: int = 256, checks: Sequence[str] = CHECKS, gpu_tests: bool = False
) -> int:
    """Start the check's processes with torchrun, print the report, and return the exit status (1 on a failure).

    Args:
        processes: processes to start; by default one per visible GPU, or 2 on a machine without one.
        max_mb: the largest all-reduce, in MB (sizes go from 4 KB up by 4x).
        checks: which checks to run (names in :data:`CHECKS`).
        gpu_tests: also run the repository's CUDA-marked tests (``pytest -m cuda``).
    """
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    gpus = num_cuda_devices()
    count = processes or gpus or 2
    env = dict(os.environ)
    if not gpus:
        env.setdefault("OMP_NUM_THREADS", "1")  # 2 processes on a few cores: no oversubscription
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "results.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(count),
            "-m", "lightning_mgpu.commands.check", "--out", str(out), "--max-mb", str(max_mb),
            "--checks", *checks,
        ]  # fmt: skip
        start = time.monotonic()
        completed = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        seconds = time.monotonic() - start
        if not out.exists():
            print(completed.stdout[-4000:] + completed.stderr[-4000:], file=sys.stderr)
            print(f"lightning_mgpu check: the check processes failed (torchrun exit {completed.returncode})")
            return 1
        report = json.loads(out.read_text())
    if gpu_tests:
        report["checks"].append(_gpu_tests(gpus))
    print(format_report(report, seconds))
    return 0 if all(row["result"] != "FAIL" for row in report["checks"]) else 1


def _gpu_tests(gpus: int) -> dict[str, Any]:
    tests = Path(__file__).resolve().parents[2] / "tests"
    if not gpus:
        return {"check": "gpu-tests", "result": "SKIP", "detail": "no GPU"}
    if not tests.is_dir():
        return {"check": "gpu-tests", "result": "SKIP", "detail": "no tests/ folder: run from a checkout of the repo"}
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", str(tests)]
    if importlib.util.find_spec("xdist") is not None:
        command[-1:-1] = ["-n", "0"]  # one test at a time, whatever the repository's options say: they share the GPUs
    completed = subprocess.run(command, cwd=tests.parent, capture_output=True, text=True, check=False)
    summary = (completed.stdout.strip().splitlines() or completed.stderr.strip().splitlines()[-1:] or ["no output"])[-1]
    result = "PASS" if completed.returncode == 0 else "FAIL"
    return {"check": "gpu-tests", "result": result, "detail": f"pytest -m cuda: {summary}"}


def format_report(report: dict[str, Any], seconds: float) -> str:
    """The printed report: the all-reduce table, then one line per check with PASS, FAIL or SKIP."""
    lines = [
        f"lightning_mgpu check: {report['world_size']} processes, {report['backend']} on {report['device']}, "
        f"torch {report['torch']}, {seconds:.1f} s"
    ]
    sweep = report.get("all_reduce") or []
    if sweep:
        lines += ["", "all-reduce (sum, float32; the slowest rank's time)"]
        lines.append(f"{'size':>10}  {'time (us)':>12}  {'algbw GB/s':>10}  {'busbw GB/s':>10}")
        for row in sweep:
            figures = f"{row['seconds'] * 1e6:>12,.1f}  {row['algbw']:>10.3f}  {row['busbw']:>10.3f}"
            lines.append(f"{_size(row['bytes']):>10}  {figures}")
    width = max(len(row["check"]) for row in report["checks"])
    lines += ["", f"{'check':<{width}}  result  detail"]
    lines += [f"{row['check']:<{width}}  {row['result']:<6}  {row['detail']}" for row in report["checks"]]
    return "\n".join(lines)


def _size(count: int) -> str:
    return f"{count // (_KIB * _KIB)} MB" if count >= _KIB * _KIB else f"{count // _KIB} KB"


# ------------------------------------------------------------------------------------------------ in each process
def worker(out: Path, max_mb: int, checks: Sequence[str]) -> int:
    """One check process, under torchrun: run the checks, gather them on rank 0, which writes ``out``."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    fault = os.environ.get(FAULT_VARIABLE, "")
    mine: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("all-reduce", lambda: _all_reduce(device, world, max_mb, sweep)),
        ("matmul", lambda: _matmul(device)),
        ("host-to-device", lambda: _host_to_device(device)),
        ("sync-batchnorm", lambda: _sync_batchnorm(device, rank, world, fault == "bn_stats")),
        ("nvml", lambda: _nvml(device)),
        ("nan-skip", lambda: _nan_skip(device, rank, world)),  # last: a Lightning fit in the same process group
    ]
    for name, step in steps:
        if name in checks:
            try:
                mine.append({"check": name, **step()})
            except Exception as error:  # a broken check is a failure to report, not a crash of the others
                mine.append({"check": name, "result": "FAIL", "detail": f"{type(error).__name__}: {error}"})
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        report = {
            "world_size": world,
            "backend": dist.get_backend(),
            "device": device.type,
            "torch": torch.__version__,
            "all_reduce": sweep,
            "checks": [_merge(rows) for rows in zip(*gathered, strict=True)],
        }
        out.write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


def _merge(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One line per check over all ranks: the first failing rank's, else rank 0's (which carries the figures)."""
    for rank, row in enumerate(rows):
        if row["result"] == "FAIL":
            return {**row, "detail": f"rank {rank}: {row['detail']}"}
    return rows[0]


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce(device: Any, world: int, max_mb: int, sweep: list[dict[str, Any]]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    sizes, size = [], 4 * _KIB
    while size <= max_mb * _KIB * _KIB:
        sizes.append(size)
        size *= 4
    wrong: list[str] = []
    expected = world * (world + 1) / 2
    for size in sizes:
        tensor = torch.full((size // 4,), float(dist.get_rank() + 1), device=device)
        dist.all_reduce(tensor)  # warm-up, and the result checked
        if not bool((tensor == expected).all()):
            wrong.append(_size(size))
        iterations = max(2, min(20, (16 * _KIB * _KIB) // size))  # the same on every rank: collectives must match
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor)
        _synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = float(elapsed.item())
        algbw = size / seconds / 1e9
        sweep.append({"bytes": size, "seconds": seconds, "algbw": algbw, "busbw": algbw * 2 * (world - 1) / world})
    if wrong:
        return {"result": "FAIL", "detail": f"wrong all-reduce results at {', '.join(wrong)}"}
    peak = max(sweep, key=lambda row: row["busbw"])
    return {
        "result": "PASS",
        "detail": f"{len(sizes)} sizes, {_size(sizes[0])} to {_size(sizes[-1])}, every result correct; peak bus "
        f"bandwidth {peak['busbw']:.2f} GB/s at {_size(peak['bytes'])}, latency {sweep[0]['seconds'] * 1e6:.0f} us",
    }


def _matmul(device: Any) -> dict[str, Any]:
    import torch

    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device, dtype)
    b = torch.randn(n, n, generator=generator).to(device, dtype)
    a @ b  # warm-up
    _synchronize(device)
    iterations = 5
    start = time.perf_counter()
    for _ in range(iterations):
        product = a @ b
    _synchronize(device)
    seconds = (time.perf_counter() - start) / iterations
    reference = a[:4].double() @ b.double()
    error = ((product[:4].double() - reference).abs().max() / reference.abs().max()).item()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    flops = 2 * n**3 / seconds
    detail = f"{n}x{n} {str(dtype).removeprefix('torch.')}: {flops / 1e12:.3f} TFLOP/s on rank 0's device"
    if not error <= tolerance:
        return {"result": "FAIL", "detail": f"{detail}; relative error {error:.2e} against float64"}
    return {"result": "PASS", "detail": detail, "flops": flops}


def _host_to_device(device: Any) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        return {"result": "SKIP", "detail": "no GPU"}
    host = torch.arange(64 * _KIB * _KIB, dtype=torch.int32).pin_memory()  # 256 MB
    target = torch.empty_like(host, device=device)
    target.copy_(host, non_blocking=True)
    _synchronize(device)
    iterations = 5
    start = time.perf_counter()
    for _ in range(iterations):
        target.copy_(host, non_blocking=True)
    _synchronize(device)
    seconds = (time.perf_counter() - start) / iterations
    detail = f"256 MB from pinned memory: {host.numel() * 4 / seconds / 1e9:.1f} GB/s on rank 0's device"
    if not bool((target[-4:].cpu() == host[-4:]).all()) or int(target.sum(dtype=torch.int64)) != int(host.sum()):
        return {"result": "FAIL", "detail": f"{detail}; the copy differs from the source"}
    return {"result": "PASS", "detail": detail}


def _sync_batchnorm(device: Any, rank: int, world: int, corrupt: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_mgpu.core.distributed_batchnorm import convert_sync_batchnorm

    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(6 * world, 3, 5, generator=generator) * 3 + 1  # the global batch, the same on every rank
    weights = torch.randn(6 * world, 3, 5, generator=generator)
    reference = nn.BatchNorm1d(3).double()
    expected = reference(batch.double())
    (expected * weights.double()).sum().backward()

    synced = convert_sync_batchnorm(nn.BatchNorm1d(3)).to(device)
    mine = slice(6 * rank, 6 * (rank + 1))
    output = synced(batch[mine].to(device))
    (output * weights[mine].to(device)).sum().backward()
    if corrupt and rank == world - 1:
        synced.running_mean.add_(0.5)  # LIGHTNING_MGPU_CHECK_FAULT=bn_stats: one rank's statistics go wrong
    grads = torch.cat([synced.weight.grad, synced.bias.grad])
    dist.all_reduce(grads)  # each rank holds its samples' share: the sum is the whole batch's gradient
    differences = {
        "output": (output.double().cpu() - expected[mine].detach()).abs().max().item(),
        "running_mean": (synced.running_mean.double().cpu() - reference.running_mean).abs().max().item(),
        "running_var": (synced.running_var.double().cpu() - reference.running_var).abs().max().item(),
        "gradients": (grads.double().cpu() - torch.cat([reference.weight.grad, reference.bias.grad]))
        .abs()
        .max()
        .item(),
    }
    wrong = {name: value for name, value in differences.items() if not value <= 1e-4}
    if wrong:
        listed = ", ".join(f"{name} off by {value:.2e}" for name, value in wrong.items())
        return {"result": "FAIL", "detail": f"against one-process BatchNorm on the global batch: {listed}"}
    return {
        "result": "PASS",
        "detail": "outputs, running statistics and summed gradients equal one-process BatchNorm on the global batch "
        f"(largest difference {max(differences.values()):.1e})",
    }


def _nvml(device: Any) -> dict[str, Any]:
    from lightning_mgpu.core.nvml import NVMLSession, torch_device_uuid

    if device.type != "cuda":
        return {"result": "SKIP", "detail": "no GPU"}
    session = NVMLSession(warn=lambda message: None)
    if not session.available:
        return {"result": "FAIL", "detail": f"NVML unavailable: {session.unavailable_reason}"}
    uuid = torch_device_uuid(device.index)
    found = session.map_torch_devices([device.index], [uuid])[device.index]
    if found is None:
        return {"result": "FAIL", "detail": f"cuda:{device.index} (UUID {uuid}) matches no NVML device"}
    return {"result": "PASS", "detail": f"cuda:{device.index} is NVML GPU {found.index}, {found.name} ({found.uuid})"}


def _nan_skip(device: Any, rank: int, world: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mgpu import MultiGPUStrategy, NaNSkip

    class NaNOnLastRank(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.mse_loss(self.layer(x), y)
            if batch_idx == 1 and self.trainer.global_rank == self.trainer.world_size - 1:
                loss = loss * float("nan")  # the last rank alone: its gradients become NaN
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(16 * world, 4, generator=generator), torch.randn(16 * world, 1, generator=generator)
    )
    model, nan_skip = NaNOnLastRank(), NaNSkip(log_skipped=False, progress_bar=False)
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=world // int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=MultiGPUStrategy(),
        max_steps=3,
        callbacks=[nan_skip],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(data, batch_size=4))
    parameters = torch.cat([p.detach().flatten() for p in model.parameters()]).to(device)
    everyone = [torch.empty_like(parameters) for _ in range(world)]
    dist.all_gather(everyone, parameters)
    skipped = torch.tensor([nan_skip.skipped_steps], device=device)
    counts = [torch.empty_like(skipped) for _ in range(world)]
    dist.all_gather(counts, skipped)
    counts_list = [int(count) for count in counts]
    equal = all(torch.equal(everyone[0], other) for other in everyone[1:])
    finite = bool(torch.isfinite(parameters).all())
    detail = f"a NaN loss on rank {world - 1} at step 2: steps skipped per rank {counts_list}"
    if counts_list != [1] * world or not equal or not finite:
        state = "equal" if equal else "different"
        return {"result": "FAIL", "detail": f"{detail}; parameters {state} across ranks, finite: {finite}"}
    return {"result": "PASS", "detail": f"{detail}; parameters finite and equal on every rank"}


def main(argv: Sequence[str] | None = None) -> int:
    """The worker's command line (``python -m lightning_mgpu.commands.check --out ...``, under torchrun)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lightning_mgpu.commands.check")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-mb", type=int, default=256)
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    args = parser.parse_args(argv)
    return worker(args.out, args.max_mb, args.checks)


if __name__ == "__main__":
    sys.exit(main())
