"""DataParallelStrategy through a real Trainer on CPU.

torch's DataParallel cannot split, replicate or run replicas without CUDA, so ``CPUSimulatedDataParallel`` stands
in for exactly those three steps (chunk along dim 0, replicas sharing the parameters, one thread per replica).
Everything of ours runs as on GPUs: the strategy's setup and step routing, the replica index injection, the
per-replica recorder, the weighted gather and the log replay. The real multi-GPU path is in test_data_parallel_gpu.
"""

import copy
import threading
import time

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DataParallelStrategy
from lightning_mgpu.ddp.data_parallel import _ReplicaDataParallel
from tests.helpers.trainer import QUIET

BATCH = 7  # two replicas get 4 and 3 samples: uneven on purpose


def chunk(obj, n):
    if isinstance(obj, torch.Tensor):
        return list(obj.chunk(n))
    if isinstance(obj, (list, tuple)) and obj:
        return [type(obj)(items) for items in zip(*(chunk(o, n) for o in obj), strict=True)]
    return [obj] * n


def shared_replica(module):
    replica = module._replicate_for_data_parallel()
    replica._parameters = dict(module._parameters)  # same Parameter objects: gradients reach the original
    replica._modules = {k: shared_replica(c) if c is not None else None for k, c in module._modules.items()}
    return replica


class CPUSimulatedDataParallel(_ReplicaDataParallel):
    replicas = 2

    def __init__(self, module, device_ids):
        super().__init__(module, device_ids=[])

    def forward(self, *inputs, **kwargs):  # torch's DataParallel.forward, minus its CUDA checks
        inputs, kwargs = self.scatter(inputs, kwargs, list(range(self.replicas)))
        replicas = self.replicate(self.module, len(inputs))
        return self.gather(self.parallel_apply(replicas, inputs, kwargs), torch.device("cpu"))

    def _split(self, inputs, kwargs, device_ids):
        per_replica = list(zip(*(chunk(arg, len(device_ids)) for arg in inputs), strict=True))
        return per_replica, tuple(dict(kwargs or {}) for _ in per_replica)

    def replicate(self, module, count):
        return [shared_replica(module) for _ in range(count)]

    def parallel_apply(self, replicas, inputs, kwargs):
        results, errors = [None] * len(replicas), []
        grad_enabled = torch.is_grad_enabled()

        def run(i):
            try:
                with torch.set_grad_enabled(grad_enabled):
                    results[i] = replicas[i](*inputs[i], **kwargs[i])
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(replicas))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


class CPUDataParallelStrategy(DataParallelStrategy):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._data_parallel_class = CPUSimulatedDataParallel

    def _check_devices(self):
        pass


class Regressor(pl.LightningModule):
    def __init__(self, slow_first_replica=False):
        super().__init__()
        torch.manual_seed(3)
        self.layer = nn.Linear(5, 1)
        self.slow_first_replica = slow_first_replica
        self.batch_outputs = []
        self.main_thread_logs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.slow_first_replica and len(x) == 4:
            time.sleep(0.05)  # the second replica records first; the merge must not care
        preds = self.layer(x)
        loss = nn.functional.mse_loss(preds, y)
        self.log("train_loss", loss)
        self.log("samples", float(len(x)), reduce_fx="sum")
        self.log_dict({"x_max": x.max()}, reduce_fx="max")
        return {"loss": loss, "preds": preds}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_outputs.append({k: v.detach().clone() for k, v in outputs.items()})

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data(n=BATCH, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g)


def fit(model, tmp_path, steps=1, **trainer_kwargs):
    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=CPUDataParallelStrategy(),
        max_steps=steps,
        default_root_dir=tmp_path,
        **trainer_kwargs,
        **QUIET,
    )
    trainer.fit(model, loader, loader if trainer_kwargs.get("limit_val_batches") else None)
    return trainer


