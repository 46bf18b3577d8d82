"""The real multi-replica DataParallel path and CUDA-side decisions; skipped without CUDA GPUs."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DataParallelStrategy, MultiGPUStrategy
from tests.ddp.test_data_parallel import BATCH, Regressor, data
from tests.helpers.runif import run_if
from tests.helpers.trainer import QUIET


def fit_dp(model, devices, precision="32-true", steps=1):
    x, y = data()
    trainer = Trainer(
        accelerator="cuda",
        devices=devices,
        strategy=DataParallelStrategy(),
        precision=precision,
        max_steps=steps,
        **QUIET,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return trainer


@run_if(min_cuda_gpus=2)
def test_two_gpu_step_equals_one_device_on_the_whole_batch():
    model = Regressor()
    reference = copy.deepcopy(model)
    x, y = data()
    ref_loss = nn.functional.mse_loss(reference.layer(x), y)
    ref_loss.backward()
    expected_weight = (reference.layer.weight - 0.1 * reference.layer.weight.grad).detach()

    trainer = fit_dp(model, devices=2)

    assert isinstance(trainer.strategy.model, nn.Module)
    torch.testing.assert_close(trainer.callback_metrics["train_loss"].cpu(), ref_loss.detach(), atol=1e-5, rtol=1e-4)
    assert float(trainer.callback_metrics["samples"]) == BATCH
    torch.testing.assert_close(model.layer.weight.detach().cpu(), expected_weight, atol=1e-5, rtol=1e-4)
    assert model.batch_outputs[0]["preds"].shape == (BATCH, 1)


@run_if(min_cuda_gpus=1)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_trains(precision):
    devices = min(torch.cuda.device_count(), 2)
    model = Regressor()
    trainer = fit_dp(model, devices=devices, precision=precision, steps=3)
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


@run_if(min_cuda_gpus=1)
def test_building_the_trainer_does_not_initialise_cuda():
    code = textwrap.dedent(
        """
        import torch, lightning_mgpu
        from lightning.pytorch import Trainer
        trainer = Trainer(strategy="mgpu", accelerator="cuda", devices=1, logger=False)
        print(trainer.strategy.choice.mode, torch.cuda.is_initialized())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["single", "False"]


@run_if(min_cuda_gpus=2)
def test_interactive_session_with_cuda_initialised_chooses_dataparallel():
    code = textwrap.dedent(
        """
        import sys, torch, lightning_mgpu
        from lightning.pytorch import Trainer
        sys.ps1 = ">>> "
        torch.zeros(1, device="cuda")
        trainer = Trainer(strategy="mgpu", accelerator="cuda", devices=2, logger=False)
        print(type(trainer.strategy).__name__, trainer.strategy.choice.mode)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["DataParallelStrategy", "dp"]


@run_if(min_cuda_gpus=2)
def test_multigpu_dp_mode_fits():
    model = Regressor()
    trainer = Trainer(
        accelerator="cuda",
        devices=2,
        strategy=MultiGPUStrategy(mode="dp"),
        max_steps=2,
        **QUIET,
    )
    x, y = data()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.global_step == 2
