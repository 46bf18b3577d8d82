"""Our per-step code adds no host-device synchronisation on CUDA; skipped without a GPU (but for the check of how a
sync is attributed, which runs anywhere)."""

import contextlib
import os
import signal
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer

import lightning_mgpu
from lightning_mgpu import MultiGPUStrategy
from lightning_mgpu.long_runs.preemption import SigtermAgreement
from tests.helpers.models import BatchNormClassifier
from tests.helpers.runif import run_if
from tests.helpers.trainer import QUIET

PACK_DIR = str(Path(lightning_mgpu.__file__).parent) + os.sep
TORCH_DIR = str(Path(torch.__file__).parent) + os.sep
STDLIB_DIR = str(Path(os.__file__).parent) + os.sep


class HostSync(NamedTuple):
    """One warning of torch's sync debug mode, with the Python stack that raised it (innermost frame last)."""

    message: str
    filename: str  # where the warning says it comes from: the innermost Python frame
    stack: traceback.StackSummary

    def innermost_caller(self) -> traceback.FrameSummary | None:
        """The innermost frame that is neither torch's nor the standard library's: the code that asked for the sync,
        directly or through a torch helper (``clip_grad_norm_``, a ``Tensor`` method, a ``no_grad`` wrapper...)."""
        for frame in reversed(self.stack):
            in_stdlib = frame.filename.startswith(STDLIB_DIR) and "site-packages" not in frame.filename
            if not (frame.filename.startswith(TORCH_DIR) or in_stdlib):
                return frame
        return None

    def caused_by_the_pack(self) -> bool:
        frame = self.innermost_caller()
        return frame is not None and frame.filename.startswith(PACK_DIR)

    def __str__(self) -> str:
        frame = self.innermost_caller()
        where = f"{frame.filename}:{frame.lineno}" if frame is not None else "?"
        return f"{where}: {self.message}"


@contextlib.contextmanager
def recording_host_syncs() -> Iterator[list[HostSync]]:
    """Record every host-sync warning raised in the block, with its stack (the warning's own file and line name only
    the innermost Python frame, a torch helper's when the pack syncs through one)."""
    syncs: list[HostSync] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            # this function and the warnings module's frames are left out by innermost_caller (standard library)
            syncs.append(HostSync(str(message), filename, traceback.extract_stack()[:-1]))

    with warnings.catch_warnings():  # restores warnings.showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        yield syncs


def _function_in(directory: str, name: str, source: str, namespace: dict) -> None:
    """Define ``name`` from ``source`` as if it were written in a file of ``directory`` (its frames say so)."""
    exec(compile(source, os.path.join(directory, f"_{name}_for_test.py"), "exec"), namespace)


def test_a_sync_the_pack_causes_through_a_torch_helper_counts_as_the_packs():
    namespace: dict = {"warnings": warnings}
    _function_in(
        TORCH_DIR, "torch_helper", "def torch_helper():\n    warnings.warn('called a synchronizing op')\n", namespace
    )
    _function_in(PACK_DIR, "pack_step", "def pack_step():\n    torch_helper()\n", namespace)
    _function_in(
        PACK_DIR, "pack_direct", "def pack_direct():\n    warnings.warn('called a synchronizing op')\n", namespace
    )
    _function_in(str(Path(__file__).parent), "user_step", "def user_step():\n    torch_helper()\n", namespace)
    with recording_host_syncs() as syncs:
        namespace["pack_step"]()  # the pack, through a torch helper
        namespace["pack_direct"]()  # the pack itself
        namespace["user_step"]()  # the user's model, through the same helper
    assert [sync.caused_by_the_pack() for sync in syncs] == [True, True, False]
    # what the warning alone says: the torch helper's file, for the pack's sync and the user's alike
    assert [sync.filename.startswith(PACK_DIR) for sync in syncs] == [False, True, False]


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
        with recording_host_syncs() as syncs:
            trainer.fit(model)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        if dist.is_initialized():
            dist.destroy_process_group()
    ours = [str(sync) for sync in syncs if sync.caused_by_the_pack()]
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
        with recording_host_syncs() as syncs:
            trainer.fit(model)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ours = [str(sync) for sync in syncs if sync.caused_by_the_pack()]
    assert not ours
    assert next(c for c in trainer.callbacks if isinstance(c, NaNSkip)).skipped_steps == 1


@run_if(min_cuda_gpus=1)
def test_nanskip_counts_gradscaler_skips_under_16_mixed():
    from lightning_mgpu import NaNSkip

    class ScalerSkips(Callback):
        """The optimizer steps the GradScaler skipped: it halves its scale at every step it skips for an Inf or NaN
        (and grows it only after 2000 good steps)."""

        def __init__(self):
            self.steps: list[int] = []
            self.scale = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.scale = trainer.precision_plugin.scaler.get_scale()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.precision_plugin.scaler.get_scale() < self.scale:  # the scale dropped: the step was skipped
                self.steps.append(batch_idx)

    skip, scaler_skips = NaNSkip(), ScalerSkips()
    trainer = Trainer(
        accelerator="cuda",
        devices=1,
        precision="16-mixed",
        max_steps=8,
        callbacks=[skip, scaler_skips],
        **QUIET,
    )
    trainer.fit(BatchNormClassifier(per_rank_batch=(16,), steps=8, inject=("grad_inf", 0, 4)))
    # the injected one, and each the scaler skipped while calibrating its scale: every one counted, and once
    assert 4 in scaler_skips.steps
    assert skip.skipped_steps == len(scaler_skips.steps)
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