@pytest.mark.parametrize("slow_first_replica", [False, True])
def test_step_equals_one_device_on_the_whole_batch(tmp_path, slow_first_replica):
    model = Regressor(slow_first_replica)
    reference = copy.deepcopy(model)
    x, y = data()
    ref_loss = nn.functional.mse_loss(reference.layer(x), y)
    ref_loss.backward()
    with torch.no_grad():
        expected_weight = reference.layer.weight - 0.1 * reference.layer.weight.grad

    trainer = fit(model, tmp_path)

    metrics = trainer.callback_metrics
    torch.testing.assert_close(metrics["train_loss"], ref_loss.detach())
    assert float(metrics["samples"]) == BATCH
    assert float(metrics["x_max"]) == float(x.max())
    torch.testing.assert_close(model.layer.weight.detach(), expected_weight)
    (outputs,) = model.batch_outputs
    assert outputs["preds"].shape == (BATCH, 1)  # replica outputs concatenated in order
    torch.testing.assert_close(outputs["preds"], reference.layer(x).detach())
    torch.testing.assert_close(outputs["loss"], ref_loss.detach())


def test_validation_logs_are_merged(tmp_path):
    model = Regressor()
    x, y = data()
    trainer = fit(model, tmp_path, steps=1, limit_val_batches=1, num_sanity_val_steps=0, val_check_interval=1)
    assert "val_loss" in trainer.callback_metrics
    trainer.validate(model, DataLoader(TensorDataset(x, y), batch_size=BATCH), verbose=False)
    reference = copy.deepcopy(model)
    expected = nn.functional.mse_loss(reference.layer(x), y).detach()
    torch.testing.assert_close(trainer.callback_metrics["val_loss"], expected)


def test_checkpoint_holds_the_plain_module_state(tmp_path):
    model = Regressor()
    trainer = fit(model, tmp_path)
    path = tmp_path / "dp.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert set(state) == {"layer.weight", "layer.bias"}
    plain = nn.Module()
    plain.layer = nn.Linear(5, 1)
    plain.load_state_dict(state, strict=True)  # no lightning_mgpu, no "module." prefixes
    assert torch.equal(plain.layer.weight, model.layer.weight.detach())
    assert trainer.strategy.model is model  # unwrapped after fit


def test_logging_a_metric_object_inside_a_replica_is_refused(tmp_path):
    class MetricLogger(Regressor):
        def __init__(self):
            super().__init__()
            self.mae = torchmetrics.MeanAbsoluteError()

        def training_step(self, batch, batch_idx):
            x, y = batch
            preds = self.layer(x)
            self.mae(preds, y)
            self.log("mae", self.mae)
            return nn.functional.mse_loss(preds, y)

    with pytest.raises(MisconfigurationException, match=r"self.log\('mae', <MeanAbsoluteError>\)"):
        fit(MetricLogger(), tmp_path)


def test_manual_optimization_is_refused(tmp_path):
    class Manual(Regressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(MisconfigurationException, match="automatic optimization only"):
        fit(Manual(), tmp_path)


def test_batchnorm_and_transfer_hook_warnings(tmp_path):
    class WithBatchNorm(Regressor):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(5)

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            return batch

    with pytest.warns(UserWarning) as record:
        fit(WithBatchNorm(), tmp_path)
    messages = " ".join(str(w.message) for w in record)
    assert "BatchNorm statistics are computed per replica" in messages
    assert "`transfer_batch_to_device` is not called" in messages


def test_batch_hooks_run_once_and_datamodule_hooks_run(tmp_path):
    calls = []

    class Hooked(Regressor):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            calls.append("module.before")
            return batch

        def on_after_batch_transfer(self, batch, dataloader_idx):
            calls.append("module.after")
            return batch

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(TensorDataset(*data()), batch_size=BATCH)

        def on_after_batch_transfer(self, batch, dataloader_idx):
            calls.append("datamodule.after")
            return batch

    runs = {}
    for name, strategy in (("dp", CPUDataParallelStrategy()), ("single", "auto")):
        calls.clear()
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            max_steps=1,
            default_root_dir=tmp_path,
            **QUIET,
        )
        trainer.fit(Hooked(), datamodule=Data())
        runs[name] = list(calls)
    # the same hooks, once each, as any other strategy calls them (Lightning picks module or datamodule per hook)
    assert runs["dp"] == runs["single"]
    assert runs["dp"].count("module.before") == 1 and len(runs["dp"]) == 2


