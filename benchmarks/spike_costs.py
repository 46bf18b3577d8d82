"""What NaNSkip's spike detection and rollback snapshots cost, measured directly (no training loop noise).

The model is callback_overhead.py's (MLP 1024-BN-1024-BN-10, 2.1M parameters) after one optimizer step, so the
optimizer state exists. Measured, 1 thread:

- spike detection: one test and one update of the loss window and of the gradient-norm window, as NaNSkip runs them
  every optimizer step (median of 2000);
- a rollback snapshot (``TrainingSnapshot.take``) and a rollback (``restore``) with SGD-momentum and with Adam
  (median of 50), and the host memory a snapshot holds;
- an optimizer step skippable on the device (``NaNSkip(skip_on_device=...)``), against the same optimizer's plain step
  and its step after a host read of the verdict (median of 300, rounds alternated): Adam (foreach) through its fused
  kernel with ``found_inf``, and Adam and RMSprop with the masked step (backup, step, ``torch.where``), with the
  device memory the backup holds.

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

    from lightning_mgpu.stability.device_skip import FusedRoute, MaskedStep
    from lightning_mgpu.stability.spike_window import SpikeWindow
    from lightning_mgpu.stability.training_snapshot import TrainingSnapshot

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

    def benchmark_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 1024), nn.BatchNorm1d(1024),
            nn.ReLU(), nn.Linear(1024, 10),
        ).to(device)  # fmt: skip

    for name in ("sgd", "adam"):
        model = benchmark_model()
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

    # skipping on the device: each way's optimizer step (verdict: not bad), timed to completion
    def stepper(name: str, way: str):
        model = benchmark_model()
        if name == "adam":
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        else:
            optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.5, capturable=cuda)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizer.step()  # the state exists
        good = torch.zeros((), dtype=torch.bool, device=device)
        mask = MaskedStep(optimizer) if way == "masked" else None
        if way == "fused":
            FusedRoute(optimizer)

        def step() -> None:
            if way == "host read" and bool(good):
                return
            if way == "fused":
                optimizer.found_inf = good.float()
            if mask is not None:
                mask.arm(params, good)
            optimizer.step()

        return step, mask

    ways = [("adam", "plain"), ("adam", "host read"), ("adam", "fused"), ("adam", "masked")]
    ways += [("rmsprop", "plain"), ("rmsprop", "masked")]
    steppers = {key: stepper(*key) for key in ways}
    step_times: dict = {key: [] for key in ways}
    for _round in range(6):
        for key, (step, _) in steppers.items():
            for i in range(55):
                sync()
                start = time.perf_counter()
                step()
                sync()
                if i >= 5:
                    step_times[key].append(time.perf_counter() - start)
    for (name, way), times in step_times.items():
        plain = statistics.median(step_times[(name, "plain")])
        mask = steppers[(name, way)][1]
        held = f"; backup {mask.nbytes / 2**20:.1f} MB on the device" if mask is not None else ""
        print(
            f"{name} step, {way}: {1e3 * statistics.median(times):.2f} ms "
            f"({statistics.median(times) / plain:.2f}x the plain step){held}"
        )


if __name__ == "__main__":
    sys.exit(main())
