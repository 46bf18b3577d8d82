"""A 2-process CPU fit run as a script (Lightning re-runs it for rank 1), used by the preemption tests.

It can send SIGTERM to one rank at a chosen batch, count the Python-level ``torch.distributed`` calls made during a
window of training batches, give each rank its own number of batches (an ``IterableDataset``), make one rank slow
in its last validation, or train a model with a parameter that gets no gradient; it writes per rank what happened
(the exception's type and message as raised included) to ``<out>/rank<r>.json``.

    python tests/helpers/sigterm_fit.py --strategy mgpu --out /tmp/x --sigterm-rank 1 --sigterm-batch 5
    python tests/helpers/sigterm_fit.py --strategy mgpu --out /tmp/x --steps -1 --batches-per-rank 10 12
"""

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy as StockDDPStrategy
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_mgpu import MultiGPUStrategy
from lightning_mgpu.long_runs import preemption
from tests.helpers.collectives import count_collectives


class Probe(pl.Callback):
    def __init__(self, out: Path, sigterm_rank: int | None, sigterm_batch: int | None, window: tuple[int, int]):
        self.out = out
        self.sigterm_rank = sigterm_rank
        self.sigterm_batch = sigterm_batch
        self.window = window
        self.counting = False
        self.calls: dict[str, int] = {}
        self.completed = 0
        self.signal_time: float | None = None
        self.watchdog_running = False

    def setup(self, trainer, pl_module, stage):
        count_collectives(self.calls, lambda: self.counting)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # the stock per-step broadcast runs before this hook: the window counts batches start+1 .. stop
        if batch_idx == self.window[0]:
            self.counting = True
        elif batch_idx == self.window[1]:
            self.counting = False
        if trainer.global_rank == self.sigterm_rank and batch_idx == self.sigterm_batch:
            self.signal_time = time.time()
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.completed += 1
        if self.counting:  # the hang watchdog's thread runs during the counted window (the pack's strategies only)
            watch = getattr(trainer.strategy, "_hang_watch", None)
            thread = watch.watchdog._thread if watch is not None and watch.watchdog is not None else None
            self.watchdog_running = thread is not None and thread.is_alive()

    def on_exception(self, trainer, pl_module, exception):
        self._write(trainer, type(exception).__name__, str(exception))

    def on_train_end(self, trainer, pl_module):
        self._write(trainer, None)

    def _write(self, trainer, exception, message=None):
        steps = self.window[1] - self.window[0]
        record = {
            "rank": trainer.global_rank,
            "completed": self.completed,
            "exception": exception,
            "message": message,
            "collective_calls": self.calls,
            "collectives_per_step": sum(self.calls.values()) / steps,
            "signal_time": self.signal_time,
            "watchdog_running": self.watchdog_running,
            "end_time": time.time(),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class MLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class MLPWithValidation(MLP):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))


class MLPWithUnusedParameter(MLP):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(32, 4)  # never in the loss: DDP without find_unused_parameters fails on step 2


class PerRankBatches(IterableDataset):
    """Yields ``counts[rank]`` batches of 16 on each rank (an uneven split when the counts differ)."""

    def __init__(self, counts: list[int]):
        self.counts = counts

    def __iter__(self):
        count = self.counts[torch.distributed.get_rank()]
        g = torch.Generator().manual_seed(1)
        for _ in range(count):
            yield torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


class SlowLastValidation(pl.Callback):
    """Makes one rank finish the fit's last validation ``seconds`` later than the others."""

    def __init__(self, rank: int, seconds: float):
        self.rank = rank
        self.seconds = seconds

    def on_validation_end(self, trainer, pl_module):
        if trainer.global_rank == self.rank and trainer.current_epoch == trainer.max_epochs - 1:
            time.sleep(self.seconds)


class StopMidEpochThenSlowEnd(pl.Callback):
    """Stops the fit mid-epoch at ``stop_step`` (as a Timer or EarlyStopping does); one rank then spends ``seconds``
    in its ``on_train_end`` (a rank-zero export or upload)."""

    def __init__(self, stop_step: int, rank: int, seconds: float):
        self.stop_step = stop_step
        self.rank = rank
        self.seconds = seconds

    def on_train_batch_end(self, trainer, *_):
        if trainer.global_step == self.stop_step:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["mgpu", "fsdp", "stock"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sigterm-rank", type=int)
    parser.add_argument("--sigterm-batch", type=int)
    parser.add_argument("--window", type=int, nargs=2, default=(10, 30))
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep per step (slow steps)")
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batches-per-rank", type=int, nargs=2, help="an IterableDataset with this many per rank")
    parser.add_argument("--end-timeout", type=float, help="sets preemption.END_OF_FIT_TIMEOUT (seconds)")
    parser.add_argument("--slow-validation", type=float, nargs=2, metavar=("RANK", "SECONDS"))
    parser.add_argument("--unused-parameter", action="store_true")
    parser.add_argument("--stop-then-slow-end", type=float, nargs=3, metavar=("STEP", "RANK", "SECONDS"))
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.end_timeout is not None:
        preemption.END_OF_FIT_TIMEOUT = args.end_timeout
    args.out.mkdir(parents=True, exist_ok=True)

    timeout = timedelta(seconds=args.pg_timeout)
    if args.strategy in ("mgpu", "fsdp"):
        strategy = MultiGPUStrategy(mode="ddp" if args.strategy == "mgpu" else "fsdp", timeout=timeout)
    else:
        strategy = StockDDPStrategy(timeout=timeout)

    class Slow(pl.Callback):
        def on_train_batch_end(self, *_):
            time.sleep(args.step_delay)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))
    callbacks = [Probe(args.out, args.sigterm_rank, args.sigterm_batch, tuple(args.window)), Slow()]
    if args.batches_per_rank:
        # batch_size=None: the dataset yields whole batches
        train = DataLoader(PerRankBatches(args.batches_per_rank), batch_size=None)
    else:
        train = DataLoader(data, batch_size=16)
    model, val = MLP(), None
    if args.slow_validation:
        model, val = MLPWithValidation(), DataLoader(TensorDataset(*data[:64]), batch_size=16)
        callbacks.append(SlowLastValidation(int(args.slow_validation[0]), args.slow_validation[1]))
    if args.unused_parameter:
        model = MLPWithUnusedParameter()
    if args.stop_then_slow_end:
        step, rank, seconds = args.stop_then_slow_end
        callbacks.append(StopMidEpochThenSlowEnd(int(step), int(rank), seconds))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    try:
        trainer.fit(model, train, val)
    except BaseException as err:
        # the message as raised to the user, after the strategy's on_exception (callbacks see it before)
        path = args.out / f"rank{trainer.global_rank}.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**record, "raised": str(err)}))
        raise


if __name__ == "__main__":
    main()
