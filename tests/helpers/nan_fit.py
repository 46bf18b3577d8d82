"""A 2-process CPU fit run as a script, with a NaN added to rank 1's loss at every step from step 1 on (or at one
step, ``--nan-at``).

Each rank records the exception that ended its fit in ``<out>/exception<rank>.json``, and the skip events NaNSkip
recorded in ``<out>/events<rank>.json``.

    python tests/helpers/nan_fit.py --out /tmp/x --max-consecutive 3
    python tests/helpers/nan_fit.py --out /tmp/x --nan-at 2
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch import Callback, Trainer

from lightning_mgpu import MultiGPUStrategy, NaNSkip
from tests.helpers.models import BatchNormClassifier
from tests.helpers.trainer import QUIET


class RecordException(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_exception(self, trainer, pl_module, exception):
        record = {"type": type(exception).__name__, "message": str(exception), "step": trainer.global_step}
        (self.directory / f"exception{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_fit_end(self, trainer, pl_module):
        skip = next(cb for cb in trainer.callbacks if isinstance(cb, NaNSkip))
        events = [[event.step, event.kind, event.detail] for event in skip.events.since(0)]
        (self.directory / f"events{trainer.global_rank}.json").write_text(json.dumps(events))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-consecutive", type=int, default=3)
    parser.add_argument("--nan-at", type=int, default=-1, help="the one step whose loss is NaN; -1: every step from 1")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MultiGPUStrategy(mode="ddp"),
        max_steps=10,
        use_distributed_sampler=False,
        callbacks=[NaNSkip(max_consecutive=args.max_consecutive), RecordException(args.out)],
        **QUIET,
    )
    trainer.fit(BatchNormClassifier((4, 4), steps=10, inject=("loss_nan", 1, args.nan_at)))


if __name__ == "__main__":
    main()
