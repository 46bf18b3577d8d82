"""A 2-process CPU fit run as a script, with out-of-memory errors injected on some ranks only.

Each rank saves what the tests compare in ``<out>/rank<r>.pt``: parameters, the micro-batch size, the recoveries,
the sample indices its steps saw, and the exception that ended its fit (if any), with the seconds it took.

    python tests/helpers/oom_fit.py --out /tmp/x --inject forward --rank 1
    python tests/helpers/oom_fit.py --out /tmp/ref --inject none --batch-size 4 --accumulate 2 --no-backoff
"""

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch import Callback, Trainer
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, Subset

from lightning_mgpu import MultiGPUStrategy, NaNSkip, OOMBackoff
from lightning_mgpu.core.step_service import step_service
from tests.helpers.oom_models import IndexedData, IndexedRegression, raise_oom
from tests.helpers.trainer import QUIET


class UnevenRanks(IndexedRegression):
    """Rank 1 holds 12 samples (batches of 8 and 4), rank 0 16: the loader is not split by a DistributedSampler."""

    def train_dataloader(self) -> DataLoader:
        indices = list(range(16)) if self.global_rank == 0 else list(range(16, 28))
        return DataLoader(Subset(IndexedData(self.num_samples), indices), batch_size=self.batch_size, shuffle=False)


class Branchy(IndexedRegression):
    """An extra layer used on even batch indices only: in a window of 2 batches, by the first batch alone."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.extra = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 2 == 0:
            loss = loss + self.extra(batch[1]).pow(2).mean()
        return loss


class SyncedLog(IndexedRegression):
    """Logs a value synchronised across the ranks at every step: a collective of ``self.log``'s own, in every batch."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("synced_loss", loss, sync_dist=True)
        return loss


class FailsAfterBackward(IndexedRegression):
    """Rank 1 runs out of memory in ``on_after_backward`` at step 1, once every gradient bucket was reduced (once:
    a redo of the step does not fail there again).

    It also logs a value synchronised across the ranks at every step: a collective of ``self.log``'s own.
    """

    failed_after_backward = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("synced_loss", loss, sync_dist=True)
        return loss

    def on_after_backward(self) -> None:
        if self.global_rank == 1 and self.trainer.global_step == 1 and not self.failed_after_backward:
            self.failed_after_backward = True
            raise_oom()


class IgnoredBias(IndexedRegression):
    """The head's bias is one DDP ignores: each rank trains its own from its own gradients, never averaged."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._ddp_params_and_buffers_to_ignore = ["head.bias"]


class UnfreezesHead(IndexedRegression):
    """The head is frozen when DDP wraps the model and unfrozen from step 1 on: in no bucket, so each rank trains its
    own, as a fine-tuning callback's unfreezing does under stock DDP."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.head.requires_grad_(False)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.trainer.global_step == 1:
            self.head.requires_grad_(True)


class KeepsGradients(IndexedRegression):
    """Zeroes the gradients instead of dropping them: with ``gradient_as_bucket_view``, they stay views of DDP's
    buckets from step to step."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)


class WholeBatchSpikes(IndexedRegression):
    """Rank 0's loss spikes at optimizer step 8 when its batch runs whole, not in micro-batches: a spike only the
    attempt that OOMBackoff drops (rank 1 runs out of memory in that step) sees."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 0 and self.trainer.global_step == 8 and len(batch[0]) == self.batch_size:
            loss = loss * 100.0
            self.spiked_attempts = getattr(self, "spiked_attempts", 0) + 1
        return loss


