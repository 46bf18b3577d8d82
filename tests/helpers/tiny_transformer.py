"""A transformer-style LightningModule with repeated blocks and no ``configure_model``, for FSDP to shard unmodified."""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, DIM, CONTEXT = 32, 16, 8


class Block(nn.Module):
    def __init__(self, dim: int = DIM, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Tokens(Dataset):
    def __init__(self, num_samples: int = 256, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (num_samples, CONTEXT + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index, :-1], self.tokens[index, 1:]


class TinyTransformer(pl.LightningModule):
    """Embedding, ``depth`` residual MLP blocks, a final norm and a head; next-token cross entropy, AdamW.

    ``nan_at``: (rank, step) whose loss is made NaN; ``wide``: a larger model for memory measurements.
    """

    def __init__(
        self,
        depth: int = 4,
        dim: int = DIM,
        lr: float = 1e-2,
        batch_size: int = 4,
        dropout: float = 0.0,
        nan_at: tuple[int, int] | None = None,
        num_samples: int = 256,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.lr = lr
        self.batch_size = batch_size
        self.nan_at = nan_at
        self.num_samples = num_samples

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if self.nan_at is not None and (self.global_rank, self.global_step) == tuple(self.nan_at):
            loss = loss * float("nan")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val_loss", nn.functional.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=False)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(self.num_samples), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(32, seed=1), batch_size=self.batch_size)


class PlainTransformer(nn.Module):
    """The same layers as :class:`TinyTransformer` in a plain ``nn.Module``: what an exported checkpoint loads into."""

    def __init__(self, depth: int = 4, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
