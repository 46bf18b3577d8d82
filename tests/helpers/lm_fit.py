"""Fits of language models people bring (Hugging Face GPT-2, BERT, T5, Llama from a config, a plain tied LM), run as a
script on several processes: ``mgpu_fsdp`` (full or hybrid sharding) or stock DDP, with an ``EMA`` of the weights.

Each model named by ``--models`` trains in turn, in the same processes, into ``<out>/<model>/``; rank 0 writes
``<out>/<model>/result.pt``: the full parameters and averages, the elements each rank held, the units, the process
groups FSDP's all-gathers ran in, and the collectives counted while the EMA's per-step hook ran (plus one barrier at
the end, which shows the counter counts). A model whose ``result.pt``
exists is skipped, which makes a chain of killed runs possible: with ``--kill RANK STEP`` the first model that starts
afresh loses ``RANK`` to SIGKILL at ``STEP``; with ``--resume`` a model resumes from its ``last.ckpt``. Running

    python tests/helpers/lm_fit.py --out X --models gpt2 bert tied --kill 1 6 --resume

again and again kills gpt2, resumes it and kills bert, resumes bert and kills tied, then resumes tied.
"""

import argparse
import functools
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.data import DataLoader, Dataset

from lightning_mgpu import EMA, GradientClipping, MultiGPUStrategy, NaNSkip
from tests.helpers.collectives import count_collectives

VOCAB, LENGTH, SAMPLES, MASK = 128, 16, 48, 1  # 48 samples: 6 steps an epoch on 2 processes of batch 4


def build(name: str) -> nn.Module:
    """A small model of the named family, with dropout off (the references must draw nothing)."""
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=LENGTH)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        return GPT2LMHeadModel(config)
    if name == "bert":
        from transformers import BertConfig, BertForMaskedLM

        return BertForMaskedLM(
            BertConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=LENGTH,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    if name == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
            decoder_start_token_id=0,
        )  # fmt: skip
        return T5ForConditionalGeneration(config)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=LENGTH,
        )
        return LlamaForCausalLM(config)
    if name == "tied":
        return TiedLM()
    raise ValueError(name)


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(self.norm(x)))


class TiedLM(nn.Module):
    """A plain-torch language model whose output projection reuses the input embedding's weight."""

    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(depth))
        self.out = nn.Linear(dim, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.out(x)
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class Tokens(Dataset):
    """Random tokens; for BERT a masked copy and labels only at the masked places (fixed by the seed)."""

    def __init__(self, masked: bool, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(2, VOCAB, (SAMPLES, LENGTH), generator=generator)
        self.inputs, self.labels = self.tokens, self.tokens
        if masked:
            where = torch.rand(SAMPLES, LENGTH, generator=generator) < 0.3
            self.inputs = torch.where(where, torch.full_like(self.tokens, MASK), self.tokens)
            self.labels = torch.where(where, self.tokens, torch.full_like(self.tokens, -100))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


class LanguageModel(pl.LightningModule):
    def __init__(self, name: str, kill: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.name = name
        self.net = build(name)
        self.kill = kill

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.kill is not None and (self.global_rank, self.global_step) == tuple(self.kill):
            os.kill(os.getpid(), signal.SIGKILL)

    def loss(self, batch) -> torch.Tensor:
        inputs, labels = batch
        out = self.net(input_ids=inputs, labels=labels)
        return out if isinstance(out, torch.Tensor) else out.loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, foreach=False)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(masked=self.name == "bert"), batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(masked=self.name == "bert", seed=1), batch_size=4)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


class Counting(Callback):
    """Turns collective counting on (``on=True``) or off in ``on_train_batch_end``: placed around EMA in the list,
    it counts the collectives the EMA's own per-step hook issues, the Python-level ``torch.distributed`` calls and,
    with torch's ``CommDebugMode``, those dispatched below Python (DTensor's)."""

    def __init__(self, state: dict, on: bool) -> None:
        self.state, self.on = state, on

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.state["counting"] = self.on
        if self.on:
            self.state["mode"] = CommDebugMode()
            self.state["mode"].__enter__()
        else:
            mode = self.state.pop("mode")
            mode.__exit__(None, None, None)
            self.state["dispatched"] += mode.get_total_counts()


class Record(Callback):
    def __init__(self, out: Path, counting: dict, calls: dict, gathers: set) -> None:
        self.out, self.counting, self.calls, self.gathers = out, counting, calls, gathers

    def on_fit_end(self, trainer, pl_module):
        self.counting["counting"] = True  # the counter counts: one barrier, beside what EMA's hook issued (nothing)
        dist.barrier()
        self.counting["counting"] = False
        strategy = trainer.strategy
        params = {name: full(param) for name, param in pl_module.named_parameters()}
        local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in pl_module.parameters())
        ema = next(cb for cb in trainer.callbacks if isinstance(cb, EMA))
        averages = ema.full_weights()
        shard_groups = sorted(
            {
                tuple(dist.get_process_group_ranks(p.device_mesh.get_group(p.device_mesh.ndim - 1)))
                for p in pl_module.parameters()
                if hasattr(p, "device_mesh")
            }
        )
        everything = [None] * trainer.world_size
        mine = {"local": local, "shard_groups": shard_groups, "gathers": sorted(self.gathers), "calls": self.calls}
        mine["dispatched"] = self.counting["dispatched"]
        dist.all_gather_object(everything, mine)
        if trainer.global_rank == 0:
            record = {
                "params": params,
                "ema": averages,
                "ema_updates": ema.state_dict().get("updates"),
                "ranks": everything,
                "total_numel": sum(p.numel() for p in params.values()),
                "units": getattr(strategy, "units", None),
                "strategy": type(strategy).__name__,
                "global_step": trainer.global_step,
                # GradientClipping's norm of the last step's gradients, before clipping (nan without --guards)
                "grad_norm": float(trainer.callback_metrics.get("grad_norm", float("nan"))),
            }
            torch.save(record, self.out / "result.pt")


