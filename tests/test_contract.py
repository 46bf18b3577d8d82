"""Every callback of the pack honours the same contract: it builds on a CPU-only machine, survives pickling into
spawned workers, round-trips its state through a checkpoint and can serve two fits in a row."""

import pickle

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mgpu import (
    EMA,
    BatchSizeSearch,
    GPUMemoryMonitor,
    GradientClipping,
    NaNSkip,
    OOMBackoff,
    PerformanceMonitor,
)

CALLBACKS = {
    "clip_norm": lambda: GradientClipping(mode="norm", max_norm=1.0),
    "clip_value": lambda: GradientClipping(mode="value", clip_value=0.1),
    "clip_agc": lambda: GradientClipping(mode="agc", exclude=["layer.bias"]),
    "clip_zscore": lambda: GradientClipping(mode="zscore", warmup_steps=2),
    "nan_skip": lambda: NaNSkip(max_consecutive=3),
    "gpu_memory_monitor": lambda: GPUMemoryMonitor(sample_hz=20, prometheus_port=0),
    "oom_backoff": lambda: OOMBackoff(probe_up_after=2),
    "batch_size_search": lambda: BatchSizeSearch(),
    "performance_monitor": lambda: PerformanceMonitor(prometheus_port=0),
    "ema": lambda: EMA(decay=0.9),
}


def same(a, b) -> bool:
    """Equal states: tensors (an EMA's weights) compared element for element, the rest with ``==``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


class BoringWithBatchSize(BoringModel):
    """BoringModel's loader uses batches of 1; BatchSizeSearch reads that from an attribute."""

    batch_size = 1


@pytest.mark.parametrize("name", sorted(CALLBACKS))
def test_callback_contract(name, tmp_path):
    callback = CALLBACKS[name]()
    clone = pickle.loads(pickle.dumps(callback))
    assert type(clone) is type(callback)

    trainer_kwargs = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "max_steps": 4}
    for _ in range(2):  # the same instance serves two fits
        trainer = Trainer(callbacks=[callback], default_root_dir=tmp_path, **trainer_kwargs)
        trainer.fit(BoringWithBatchSize())
    state = callback.state_dict()
    fresh = CALLBACKS[name]()
    fresh.load_state_dict(state)
    assert same(fresh.state_dict(), state)
    fresh.load_state_dict({})  # an older checkpoint without our keys loads
    path = tmp_path / "contract.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"]
    assert same(saved.get(callback.state_key, {}), state)  # Lightning stores no entry for an empty state
