"""Pieces shared by the benchmarks: machine line, model, worker processes, and the rows ``run_all.py`` reads.

The scripts run as ``python benchmarks/<name>.py``, so ``benchmarks/`` is ``sys.path[0]`` and they import this as
``_common``. torch and lightning are imported inside the functions that need them: importing this module is cheap.
"""

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

# what a launcher leaves in the environment; a fresh worker must start without it
LAUNCHER_ENV_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def describe_machine() -> str:
    """One line: CPU model, core count, Python, torch and lightning versions."""
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
        f"lightning {lightning.__version__}"
    )


def mlp():
    """The benchmark model (shared/FACTS.md): an MLP 1024-1024-1024-10, 2.1M parameters."""
    from torch import nn

    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def classifier_module(net):
    """A LightningModule training ``net`` with cross-entropy and SGD (lr 0.01): the benchmarks' stand-in model."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Classifier()


def batch_clock(started_after: int, steps: int):
    """A callback whose ``start``/``stop`` are the times batch ``started_after`` and batch ``steps`` ended (1-based)."""
    import time

    import lightning.pytorch as pl

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.start = self.stop = 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx + 1 not in (started_after, steps):
                return
            if pl_module.device.type == "cuda":  # the GPU's work, not how fast the host queued it
                import torch

                torch.cuda.synchronize(pl_module.device)
            if batch_idx + 1 == started_after:
                self.start = time.perf_counter()
            else:
                self.stop = time.perf_counter()

    return Clock()


def synthetic_dataset(steps: int, batch_size: int):
    """Seeded random inputs and labels: ``steps`` batches of ``batch_size`` for each of the 2 processes."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    samples = steps * batch_size * 2
    return TensorDataset(torch.randn(samples, 1024, generator=g), torch.randint(0, 10, (samples,), generator=g))


def launch_second_rank() -> subprocess.Popen | None:
    """Make a plain torch worker rank 0 of 2 and start rank 1 as a copy of its command line, as Lightning does.

    Without ``RANK`` in the environment: picks a free local port, sets ``MASTER_ADDR``, ``MASTER_PORT``,
    ``WORLD_SIZE=2`` and ``RANK=0`` here and returns the started rank-1 process. In that process (``RANK`` set)
    it does nothing and returns None.
    """
    if "RANK" in os.environ:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK="0")
    return subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "RANK": "1"})


def run_worker(script: str, worker_args: list[str], result_prefix: str, timeout: float = 600) -> dict:
    """Run ``python script --worker *worker_args`` afresh and return the JSON it prints after ``result_prefix``.

    ``worker_args[0]`` is the worker's name. The child gets the environment without launcher variables, with
    ``OMP_NUM_THREADS=1`` and the repository root as ``PYTHONPATH``. Raises with the tail of its stderr when no
    result line comes.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    command = [sys.executable, script, "--worker", *worker_args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    for line in done.stdout.splitlines():
        if line.startswith(result_prefix):
            return json.loads(line[len(result_prefix) :])
    raise RuntimeError(f"{worker_args[0]} produced no result:\n{done.stderr[-3000:]}")


def single_process_arguments(description: str, workers: tuple[str, ...], rounds: int, steps: int):
    """The command line the single-process benchmarks share: worker, rounds, steps, warm-up, batch, accelerator."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--worker", choices=workers, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    add_json_out(parser)
    return parser.parse_args()


@dataclass(frozen=True)
class Row:
    """One ratio against a baseline measured in the same run, from the numbers a benchmark prints.

    ``ratio`` is the median over ``rounds`` rounds, ``low``-``high`` their range (None where the figure has no
    spread of its own); ``better`` says which way is good for the ratio as printed: ``"lower"`` for step time,
    ``"higher"`` for throughput or accuracy. ``target`` is the one the script states, as text (``">= 0.98"``).
    """

    benchmark: str
    config: str
    metric: str
    ratio: float
    low: float | None
    high: float | None
    better: Literal["higher", "lower"]
    baseline: str
    target: str | None = None
    rounds: int = 1


def ratio_row(
    benchmark: str,
    config: str,
    metric: str,
    ratios: list[float],
    better: Literal["higher", "lower"],
    baseline: str,
    target: str | None = None,
) -> Row:
    """The row of one ratio per round: median and range over the rounds, as the scripts print them."""
    median = statistics.median(ratios)
    return Row(benchmark, config, metric, median, min(ratios), max(ratios), better, baseline, target, len(ratios))


def add_json_out(parser: argparse.ArgumentParser) -> None:
    """``--json-out PATH``: where a benchmark also writes its rows for ``run_all.py``."""
    parser.add_argument(
        "--json-out", type=Path, metavar="PATH", help="also write the ratios against the baselines as JSON rows"
    )


def write_rows(path: Path | None, rows: list[Row]) -> None:
    """Write ``rows`` to ``path`` as a JSON list of objects; nothing when ``path`` is None."""
    if path is not None:
        path.write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")


def read_rows(path: Path) -> list[Row]:
    """The rows :func:`write_rows` wrote."""
    return [Row(**row) for row in json.loads(path.read_text())]
