"""Real 2-process gloo fits through the Trainer, compared across ranks and against one process."""

import copy

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch import nn

from lightning_mgpu import DistributedBatchNorm, MultiGPUStrategy
from tests.helpers.models import BatchNormClassifier, RankStateDump, finished_fits_survive_exit_aborts, load_rank_dumps
from tests.helpers.trainer import QUIET, fit_apart, in_process_start

pytestmark = pytest.mark.distributed


def fit_two_processes(model, tmp_path, steps, trainer_sync_batchnorm=False, spawn=False, **strategy_kwargs):
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=2,
        strategy=MultiGPUStrategy(mode="ddp_spawn" if spawn else f"ddp_{in_process_start()}", **strategy_kwargs),
        max_steps=steps,
        sync_batchnorm=trainer_sync_batchnorm,
        use_distributed_sampler=False,  # each rank reads its own slice, see BatchNormClassifier
        callbacks=[RankStateDump(tmp_path)],
        **QUIET,
    )
    with finished_fits_survive_exit_aborts(tmp_path):  # a spawned worker's abort at exit (MGPU_TESTS_COLD=1 too)
        if spawn:
            Trainer(**trainer_kwargs).fit(model)
        else:
            fit_apart(trainer_kwargs, model)
    return load_rank_dumps(tmp_path)


def reference_first_step(model, per_rank_batch):
    """One process, BatchNorm in train mode, on the concatenated global batch of step 0."""
    reference = copy.deepcopy(model)
    x, y = reference.global_batch(0)
    loss = nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    bn = reference.net[1]
    return grads, bn.running_mean.clone(), bn.running_var.clone()


def assert_same_on_every_rank(dumps):
    for key in ("params", "buffers"):
        for name, value in dumps[0][key].items():
            assert torch.equal(value, dumps[1][key][name]), f"{key} {name} differs between ranks"


def test_sync_batchnorm_auto_matches_one_process_on_the_global_batch(tmp_path):
    model = BatchNormClassifier(per_rank_batch=(8, 8), steps=3)
    ref_grads, ref_mean, ref_var = reference_first_step(model, (8, 8))

    # sync_batchnorm="auto" is the default; spawned: the one fit here whose trainer and model are pickled to workers
    dumps = fit_two_processes(model, tmp_path, steps=3, spawn=True)

    assert [d["rank"] for d in dumps] == [0, 1]
    assert all(d["choice"].mode == "ddp_spawn" for d in dumps)
    assert "DistributedBatchNorm" in dumps[0]["layer_classes_during_fit"]
    assert_same_on_every_rank(dumps)
    for dump in dumps:
        for name, grad in ref_grads.items():
            torch.testing.assert_close(dump["first_grads"][name], grad, atol=1e-5, rtol=0)
    # after one step the running statistics are those of the global batch; a fresh model (same seeded init)
    # because ddp_spawn loads rank 0's trained weights back into `model`
    one_step = fit_two_processes(BatchNormClassifier(per_rank_batch=(8, 8), steps=3), tmp_path, steps=1)
    for dump in one_step:
        torch.testing.assert_close(dump["buffers"]["net.1.running_mean"], ref_mean, atol=1e-5, rtol=0)
        torch.testing.assert_close(dump["buffers"]["net.1.running_var"], ref_var, atol=1e-5, rtol=0)


@pytest.mark.parametrize("per_rank_batch", [(5, 3), (1, 6)])
def test_uneven_per_rank_batches_give_global_statistics(tmp_path, per_rank_batch):
    model = BatchNormClassifier(per_rank_batch=per_rank_batch, steps=1)
    _, ref_mean, ref_var = reference_first_step(model, per_rank_batch)

    dumps = fit_two_processes(model, tmp_path, steps=1, sync_batchnorm=True)

    assert_same_on_every_rank(dumps)
    for dump in dumps:
        torch.testing.assert_close(dump["buffers"]["net.1.running_mean"], ref_mean, atol=1e-5, rtol=0)
        torch.testing.assert_close(dump["buffers"]["net.1.running_var"], ref_var, atol=1e-5, rtol=0)


def test_trainer_sync_batchnorm_flag_works_on_cpu(tmp_path):
    """Stock Lightning fails here with 'SyncBatchNorm layers only work with GPU modules'."""
    model = BatchNormClassifier(per_rank_batch=(4, 4), steps=1)
    ref_grads, ref_mean, ref_var = reference_first_step(model, (4, 4))
    # the strategy's own sync_batchnorm off: the Trainer's flag alone turns it on
    dumps = fit_two_processes(model, tmp_path, steps=1, trainer_sync_batchnorm=True, sync_batchnorm=False)
    assert "DistributedBatchNorm" in dumps[0]["layer_classes_during_fit"]
    assert_same_on_every_rank(dumps)
    for dump in dumps:  # the gradients and running statistics of one process on the global batch
        for name, grad in ref_grads.items():
            torch.testing.assert_close(dump["first_grads"][name], grad, atol=1e-5, rtol=0)
        torch.testing.assert_close(dump["buffers"]["net.1.running_mean"], ref_mean, atol=1e-5, rtol=0)
        torch.testing.assert_close(dump["buffers"]["net.1.running_var"], ref_var, atol=1e-5, rtol=0)


def test_sync_batchnorm_off_keeps_per_rank_statistics(tmp_path):
    model = BatchNormClassifier(per_rank_batch=(4, 4), steps=1)
    dumps = fit_two_processes(model, tmp_path, steps=1, sync_batchnorm=False, broadcast_buffers=False)
    assert "DistributedBatchNorm" not in dumps[0]["layer_classes_during_fit"]
    # each rank normalised its own half: the running means differ (this is what sync-BN fixes)
    assert not torch.allclose(dumps[0]["buffers"]["net.1.running_mean"], dumps[1]["buffers"]["net.1.running_mean"])


@pytest.mark.parametrize("comm_hook", ["fp16", "bf16", "powersgd"])
def test_every_comm_hook_trains_over_gloo(tmp_path, comm_hook):
    model = BatchNormClassifier(per_rank_batch=(4, 4), steps=3)
    dumps = fit_two_processes(model, tmp_path, steps=3, comm_hook=comm_hook, powersgd_warmup_steps=1)
    assert all(d["global_step"] == 3 for d in dumps)
    assert_same_on_every_rank(dumps)
    initial = dict(BatchNormClassifier(per_rank_batch=(4, 4), steps=3).named_parameters())  # same seeded init
    assert any(not torch.equal(initial[n], p) for n, p in dumps[0]["params"].items()), "nothing trained"


def test_sync_batchnorm_is_reverted_after_fit():
    model = BatchNormClassifier(per_rank_batch=(4,), steps=2)
    weight_before = model.net[1].weight
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MultiGPUStrategy(mode="ddp", sync_batchnorm=True),
        max_steps=2,
        **QUIET,
    )
    seen = []

    class Spy(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(type(pl_module.net[1]))

    trainer.callbacks.append(Spy())
    try:
        trainer.fit(model)  # one process: DDP over a gloo group of size 1, in this process
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert seen and all(cls is DistributedBatchNorm for cls in seen)
    assert type(model.net[1]) is nn.BatchNorm1d
    assert model.net[1].weight is weight_before
    assert int(model.net[1].num_batches_tracked) == 2
