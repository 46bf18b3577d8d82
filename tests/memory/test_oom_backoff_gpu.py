"""OOMBackoff with real CUDA out-of-memory errors: the process is limited with
``torch.cuda.set_per_process_memory_fraction`` so that a full batch does not fit and half of it does."""

import gc
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MultiGPUStrategy, OOMBackoff
from tests.helpers.models import load_rank_dumps
from tests.helpers.processes import run_script
from tests.helpers.runif import run_if
from tests.helpers.trainer import QUIET

BATCH = 64
WIDTH = 8192


class WideActivations(LightningModule):
    """Activations of BATCH x ``expand`` x WIDTH floats per layer: memory grows with the batch."""

    def __init__(self, expand: int = 64) -> None:
        super().__init__()
        self.expand = expand
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(256, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        # widen the activation per sample on purpose: (B, expand, WIDTH) floats through the hidden layers
        hidden = self.net[:4](x.unsqueeze(1).expand(-1, self.expand, -1))
        return nn.functional.mse_loss(self.net[4](hidden).mean(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(4 * BATCH, 256, generator=g), torch.randn(4 * BATCH, 1, generator=g))
        return DataLoader(data, batch_size=BATCH)


def activation_bytes(samples: int) -> int:
    return samples * 64 * WIDTH * 4 * 4  # four (B, 64, WIDTH) float tensors live for the backward


def step_memory(samples: int, pieces: int, expand: int) -> tuple[int, int]:
    """Peak bytes allocated and reserved by ``pieces`` forward and backward passes of ``samples`` each, the earlier
    gradients set aside during each later backward, as OOMBackoff's micro-batches do (a new model, no optimizer)."""
    model = WideActivations(expand).cuda()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(0)
    for _ in range(pieces):
        earlier = [p.grad for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        batch = (torch.randn(samples, 256, device="cuda"), torch.randn(samples, 1, device="cuda"))
        model.training_step(batch, 0).backward()
        for p, grad in zip(model.parameters(), earlier, strict=True):
            if grad is not None:
                p.grad += grad
        del batch, earlier
    peaks = torch.cuda.max_memory_allocated(0), torch.cuda.max_memory_reserved(0)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return peaks


@run_if(min_cuda_gpus=1)
def test_a_real_cuda_oom_is_recovered_and_training_finishes(tmp_path):
    # measured here, not estimated (sized from estimates, a whole batch fitted when the test ran alone on an H100):
    # the budget lies halfway between what two half batches reserve (OOMBackoff's micro-batches, the first one's
    # gradients set aside) and the least a whole batch allocates; activations 4x wider than the DDP test's, so that
    # they, not the gradients, decide
    expand = 256
    _, half = step_memory(BATCH // 2, 2, expand)
    whole, _ = step_memory(BATCH, 1, expand)
    assert whole - half > 2**29, (half, whole)  # over 256 MiB on each side of the budget
    budget = (half + whole) // 2
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    try:
        backoff = OOMBackoff()
        trainer = Trainer(
            accelerator="cuda", devices=1, max_epochs=1, callbacks=[backoff], default_root_dir=tmp_path, **QUIET
        )
        trainer.fit(WideActivations(expand))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert trainer.global_step == 4
    assert backoff.recoveries >= 1
    assert backoff.micro_batch_size is not None and backoff.micro_batch_size < BATCH
    print(
        f"device={torch.cuda.get_device_name(0)} budget={budget / 2**30:.2f} GiB (half {half / 2**30:.2f},"
        f" whole {whole / 2**30:.2f})"
        f" micro_batch_size={backoff.micro_batch_size} recoveries={backoff.recoveries}"
        f" max_allocated={torch.cuda.max_memory_allocated(0) / 2**30:.2f} GiB"
    )


@run_if(min_cuda_gpus=1)
def test_a_real_cuda_oom_under_a_ddp_wrap_is_finished_and_recovered(tmp_path):
    # one NCCL process, the model wrapped in DDP with the step flag in its reduction: the failed backward's
    # reduction is finished with zeros (DDP's reducer would refuse the next step otherwise), then micro-batches
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    params = (256 * WIDTH + WIDTH * WIDTH + WIDTH) * 4 * 4  # weights, grads, DDP's buckets and slack
    budget = params + int(0.75 * activation_bytes(BATCH))
    torch.cuda.set_per_process_memory_fraction(min(0.95, budget / total), 0)
    try:
        backoff = OOMBackoff()
        trainer = Trainer(
            accelerator="cuda",
            devices=1,
            strategy=MultiGPUStrategy(mode="ddp"),
            max_epochs=1,
            callbacks=[backoff],
            default_root_dir=tmp_path,
            **QUIET,
        )
        trainer.fit(WideActivations())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert not trainer.strategy.step_service_started  # the fit's service, and its flag, ended at teardown
    assert backoff.recoveries >= 1
    assert backoff.micro_batch_size is not None and backoff.micro_batch_size < BATCH
    assert trainer.global_step == 4


@pytest.mark.distributed
@run_if(min_cuda_gpus=2)
def test_two_gpu_accumulation_windows_run_whole_and_recover_an_oom_on_one_rank(tmp_path):
    # NCCL: the window's last batch adds the first batch's gradients into DDP's buckets on the GPU; with no OOM the
    # parameters equal mgpu alone's (gradients as bucket views too), and an OOM on rank 1 in either batch of the
    # window is recovered on both ranks
    script = Path(__file__).parents[1] / "helpers" / "oom_fit.py"
    runs = {}
    cases = {
        "alone": ("--inject", "none", "--no-backoff"),
        "none": ("--inject", "none"),
        "first": ("--inject", "backward", "--oom-batches", 0),
        "last": ("--inject", "backward", "--oom-from-batch", 1),
        "reference": ("--inject", "none", "--no-backoff", "--batch-size", 4, "--accumulate", 4),
        # gradients kept as views of DDP's buckets (zero_grad(set_to_none=False)): set aside as copies
        "views": ("--inject", "none", "--model", "keeps-grads", "--bucket-view", "--max-epochs", 3),
        "views_alone": (
            "--inject",
            "none",
            "--model",
            "keeps-grads",
            "--bucket-view",
            "--max-epochs",
            3,
            "--no-backoff",
        ),
    }
    for name, extra in cases.items():
        out = tmp_path / name
        accumulate = () if name == "reference" else ("--accumulate", 2)
        result = run_script(script, "--out", out, "--accelerator", "cuda", *accumulate, *extra, timeout=300, ranks=2)
        assert not result["hung"] and result["rc"] == 0, result["output"][-4000:]
        runs[name] = load_rank_dumps(out)
    assert [d["whole_batches"] for d in runs["none"]] == [4, 4]
    for name in ("first", "last"):
        assert [d["recoveries"] for d in runs[name]] == [1, 1], name
        for key, value in runs[name][0]["params"].items():
            assert torch.equal(value, runs[name][1]["params"][key]), (name, key)
            torch.testing.assert_close(value, runs["reference"][0]["params"][key], atol=1e-5, rtol=0)
    for key, value in runs["none"][0]["params"].items():
        torch.testing.assert_close(value, runs["alone"][0]["params"][key], atol=1e-6, rtol=0)
    assert [d["whole_batches"] for d in runs["views"]] == [6, 6]
    for key, value in runs["views"][0]["params"].items():
        torch.testing.assert_close(value, runs["views_alone"][0]["params"][key], atol=1e-6, rtol=0)