def record_gather_groups(gathers: set) -> None:
    """Note the ranks of every group FSDP all-gathers in (torch 2.13's FSDP2 calls ``all_gather_single``)."""
    original = dist.all_gather_single

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        gathers.add(tuple(dist.get_process_group_ranks(group)) if group is not None else ("default",))
        return original(*args, **kwargs)

    dist.all_gather_single = wrapper


def fit(args: argparse.Namespace, name: str, counting: dict, calls: dict, gathers: set) -> None:
    out = args.out / name
    checkpoints = out / "ckpt"
    resume = args.resume and (checkpoints / "last.ckpt").exists()
    torch.manual_seed(0)
    model = LanguageModel(name, kill=None if resume else args.kill)
    strategy = "ddp" if args.strategy == "ddp" else MultiGPUStrategy(mode="fsdp", sharding=args.strategy)
    callbacks = [
        ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=4, save_last=True, save_top_k=-1),
        Counting(counting, on=True),
        EMA(decay=0.8),
        Counting(counting, on=False),
        Record(out, counting, calls, gathers),
    ]
    if args.guards:  # both read the gradients' global norm: one all-reduce over the shard dimension under FSDP
        callbacks[:0] = [NaNSkip(), GradientClipping(mode="norm", max_norm=0.5)]
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        limit_val_batches=2,
        val_check_interval=5,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    calls.clear()
    gathers.clear()
    counting["dispatched"] = 0
    trainer.fit(model, ckpt_path="last" if resume else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["gpt2"])
    parser.add_argument("--strategy", default="full", choices=["full", "hybrid", "ddp"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--kill", type=int, nargs=2, default=None, help="rank step")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--guards", action="store_true", help="GradientClipping(max_norm=0.5) and NaNSkip() too")
    parser.add_argument("--accelerator", default="cpu", help="cuda: one GPU a process, NCCL")
    args = parser.parse_args()
    torch.set_num_threads(1)
    counting, calls, gathers = {"counting": False, "dispatched": 0}, {}, set()
    count_collectives(calls, lambda: counting["counting"])
    record_gather_groups(gathers)
    for name in args.models:
        (args.out / name).mkdir(parents=True, exist_ok=True)
        if not (args.out / name / "result.pt").exists():
            fit(args, name, counting, calls, gathers)
    if dist.is_initialized():  # stock DDP leaves its group to the interpreter's teardown, which can abort
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
