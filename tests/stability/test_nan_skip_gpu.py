"""NaNSkip's spike detection on CUDA: decided on the device, with no host synchronisation on the step path.

Run on a machine with GPUs: ``pytest -m cuda tests/stability/test_nan_skip_gpu.py`` (or
``python -m lightning_mgpu check --gpu-tests``).
"""

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_mgpu import NaNSkip
from tests.helpers.models import BatchNormClassifier
from tests.helpers.runif import run_if
from tests.helpers.trainer import QUIET


class SyncErrorsInStepHooks(Callback):
    """Turns CUDA's sync debug mode to "error" from the batch start to the end of the optimizer step's hooks."""

    def __init__(self, after_step: int = 0) -> None:
        self.after_step = after_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.after_step:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("default")


def fit_and_check_one_spike_skipped(trainer, model, skip):
    try:
        trainer.fit(model)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (skip.skipped_steps, skip.spiked_steps) == (1, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@run_if(min_cuda_gpus=1)
def test_spike_detection_with_fused_adam_takes_no_host_sync_and_skips_the_spike():
    skip = NaNSkip(spike_zscore=6.0, spike_window=20, log_skipped=False, progress_bar=False, max_consecutive=None)
    # NaNSkip runs inside the window in which any synchronisation raises; the loader's copy to the GPU runs before it
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=36, callbacks=[SyncErrorsInStepHooks(), skip], **QUIET)
    model = BatchNormClassifier((8,), steps=36, lr=0.01, optimizer="adam_fused", inject=("loss_spike", 0, 30))
    fit_and_check_one_spike_skipped(trainer, model, skip)


class CapturableRMSprop(BatchNormClassifier):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=self.lr, momentum=0.5, capturable=True)


@run_if(min_cuda_gpus=1)
@pytest.mark.parametrize("optimizer", ["adam_foreach", "adamw_forloop", "sgd_foreach", "rmsprop_capturable"])
def test_a_non_fused_optimizer_skips_on_the_device_with_no_host_sync(optimizer):
    # Adam, AdamW and SGD step through their fused kernels ("auto" on CUDA); RMSprop's step is masked (its counters
    # are on the GPU with capturable=True). The first step, which creates the optimizer state, runs before the window
    # of sync errors opens
    skip = NaNSkip(
        spike_zscore=6.0,
        spike_window=20,
        log_skipped=False,
        progress_bar=False,
        skip_on_device=True if optimizer == "rmsprop_capturable" else "auto",
    )
    window = SyncErrorsInStepHooks(after_step=1)
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=36, callbacks=[window, skip], **QUIET)
    kwargs = {"steps": 36, "lr": 0.01, "inject": ("loss_spike", 0, 30)}
    if optimizer == "rmsprop_capturable":
        model = CapturableRMSprop((8,), **kwargs)
    else:
        model = BatchNormClassifier((8,), optimizer=optimizer, **kwargs)
    fit_and_check_one_spike_skipped(trainer, model, skip)
    group = trainer.optimizers[0].param_groups[0]
    assert group.get("fused") in (None, False)  # the user's settings are back
    steps = [s["step"] for s in trainer.optimizers[0].state.values() if "step" in s]
    if optimizer.startswith("adam"):
        assert all(step.device.type == "cpu" and float(step) == 35 for step in steps)  # back on the host, 1 skipped
