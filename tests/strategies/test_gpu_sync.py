"""Our per-step code adds no host-device synchronisation on CUDA; skipped without a GPU."""

import signal
import warnings

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer

from lightning_mgpu import MultiGPUStrategy
from lightning_mgpu.strategies.preemption import SigtermAgreement
from tests.helpers.models import BatchNormClassifier
from tests.helpers.runif import run_if
from tests.helpers.trainer import QUIET


class WatchSyncsFrom(Callback):
    """Turns torch's sync debug mode to "warn" from batch ``start`` on: every host sync becomes a warning."""

    def __init__(self, start: int) -> None:
        self.start = start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.start:
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer, pl_module):
        torch.cuda.set_sync_debug_mode(0)


@run_if(min_cuda_gpus=1)
def test_steady_state_steps_cause_no_host_sync_in_our_code():
    model = BatchNormClassifier(per_rank_batch=(16,), steps=12)
    trainer = Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=12,
        callbacks=[WatchSyncsFrom(start=5)],
        strategy=MultiGPUStrategy(mode="ddp", sync_batchnorm=True, comm_hook="powersgd", powersgd_warmup_steps=2),
        **QUIET,
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        if dist.is_initialized():
            dist.destroy_process_group()
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in syncs if "lightning_mgpu" in w.filename]
    print(f"host syncs in steady state: {len(syncs)} in total, {len(ours)} from lightning_mgpu")
    assert not ours


@run_if(min_cuda_gpus=1)
@pytest.mark.parametrize("cuda_events", [False, True])
def test_sigterm_agreement_check_causes_no_host_sync(cuda_events):
    torch.zeros(1, device="cuda")  # CUDA initialised, as in training
    agreement = SigtermAgreement(dist.HashStore(), margin=2, interval=1, cuda=cuda_events)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            agreement.at_batch_boundary()
        agreement.on_sigterm(signal.SIGTERM, None)
        agreement.at_batch_boundary()
        assert agreement.stop_batch == (7 if cuda_events else 6)  # one interval later with event-lagged reads
    finally:
        torch.cuda.set_sync_debug_mode(0)


@run_if(min_cuda_gpus=1)
def test_stability_callbacks_cause_no_host_sync_with_a_fused_optimizer():
    from lightning_mgpu import GradientClipping, NaNSkip

    model = BatchNormClassifier(
        per_rank_batch=(16,), steps=12, lr=0.01, optimizer="adam_fused", inject=("grad_inf", 0, 8)
    )
    trainer = Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=12,
        callbacks=[WatchSyncsFrom(start=5), NaNSkip(), GradientClipping(mode="zscore", warmup_steps=3)],
        **QUIET,
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ours = [
        f"{w.filename}:{w.lineno}"
        for w in caught
        if "synchroniz" in str(w.message).lower() and "lightning_mgpu" in w.filename
    ]
    assert not ours
    assert next(c for c in trainer.callbacks if isinstance(c, NaNSkip)).skipped_steps == 1


@run_if(min_cuda_gpus=1)
def test_nanskip_counts_gradscaler_skips_under_16_mixed():
    from lightning_mgpu import NaNSkip

    skip = NaNSkip()
    trainer = Trainer(
        accelerator="cuda",
        devices=1,
        precision="16-mixed",
        max_steps=8,
        callbacks=[skip],
        **QUIET,
    )
    trainer.fit(BatchNormClassifier(per_rank_batch=(16,), steps=8, inject=("grad_inf", 0, 4)))
    assert skip.skipped_steps >= 1  # the injected one, plus any the scaler skipped while calibrating
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
