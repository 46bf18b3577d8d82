"""FSDP2 on CUDA (NCCL): the sharded fit against DDP, bf16 mixed precision, and CPU offload. Skipped without GPUs."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_mgpu import MultiGPUStrategy
from tests.helpers.processes import run_script
from tests.helpers.runif import run_if
from tests.helpers.tiny_transformer import TinyTransformer
from tests.helpers.trainer import QUIET

SCRIPT = Path(__file__).parents[1] / "helpers" / "sharded_fit.py"


def fit(out: Path, *args: object) -> dict:
    result = run_script(SCRIPT, "--out", out, "--accelerator", "cuda", *args, timeout=300)
    assert not result["hung"] and result["rc"] == 0, result["output"][-4000:]
    return torch.load(out / "result.pt", weights_only=False)


@pytest.mark.distributed
@run_if(min_cuda_gpus=2)
def test_nccl_fsdp_matches_ddp_with_half_the_parameters(tmp_path):
    sharded = fit(tmp_path / "fsdp", "--steps", 20)
    reference = fit(tmp_path / "ddp", "--strategy", "ddp", "--steps", 20)
    assert sharded["local_numel"] == [sharded["total_numel"] // 2] * 2
    for name, value in sharded["params"].items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
@run_if(min_cuda_gpus=2)
def test_nccl_fsdp_bf16_mixed_and_clipping_train(tmp_path):
    record = fit(tmp_path / "bf16", "--steps", 20, "--precision", "bf16-mixed", "--clip", 0.5)
    assert all(torch.isfinite(value).all() and value.dtype == torch.float32 for value in record["params"].values())


@run_if(min_cuda_gpus=1)
def test_cpu_offload_keeps_shards_in_host_memory():
    torch.manual_seed(0)
    model = TinyTransformer()
    strategy = MultiGPUStrategy(mode="fsdp", cpu_offload=True)
    trainer = Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=3, **QUIET)
    trainer.fit(model)
    assert {param.device.type for param in model.parameters()} == {"cpu"}
    assert trainer.global_step == 3
