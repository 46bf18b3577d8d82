"""``FSDPStrategy`` / ``MultiGPUStrategy(mode="fsdp")`` in one process: options, refusals, sharding units."""

import time

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_mgpu import FSDPStrategy, GPUMemoryMonitor, GradientClipping, MultiGPUStrategy, NaNSkip, OOMBackoff
from tests.helpers.tiny_transformer import TinyTransformer
from tests.helpers.trainer import QUIET


def fsdp_trainer(**kwargs) -> Trainer:
    strategy = kwargs.pop("strategy", None) or MultiGPUStrategy(mode="fsdp")
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, **QUIET, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sharding": "zero3"}, ValueError, r"sharding.*'full', 'grad_op'"),
        ({"shard_units": []}, ValueError, r"shard_units must be 'auto' or a non-empty list of class names, got \[\]"),
        ({"shard_units": "Block"}, TypeError, r"shard_units must be 'auto' or a non-empty list"),
        ({"activation_checkpointing": "yes"}, TypeError, r"activation_checkpointing must be .*or None, got 'yes'"),
        ({"cpu_offload": "yes"}, TypeError, r"cpu_offload"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)
    with pytest.raises(error, match=match):
        MultiGPUStrategy(mode="ddp", **kwargs)  # checked in every mode, not only when FSDP is chosen


def test_registered_name_becomes_fsdp_and_shards_the_repeated_blocks():
    trainer = Trainer(accelerator="cpu", devices=1, strategy="mgpu_fsdp", max_steps=2, **QUIET)
    assert type(trainer.strategy) is FSDPStrategy
    assert trainer.strategy.choice.mode == "fsdp"
    model = TinyTransformer()
    trainer.fit(model)
    assert trainer.strategy.units == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", ""]
    assert isinstance(model, FSDPModule) and all(isinstance(block, FSDPModule) for block in model.blocks)
    assert not isinstance(model.head, FSDPModule)  # the head's parameters belong to the root unit
    assert trainer.global_step == 2


def test_shard_units_by_class_name_and_an_unknown_name():
    trainer = fsdp_trainer(strategy=MultiGPUStrategy(mode="fsdp", shard_units=["Linear"]))
    trainer.fit(TinyTransformer(depth=2))
    # every Linear (two per block and the head) is a unit of its own, and the root holds the rest
    assert trainer.strategy.units == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head", ""]
    trainer = fsdp_trainer(strategy=MultiGPUStrategy(mode="fsdp", shard_units=["Layer"]))
    with pytest.raises(ValueError, match=r"class name\(s\) \['Layer'\].*'Block'"):
        trainer.fit(TinyTransformer(depth=2))


def test_a_module_that_shards_itself_is_left_as_it_is():
    class SelfSharded(TinyTransformer):
        def configure_model(self):
            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])

    trainer = fsdp_trainer()
    model = SelfSharded()
    trainer.fit(model)
    assert trainer.strategy.units == []
    assert not isinstance(model, FSDPModule) and isinstance(model.blocks[0], FSDPModule)


def test_fp16_mixed_precision_is_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*bf16-mixed keeps float32 master weights"):
        fsdp_trainer(plugins=[MixedPrecision("16-mixed", "cuda")])


def test_bf16_mixed_computes_in_bf16_and_keeps_float32_shards():
    trainer = fsdp_trainer(precision="bf16-mixed")
    model = TinyTransformer()
    dtypes = []
    model.blocks[0].register_forward_hook(lambda module, args, out: dtypes.append(module.up.weight.dtype))
    trainer.fit(model)
    assert set(dtypes) == {torch.bfloat16}
    assert {param.dtype for param in model.parameters()} == {torch.float32}


def test_cpu_offload_on_cpu_is_refused():
    trainer = fsdp_trainer(strategy=MultiGPUStrategy(mode="fsdp", cpu_offload=True))
    with pytest.raises(ValueError, match=r"cpu_offload=True.*on cpu devices.*cpu_offload=False"):
        trainer.fit(TinyTransformer())


def test_oom_backoff_refuses_fsdp_naming_what_to_use():
    trainer = fsdp_trainer(callbacks=[OOMBackoff()])
    with pytest.raises(MisconfigurationException, match=r"does not run under FSDPStrategy.*activation_checkpointing"):
        trainer.fit(TinyTransformer())