class SaveRankState(Callback):
    def __init__(self, out: Path, backoff: OOMBackoff | None, profile_batch: int | None = None) -> None:
        self.out, self.backoff, self.start = out, backoff, time.monotonic()
        self.exception: dict | None = None
        self.profile_batch, self.profiler = profile_batch, None
        self.collectives: dict[str, int] | None = None
        self.whole_batches = 0
        self.flag_carried = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.profile_batch:
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            events = self.profiler.events()
            self.collectives = dict(Counter(e.name for e in events if e.name.startswith("gloo:")))
            self.profiler = None
        runner = self.backoff._runner if self.backoff is not None else None
        self.whole_batches = runner.whole_batches if runner is not None else 0
        self.flag_carried = step_service(trainer).flag_carried  # teardown ends the service

    def on_exception(self, trainer, pl_module, exception):
        self.exception = {"type": type(exception).__name__, "message": str(exception)}
        self._save(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module):
        self._save(trainer, pl_module)

    def _save(self, trainer, pl_module):
        state = {
            "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items() if "metric" not in k},
            "micro_batch_size": self.backoff.micro_batch_size if self.backoff else None,
            "recoveries": self.backoff.recoveries if self.backoff else 0,
            "seen": pl_module.seen,
            "epoch_indices": pl_module.epoch_indices,
            "exception": self.exception,
            "seconds": time.monotonic() - self.start,
            "global_step": trainer.global_step,
            "collectives": self.collectives,
            "whole_batches": self.whole_batches,
            "flag_carried": self.flag_carried,
            "tuning": getattr(trainer.strategy, "bucket_tuning", None),
            "spiked_attempts": getattr(pl_module, "spiked_attempts", 0),
            "skipped_steps": next((int(c.skipped_steps) for c in trainer.callbacks if isinstance(c, NaNSkip)), None),
        }
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--inject", choices=["none", "forward", "backward", "step"], default="forward")
    parser.add_argument("--rank", type=int, default=1, help="the rank that runs out of memory; -1 for every rank")
    parser.add_argument("--oom-from-batch", type=int, default=0, help="inject from this batch of each epoch on")
    parser.add_argument("--oom-from-step", type=int, default=0, help="inject from this optimizer step on")
    parser.add_argument("--oom-batches", type=int, nargs="+", help="inject at these batches of each epoch only")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--no-backoff", action="store_true")
    parser.add_argument("--min-micro-batch-size", type=int, default=1)
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--step-oom-at", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--sync-bn", action="store_true", help="a BatchNorm layer, synchronised across the ranks")
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm layer per process (DDP broadcasts it)")
    parser.add_argument("--find-unused", action="store_true", help="DDP's find_unused_parameters")
    parser.add_argument("--bucket-view", action="store_true", help="DDP's gradient_as_bucket_view")
    parser.add_argument(
        "--delay-head", action="store_true", help="DDP's delay_all_reduce_named_params: the head's bias"
    )
    parser.add_argument("--batched-copy", action="store_true", help="DDP's batched_grad_copy")
    parser.add_argument("--nan-skip", action="store_true", help="NaNSkip, with loss spikes (a window of 8)")
    parser.add_argument(
        "--model",
        choices=[
            "plain",
            "uneven",
            "branchy",
            "after-backward",
            "synced-log",
            "ignored",
            "unfreezes",
            "keeps-grads",
            "whole-batch-spikes",
        ],
        default="plain",
    )
    parser.add_argument("--profile-step", type=int, help="count the gloo collectives of this optimizer step")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_class = {
        "plain": IndexedRegression,
        "uneven": UnevenRanks,
        "branchy": Branchy,
        "after-backward": FailsAfterBackward,
        "synced-log": SyncedLog,
        "ignored": IgnoredBias,
        "unfreezes": UnfreezesHead,
        "keeps-grads": KeepsGradients,
        "whole-batch-spikes": WholeBatchSpikes,
    }[args.model]
    model = model_class(
        num_samples=32,
        batch_size=args.batch_size,
        oom_above=4 if args.inject in ("forward", "backward") else None,
        oom_in=args.inject if args.inject in ("forward", "backward") else "forward",
        oom_ranks=None if args.rank < 0 else (args.rank,),
        oom_from_batch=args.oom_from_batch,
        oom_batches=tuple(args.oom_batches) if args.oom_batches else None,
        oom_from_step=args.oom_from_step,
        batchnorm=args.sync_bn or args.batchnorm,
        step_oom_at=args.step_oom_at if args.inject == "step" else None,
    )
    ddp_kwargs = {"batched_grad_copy": True} if args.batched_copy else {}
    if args.delay_head:
        ddp_kwargs.update(
            delay_all_reduce_named_params=[("head.bias", model.head.bias)], param_to_hook_all_reduce=model.head.bias
        )
    backoff = None if args.no_backoff else OOMBackoff(min_micro_batch_size=args.min_micro_batch_size)
    callbacks = [SaveRankState(args.out, backoff, args.profile_step)] + ([backoff] if backoff else [])
    if args.nan_skip:
        callbacks.insert(1, NaNSkip(spike_zscore=3.0, spike_window=8, spike_on="loss"))
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=MultiGPUStrategy(
            mode="ddp",
            sync_batchnorm=args.sync_bn,
            find_unused_parameters=args.find_unused,
            gradient_as_bucket_view=args.bucket_view,
            **ddp_kwargs,
        ),
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        limit_val_batches=0,
        use_distributed_sampler=args.model != "uneven",
        callbacks=callbacks,
        **QUIET,
    )
    trainer.fit(model)


if __name__ == "__main__":
    main()
