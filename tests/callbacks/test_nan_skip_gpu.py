"""NaNSkip's spike detection on CUDA: decided on the device, with no host synchronisation on the step path.

Run on a machine with GPUs: ``pytest -m cuda tests/callbacks/test_nan_skip_gpu.py`` (or
``python -m lightning_mgpu check --gpu-tests``).
"""

import torch
from lightning.pytorch import Callback, Trainer

from lightning_mgpu import NaNSkip
from tests.helpers.models import BatchNormClassifier
from tests.helpers.runif import run_if
from tests.helpers.trainer import QUIET


class SyncErrorsInStepHooks(Callback):
    """Turns CUDA's sync debug mode to "error" from the batch start to the end of the optimizer step's hooks."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("default")


@run_if(min_cuda_gpus=1)
def test_spike_detection_with_fused_adam_takes_no_host_sync_and_skips_the_spike():
    skip = NaNSkip(spike_zscore=6.0, spike_window=20, log_skipped=False, progress_bar=False, max_consecutive=None)
    # NaNSkip runs inside the window in which any synchronisation raises; the loader's copy to the GPU runs before it
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=36, callbacks=[SyncErrorsInStepHooks(), skip], **QUIET)
    model = BatchNormClassifier((8,), steps=36, lr=0.01, optimizer="adam_fused", inject=("loss_spike", 0, 30))
    try:
        trainer.fit(model)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (skip.skipped_steps, skip.spiked_steps) == (1, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