def test_gradient_clipping_refuses_what_needs_whole_gradients_under_fsdp():
    trainer = fsdp_trainer(callbacks=[GradientClipping(mode="agc", clip_factor=0.01)])
    with pytest.raises(MisconfigurationException, match=r"mode=.agc.*not supported under FSDPStrategy"):
        trainer.fit(TinyTransformer())


def test_the_packs_callbacks_run_under_fsdp_and_the_memory_monitor_reports(tmp_path):
    from lightning.pytorch import Callback

    from lightning_mgpu.core.sharded_tensors import local_part

    class Watch(Callback):
        """Each step's total gradient norm where this callback runs, and the parameters after each batch."""

        def __init__(self):
            self.norms, self.params = {}, {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [local_part(p.grad).flatten() for p in pl_module.parameters() if p.grad is not None]
            self.norms[trainer.global_step] = torch.cat(grads).norm().item() if grads else None  # None: skipped

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.params[batch_idx] = {n: local_part(p).detach().clone() for n, p in pl_module.named_parameters()}

    class SpikeAt(Callback):
        """Gradients 10 times larger at one step, before the clipping sees them."""

        def __init__(self, step):
            self.step = step

        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == self.step:
                for param in pl_module.parameters():
                    param.grad.mul_(10.0)

    monitor = GPUMemoryMonitor(sample_hz=20)
    skip, unclipped, clipped = NaNSkip(), Watch(), Watch()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MultiGPUStrategy(mode="fsdp"),
        max_steps=4,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path),
        # the watches see the gradients before GradientClipping and after it (callbacks run in this order)
        callbacks=[SpikeAt(3), unclipped, skip, GradientClipping(mode="zscore", warmup_steps=1), clipped, monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    torch.manual_seed(0)
    trainer.fit(TinyTransformer(nan_at=(0, 1)))  # a NaN loss at step 1
    assert trainer.global_step == 4
    assert monitor.training_peak_source == "host RSS" and monitor.training_peak_mb > 0
    # NaNSkip skipped step 1, and only it: the parameters did not move there, and did at the other steps
    assert skip.skipped_steps == 1

    def moved(batch):
        before, after = clipped.params[batch - 1], clipped.params[batch]
        return max((after[name] - before[name]).abs().max().item() for name in after)

    assert moved(1) == 0.0 and min(moved(2), moved(3)) > 1e-3, [moved(1), moved(2), moved(3)]
    # the spike at step 3 was clipped to the threshold of the steps before it; step 2's norm, under it, was left alone
    assert unclipped.norms[3] > 5 * unclipped.norms[2]
    assert clipped.norms[3] < unclipped.norms[3] / 5
    assert clipped.norms[3] == pytest.approx(trainer.callback_metrics["grad_norm_threshold"].item(), rel=1e-5)
    assert clipped.norms[2] == unclipped.norms[2]


class KilledBeforeTheRename(BaseException):
    """Stands for the process dying once the new shards are written, before they are renamed into place."""


def test_a_sharded_save_killed_before_it_completes_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    import lightning_mgpu.fsdp.fsdp as fsdp_module

    torch.manual_seed(0)
    trainer = fsdp_trainer()
    trainer.fit(TinyTransformer())
    target = tmp_path / "last.ckpt"
    trainer.save_checkpoint(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no staging folder left
    assert torch.load(target / "meta.pt", weights_only=False)["global_step"] == 2

    def killed(staging, target):
        raise KilledBeforeTheRename

    written = {path.name: path.stat().st_mtime_ns for path in target.iterdir()}
    time.sleep(0.01)
    monkeypatch.setattr(fsdp_module, "replace_folder", killed)
    with pytest.raises(KilledBeforeTheRename):
        trainer.save_checkpoint(target)  # every shard and the metadata written again, then the process "dies"
    monkeypatch.undo()
    # the name still holds the whole previous checkpoint, untouched: not new shards beside old metadata
    assert {path.name: path.stat().st_mtime_ns for path in target.iterdir()} == written
    left = [p for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    assert len(left) == 1 and left[0].name.startswith(".last.ckpt.")  # hidden: "last" never resolves to it
    trainer.save_checkpoint(target)  # the next save removes what the killed one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_one_file_fsdp_checkpoint_is_written_atomically(tmp_path):
    torch.manual_seed(0)
    trainer = fsdp_trainer(strategy=FSDPStrategy(save_distributed_checkpoint=False))
    trainer.fit(TinyTransformer())
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]
    assert "state_dict" in torch.load(tmp_path / "model.ckpt", weights_only=False)
