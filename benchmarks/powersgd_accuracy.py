"""What PowerSGD gradient compression costs in accuracy, on a small real task, 2 CPU processes.

Task: scikit-learn's 8x8 handwritten digits (1,797 images shipped inside the package, no download), a fixed
80/20 split, an MLP 64-512-512-10, SGD with momentum, batch 32 per process, the same seed for every configuration.
Each configuration trains the same number of epochs with ``strategy="mgpu"``-family DDP; the script prints the mean
training loss of every epoch and the final test accuracy side by side:

    pip install scikit-learn
    python benchmarks/powersgd_accuracy.py --epochs 15

Speed is measured separately by ``benchmarks/ddp_throughput.py``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import add_json_out, ratio_row, write_rows

CONFIGS = {
    # name: MultiGPUStrategy arguments
    "no_compression": {},
    "powersgd_rank1": {"comm_hook": "powersgd", "powersgd_rank": 1, "powersgd_warmup_steps": 20},
    "powersgd_rank4": {"comm_hook": "powersgd", "powersgd_rank": 4, "powersgd_warmup_steps": 20},
}


def worker(name: str, epochs: int, out: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import lightning.pytorch as pl
    import torch
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mgpu import MultiGPUStrategy

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    split = int(0.8 * len(x))
    train, test = order[:split], order[split:]

    class DigitsMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            loss = nn.functional.cross_entropy(self.net(inputs), targets)
            self.losses.append(float(loss.detach()))  # CPU: no device sync to worry about
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    model = DigitsMLP()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MultiGPUStrategy(mode="ddp", **CONFIGS[name]),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x[train], y[train]), batch_size=32, shuffle=True))
    if trainer.is_global_zero:
        with torch.no_grad():
            accuracy = (model.net(x[test]).argmax(-1) == y[test]).float().mean().item()
        steps_per_epoch = len(model.losses) // epochs
        epoch_losses = [
            sum(model.losses[e * steps_per_epoch : (e + 1) * steps_per_epoch]) / steps_per_epoch for e in range(epochs)
        ]
        out.write_text(json.dumps({"epoch_losses": epoch_losses, "test_accuracy": accuracy}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=15)
    add_json_out(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.epochs, args.out)
        return

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CONFIGS:
            out = Path(tmp) / f"{name}.json"
            command = [sys.executable, __file__, "--worker", name, "--epochs", str(args.epochs), "--out", str(out)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
            if not out.exists():
                raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
            results[name] = json.loads(out.read_text())

    print(f"digits (sklearn), MLP 64-512-512-10, 2 processes x batch 32, SGD momentum 0.9, {args.epochs} epochs")
    print("mean training loss per epoch (rank 0):")
    print("epoch  " + "  ".join(f"{name:>15}" for name in results))
    for epoch in range(args.epochs):
        print(f"{epoch + 1:>5}  " + "  ".join(f"{r['epoch_losses'][epoch]:>15.4f}" for r in results.values()))
    print("test accuracy " + "  ".join(f"{name}: {r['test_accuracy']:.4f}" for name, r in results.items()))
    exact = results["no_compression"]["test_accuracy"]
    rows = [
        ratio_row(
            "powersgd_accuracy",
            name,
            f"test accuracy vs no compression, {args.epochs} epochs",
            [results[name]["test_accuracy"] / exact],
            "higher",
            'MultiGPUStrategy(mode="ddp"), no comm hook, same seed',
        )
        for name in list(CONFIGS)[1:]
    ]
    write_rows(args.json_out, rows)


if __name__ == "__main__":
    main()
