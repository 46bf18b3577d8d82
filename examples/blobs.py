"""The examples' model and data: Gaussian blobs and a small classifier with BatchNorm.

Nothing here knows about lightning_mgpu: it is the ordinary LightningModule a user brings.
"""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SyntheticBlobs(pl.LightningDataModule):
    """Gaussian blobs, one per class: learnable in a few epochs, generated from a seed, no download.

    Args:
        num_samples: samples in total; 90% train, 10% validation.
        num_features: features per sample.
        num_classes: number of blobs.
        batch_size: samples per batch, per process.
    """

    def __init__(self, num_samples: int = 4096, num_features: int = 32, num_classes: int = 8, batch_size: int = 64):
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size  # an attribute, so OOMBackoff(keep_effective_batch=False) can change it

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
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class BlobClassifier(pl.LightningModule):
    """An MLP with BatchNorm, trained with cross-entropy and SGD with momentum.

    Args:
        num_features: input features.
        num_classes: output classes.
        hidden: width of the two hidden layers.
        lr: learning rate.
    """

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
