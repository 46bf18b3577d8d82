"""torchmetrics metrics synchronised across ranks, under ``strategy="mgpu"``.

Each rank validates its half of the data; the metric objects gather their states from every rank when Lightning
computes them at the end of the epoch, so the logged accuracy is the accuracy over the whole validation set.
At the end, rank 0 recomputes it in one process over every validation sample and prints both:

    python examples/synced_metrics.py                 # 2 CPU processes
    python examples/synced_metrics.py --devices 1     # the same number from one process

Synchronized BatchNorm (``sync_batchnorm="auto"``) keeps the BatchNorm running statistics equal on every rank, so
every rank evaluates the same model.
"""

import argparse
import os

import lightning.pytorch as pl
import torch
from blobs import BlobClassifier, SyntheticBlobs
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

import lightning_mgpu  # noqa: F401  (registers strategy="mgpu")

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


class ClassifierWithMetrics(BlobClassifier):
    """``BlobClassifier`` with macro accuracy and F1 as torchmetrics objects (their state syncs across ranks)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        classes = self.hparams.num_classes
        self.val_metrics = MetricCollection(
            {
                "accuracy": MulticlassAccuracy(num_classes=classes, average="micro"),
                "f1": MulticlassF1Score(num_classes=classes, average="macro"),
            },
            prefix="val/",
        )

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_metrics.update(self(x), y)
        # logging the metric objects: Lightning calls compute() at the epoch end, which all-gathers their states
        self.log_dict(self.val_metrics, prog_bar=True)


@torch.no_grad()
def single_process_accuracy(model: pl.LightningModule, data: SyntheticBlobs) -> tuple[float, int]:
    """Accuracy of ``model`` over every validation sample, in this process alone."""
    model.eval()
    features, labels = data.val_set.tensors
    predictions = model(features.to(model.device)).argmax(-1).cpu()
    return (predictions == labels).float().mean().item(), len(labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4100, help="synthetic samples; 10%% validate")
    args = parser.parse_args()

    pl.seed_everything(7, verbose=False)
    model = ClassifierWithMetrics()
    data = SyntheticBlobs(num_samples=args.samples, batch_size=32)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="mgpu",
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    if trainer.is_global_zero:
        synced = trainer.callback_metrics["val/accuracy"].item()
        reference, samples = single_process_accuracy(model, data)
        print(f"val/accuracy synced over {trainer.world_size} ranks: {synced:.6f}")
        print(f"val/accuracy in one process over all {samples} samples: {reference:.6f}")
        print(f"val/f1 (macro) synced: {trainer.callback_metrics['val/f1'].item():.6f}")


if __name__ == "__main__":
    main()
