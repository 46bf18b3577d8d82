"""Train an unmodified LightningModule with ``strategy="mgpu"``: the pack's main example.

Run with no arguments and it trains a small BatchNorm classifier on synthetic data with 2 CPU processes (DDP over
gloo, synchronized BatchNorm switched on automatically), in well under two minutes on 2 cores:

    python examples/train.py

It is a LightningCLI, so every Trainer, model, data and strategy option can be changed from the command line or
a YAML config (omegaconf interpolation works):

    python examples/train.py fit --trainer.devices=4 --trainer.max_epochs=5
    python examples/train.py fit --config my_config.yaml

On a machine with GPUs, ``--trainer.accelerator=cuda`` lets MultiGPUStrategy choose DDP, DataParallel or a single
device by itself (see the README's decision table).
"""

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  (registers strategy="mgpu" and friends)

# Each DDP process gets one thread: 2 processes on 2 cores must not fight over cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


class SyntheticBlobs(pl.LightningDataModule):
    """Gaussian blobs, one per class: learnable in a few epochs, generated from a seed, no download."""

    def __init__(self, num_samples: int = 4096, num_features: int = 32, num_classes: int = 8, batch_size: int = 64):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        h = self.hparams
        centers = torch.randn(h.num_classes, h.num_features, generator=g) * 2
        labels = torch.randint(0, h.num_classes, (h.num_samples,), generator=g)
        features = centers[labels] + torch.randn(h.num_samples, h.num_features, generator=g) * 3.0
        split = int(0.9 * h.num_samples)
        self.train_set = TensorDataset(features[:split], labels[:split])
        self.val_set = TensorDataset(features[split:], labels[split:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class BlobClassifier(pl.LightningModule):
    """An ordinary LightningModule with BatchNorm: nothing in it knows about lightning_mgpu."""

    def __init__(self, num_features: int = 32, num_classes: int = 8, hidden: int = 128, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(num_features, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class ReportChoice(pl.Callback):
    """Print, once, which strategy MultiGPUStrategy chose and the final validation metrics."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            choice = getattr(trainer.strategy, "choice", None)
            metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
            print(
                f"strategy: {type(trainer.strategy).__name__} ({choice.mode if choice else 'n/a'}); "
                f"processes: {trainer.world_size}; metrics: {metrics}"
            )


EMBEDDED_DEFAULTS = {
    "accelerator": "cpu",
    "devices": 2,
    "strategy": "mgpu",
    "max_epochs": 3,
    "logger": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
    "callbacks": [ReportChoice()],
}


def main(args: list[str] | None = None) -> None:
    LightningCLI(
        BlobClassifier,
        SyntheticBlobs,
        trainer_defaults=EMBEDDED_DEFAULTS,
        parser_kwargs={"parser_mode": "omegaconf"},
        seed_everything_default=42,
        save_config_kwargs={"overwrite": True},  # the example may be re-run in the same folder
        args=args,
    )


if __name__ == "__main__":
    # no arguments: run `fit` with the embedded defaults (Lightning re-runs this same command line in its workers)
    main(sys.argv[1:] or ["fit"])