def test_multigpu_turned_dataparallel_tears_down():
    from lightning_mgpu import MultiGPUStrategy
    from lightning_mgpu.core.strategy_choice import StrategyChoice

    trainer = Trainer(accelerator="cpu", devices=1, strategy=MultiGPUStrategy(mode="ddp"), logger=False)
    strategy = trainer.strategy.one_process_strategy(
        StrategyChoice("dp", "as chosen in a notebook with CUDA initialised")
    )
    assert isinstance(strategy, DataParallelStrategy)
    strategy.teardown()  # ParallelStrategy.teardown would assert on the missing cluster environment


def test_strategy_pickles_for_spawned_workers():
    import pickle

    assert isinstance(pickle.loads(pickle.dumps(DataParallelStrategy())), DataParallelStrategy)


def test_replica_threads_get_autocast_dtype_and_inference_mode():
    from lightning_mgpu.ddp.data_parallel import _ThreadState

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        state = _ThreadState.capture("cpu")
    seen = {}

    def in_thread():
        with state.restored():
            seen["dtype"] = torch.get_autocast_dtype("cpu")
            seen["autocast"] = torch.is_autocast_enabled("cpu")
            seen["inference"] = torch.is_inference_mode_enabled()

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen == {"dtype": torch.bfloat16, "autocast": True, "inference": True}


def test_replica_device_attributes_follow_their_parameters():
    from lightning_mgpu.ddp.data_parallel import _point_device_attributes_at_parameters

    replica = Regressor()
    replica.__dict__["_device"] = torch.device("meta")  # what a copied __dict__ says on a second GPU
    _point_device_attributes_at_parameters(replica)
    assert replica.device == torch.device("cpu")


class IndexedRegressor(Regressor):
    """Records the sample indices of every training batch; noise drawn in the main thread, between steps."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(batch[0].tolist())
        batch[1].add_(torch.randn_like(batch[1]))  # the global stream, restored on resume

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.layer(batch[1]), batch[2])


def test_a_mid_epoch_checkpoint_resumes_bit_identical_and_is_written_atomically(tmp_path):
    def dp_fit(root, steps, ckpt_path=None):
        torch.manual_seed(0)
        model = IndexedRegressor()
        x, y = data(n=40)
        loader = DataLoader(TensorDataset(torch.arange(40), x, y), batch_size=BATCH, shuffle=True)
        checkpoints = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1)
        trainer = Trainer(
            accelerator="cpu", devices=1, strategy=CPUDataParallelStrategy(), max_steps=steps, callbacks=[checkpoints],
            default_root_dir=root, **{**QUIET, "enable_checkpointing": True},
        )  # fmt: skip
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return model

    reference = dp_fit(tmp_path / "reference", steps=10)  # 6 batches an epoch: step 3 is mid-epoch
    interrupted = dp_fit(tmp_path / "interrupted", steps=4)
    assert not [p for p in (tmp_path / "interrupted").iterdir() if p.name.endswith(".partial")]
    torch.manual_seed(99)  # a new process's streams
    resumed = dp_fit(tmp_path / "resumed", steps=10, ckpt_path=str(tmp_path / "interrupted" / "epoch=0-step=3.ckpt"))
    assert interrupted.seen[:3] + resumed.seen == reference.seen  # the epoch's remaining batches, in order
    assert torch.equal(resumed.layer.weight, reference.layer.weight)
    assert torch.equal(resumed.layer.bias, reference.layer.bias)
