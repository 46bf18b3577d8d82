"""A 2-process CPU fit of :class:`TinyTransformer` under ``mgpu_fsdp`` or a DDP reference, run as a script.

Rank 0 writes ``<out>/result.pt``: the full parameters after the fit (gathered from the shards), the parameter
elements each rank held, the sharding units and the strategy's class.

    python tests/helpers/sharded_fit.py --out /tmp/x --strategy mgpu_fsdp --steps 20
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mgpu import GradientClipping, MultiGPUStrategy, NaNSkip, OOMBackoff
from tests.helpers.tiny_transformer import TinyTransformer
from tests.helpers.trainer import QUIET


def full(param: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(param, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else param).detach().clone()


class NaNInShard(Callback):
    """Rank ``rank`` puts a NaN in one element of its own gradient shard after the backward of step ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if (trainer.global_rank, trainer.global_step) == (self.rank, self.step):
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            getattr(grad, "to_local", lambda: grad)().view(-1)[0] = float("nan")


class Record(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        params = {name: full(param) for name, param in pl_module.named_parameters()}
        local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in pl_module.parameters())
        locals_ = [None] * trainer.world_size
        dist.all_gather_object(locals_, local)
        strategy = trainer.strategy
        skip = next((cb for cb in trainer.callbacks if isinstance(cb, NaNSkip)), None)
        skipped = [None] * trainer.world_size
        dist.all_gather_object(skipped, None if skip is None else skip.skipped_steps)
        if trainer.global_rank == 0:
            torch.save(
                {
                    "params": params,
                    "local_numel": locals_,
                    "total_numel": sum(p.numel() for p in params.values()),
                    "units": getattr(strategy, "units", None),
                    "checkpointed": getattr(strategy, "checkpointed", None),
                    "strategy": type(strategy).__name__,
                    "global_step": trainer.global_step,
                    "skipped": skipped,
                    "plan": getattr(strategy, "plan", None),
                    "choice": strategy.choice,
                },
                self.out / "result.pt",
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", default="mgpu_fsdp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-at", type=int, default=0, help="write a checkpoint every N steps into <out>/ckpt")
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--sharding", default="full")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--nan-at", type=int, nargs=2, default=None, help="rank step")
    parser.add_argument("--nan-shard", type=int, nargs=2, default=None, help="rank step")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--skip-on-device", action="store_true", help="NaNSkip(skip_on_device=True)")
    parser.add_argument("--oom-backoff", action="store_true")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--budget", type=float, default=None, help="memory_budget_mb, with --strategy auto")
    parser.add_argument("--samples", type=int, default=80, help="80: 10 steps an epoch, so step 10 ends one")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    ac = "auto" if args.activation_checkpointing else None
    if args.strategy == "mgpu_fsdp":
        strategy = MultiGPUStrategy(mode="fsdp", sharding=args.sharding, activation_checkpointing=ac)
    elif args.strategy == "auto":
        strategy = MultiGPUStrategy(mode="auto", bucket_cap_mb=None, memory_budget_mb=args.budget)
    elif args.strategy == "ddp":
        strategy = MultiGPUStrategy(mode="ddp", bucket_cap_mb=None, activation_checkpointing=ac)
    else:
        strategy = args.strategy
    callbacks = [Record(args.out)]
    if args.save_at:
        callbacks.append(ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.save_at, save_top_k=-1))
    if args.nan_at is not None or args.nan_shard is not None:
        # NaNSkip runs first, so the shard's NaN is in place when it checks
        callbacks.insert(0, NaNSkip(max_consecutive=3, skip_on_device=args.skip_on_device))
    if args.nan_shard is not None:
        callbacks.insert(0, NaNInShard(*args.nan_shard))
    if args.oom_backoff:
        callbacks.append(OOMBackoff())
    if args.clip is not None:
        callbacks.append(GradientClipping(max_norm=args.clip))
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        precision=args.precision,
        limit_val_batches=2,
        val_check_interval=10,
        callbacks=callbacks,
        **{**QUIET, "enable_checkpointing": bool(args.save_at)},
    )
    model = TinyTransformer(dropout=args.dropout, nan_at=args.nan_at, num_samples=args.samples)
    trainer.fit(model, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
