"""What NaNSkip's spike detection and rollback snapshots cost, measured directly (no training loop noise).

The model is callback_overhead.py's (MLP 1024-BN-1024-BN-10, 2.1M parameters) after one optimizer step, so the
optimizer state exists. Measured, 1 thread:

- spike detection: one test and one update of the loss window and of the gradient-norm window, as NaNSkip runs them
  every optimizer step (median of 2000);
- a rollback snapshot (``TrainingSnapshot.take``) and a rollback (``restore``) with SGD-momentum and with Adam
  (median of 50), and the host memory a snapshot holds.

    python benchmarks/spike_costs.py
    python benchmarks/spike_costs.py --accelerator cuda
"""

import argparse
import statistics
import sys
import time

from _common import describe_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    import torch
    from torch import nn

    from lightning_mgpu.utilities.spike_window import SpikeWindow
    from lightning_mgpu.utilities.training_snapshot import TrainingSnapshot

    torch.set_num_threads(1)
    device = torch.device(args.accelerator)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()  # the benchmark's own clock

    print(f"machine: {describe_machine()}")
    windows = [SpikeWindow(rows=1, size=128, zscore=6.0) for _ in range(2)]
    value = torch.tensor([1.0], device=device)
    times = []
    for i in range(2200):
        value = value + 0.001
        sync()
        start = time.perf_counter()
        bad = windows[0].is_spike(value)[0] | windows[1].is_spike(value)[0]
        for window in windows:
            window.update(value, ~bad)
        sync()
        if i >= 200:
            times.append(time.perf_counter() - start)
    print(f"spike detection, loss and gradient-norm windows of 128: {1e6 * statistics.median(times):.0f} us per step")

    for name in ("sgd", "adam"):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 1024), nn.BatchNorm1d(1024),
            nn.ReLU(), nn.Linear(1024, 10),
        ).to(device)  # fmt: skip
        if name == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = torch.randn(64, 1024, device=device), torch.zeros(64, dtype=torch.long, device=device)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        snapshot = TrainingSnapshot(model, [optimizer])
        takes, restores = [], []
        for i in range(55):
            sync()
            start = time.perf_counter()
            snapshot.take(step=i)
            sync()
            middle = time.perf_counter()
            snapshot.restore()
            sync()
            if i >= 5:
                takes.append(middle - start)
                restores.append(time.perf_counter() - middle)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        print(
            f"snapshot with {name}: {snapshot.nbytes / 2**20:.1f} MB held ({snapshot.nbytes / params:.2f}x the "
            f"parameters' bytes); take {1e3 * statistics.median(takes):.2f} ms, "
            f"restore {1e3 * statistics.median(restores):.2f} ms (to completion)"
        )


if __name__ == "__main__":
    sys.exit(main())
