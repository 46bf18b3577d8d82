"""The shipped LightningCLI configs: each parses and builds its objects, the interpolation resolves, CPU one trains."""

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mgpu import GPUMemoryMonitor, GradientClipping, MultiGPUStrategy, NaNSkip, OOMBackoff
from lightning_mgpu.cli import MGPULightningCLI, count_processes, per_device_batch_size
from lightning_mgpu.configs import CONFIG_NAMES, config_path
from tests.helpers.models import load_rank_dumps
from tests.helpers.processes import run_script

REPO = Path(__file__).resolve().parents[1]
BLOBS = REPO / "examples" / "configs" / "blobs.yaml"
PACK_CALLBACKS = {NaNSkip, GradientClipping, GPUMemoryMonitor, OOMBackoff}
CUDA_CONFIGS = {"single_gpu", "multi_gpu", "robust_long_run"}


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # the configs name blobs.BlobClassifier


class ParseOnlyOnCPU(MGPULightningCLI):
    """Builds everything a config names; the Trainer too, unless the config needs CUDA and there is none."""

    def instantiate_trainer(self, **kwargs):
        trainer_init = self._get(self.config_init, "trainer")
        strategy = trainer_init["strategy"]  # MultiGPUStrategy turns into another class for one device: look now
        self.strategy_from_config = (type(strategy), strategy.bucket_cap_mb, strategy.sync_batchnorm)
        accelerator = trainer_init["accelerator"]
        if accelerator == "cuda" and not torch.cuda.is_available():
            self.parsed_trainer_kwargs = kwargs
            return None
        return super().instantiate_trainer(**kwargs)


def build(*args: str) -> ParseOnlyOnCPU:
    return ParseOnlyOnCPU(run=False, args=list(args), save_config_callback=None)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_shipped_config_parses_and_builds_the_strategy_and_every_callback(name):
    # devices=-1 (every GPU) needs GPUs to count: without them, name a node's GPUs as on a login node
    without_gpus = ["--trainer.devices=4"] if name in CUDA_CONFIGS and not torch.cuda.is_available() else []
    cli = build("--config", str(config_path(name)), "--config", str(BLOBS), *without_gpus)
    trainer_config = cli.config["trainer"]
    callbacks = cli.config_init["trainer"]["callbacks"]
    assert {type(cb) for cb in callbacks} >= PACK_CALLBACKS
    strategy = cli.config_init["trainer"]["strategy"]
    assert cli.strategy_from_config == (MultiGPUStrategy, "auto", "auto")

    processes = count_processes(trainer_config["devices"], trainer_config["num_nodes"], trainer_config["accelerator"])
    expected = cli.config["global_batch_size"] // (processes * trainer_config["accumulate_grad_batches"])
    assert cli.config["per_device_batch_size"] == expected
    assert cli.datamodule.batch_size == expected  # blobs.yaml reads ${per_device_batch_size}
    if cli.trainer is not None:
        assert cli.trainer.strategy is strategy
        assert {type(cb) for cb in cli.trainer.callbacks} >= PACK_CALLBACKS
    else:
        assert name in CUDA_CONFIGS


def test_robust_long_run_config_checkpoints_every_1000_steps_and_keeps_the_last():
    cli = build("--config", str(config_path("robust_long_run")), "--config", str(BLOBS), "--trainer.devices=4")
    checkpoints = [cb for cb in cli.config_init["trainer"]["callbacks"] if isinstance(cb, ModelCheckpoint)]
    assert len(checkpoints) == 1 and checkpoints[0].save_last
    assert checkpoints[0]._every_n_train_steps == 1000
    clipping = next(cb for cb in cli.config_init["trainer"]["callbacks"] if isinstance(cb, GradientClipping))
    assert clipping.mode == "zscore"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], 64),  # cpu.yaml: 128 over 2 processes
        (["--trainer.devices=1"], 128),
        (["--trainer.accumulate_grad_batches=4"], 16),
        (["--trainer.num_nodes=2"], 32),
        (["--global_batch_size=96"], 48),
        (["--global_batch_size=96", "--trainer.devices=3", "--trainer.accumulate_grad_batches=2"], 16),
    ],
)
def test_per_device_batch_size_follows_every_override_on_the_command_line(overrides, expected):
    cli = build("--config", str(config_path("cpu")), "--config", str(BLOBS), *overrides)
    assert cli.config["per_device_batch_size"] == expected
    assert cli.datamodule.batch_size == expected


def test_interpolation_resolves_whichever_config_comes_first():
    first = build("--config", str(BLOBS), "--config", str(config_path("cpu")), "--trainer.devices=4")
    assert first.datamodule.batch_size == 32


def test_an_uneven_global_batch_is_refused_with_the_numbers(capsys):
    with pytest.raises(SystemExit):
        build(
            "--config",
            str(config_path("cpu")),
            "--config",
            str(BLOBS),
            "--global_batch_size=100",
            "--trainer.devices=3",
        )
    err = capsys.readouterr().err
    assert "global_batch_size=100 does not split evenly over 3 processes" in err
    assert "choose a multiple of 3" in err


def test_count_processes_reads_devices_as_the_trainer_does():
    assert count_processes(2, 1, "cpu") == 2
    assert count_processes("3", 2, "cpu") == 6
    assert count_processes("auto", 1, "cpu") == 1
    with pytest.raises(ValueError, match="devices=-1 cannot be used with accelerator='cpu'"):
        count_processes(-1, 1, "cpu")
    with pytest.raises(ValueError, match="num_nodes must be an int >= 1, got 0"):
        count_processes(2, 0, "cpu")
    with pytest.raises(ValueError, match="accelerator='tpu9' is not one of"):
        count_processes(2, 1, "tpu9")


def test_per_device_batch_size_arithmetic_and_errors():
    assert per_device_batch_size(256, 4, 2, 1, "cpu") == 32
    assert per_device_batch_size(256, 2, 1, 4, "cpu") == 32
    with pytest.raises(ValueError, match="global_batch_size must be a positive int, got None"):
        per_device_batch_size(None, 2, accelerator="cpu")
    with pytest.raises(ValueError, match="choose a multiple of 8"):
        per_device_batch_size(4, 4, 1, 2, "cpu")  # splits into nothing


def test_config_command_lists_and_locates_the_configs():
    import subprocess

    listing = subprocess.run([sys.executable, "-m", "lightning_mgpu", "config"], capture_output=True, text=True)
    assert listing.returncode == 0
    for name in CONFIG_NAMES:
        assert str(config_path(name)) in listing.stdout
    one = subprocess.run([sys.executable, "-m", "lightning_mgpu", "config", "cpu"], capture_output=True, text=True)
    assert one.stdout.strip() == str(config_path("cpu")) and config_path("cpu").is_file()
    with pytest.raises(ValueError, match="config name must be one of 'base'"):
        config_path("gpu")


@pytest.mark.distributed
def test_cpu_config_trains_two_steps_on_two_processes_with_identical_parameters(tmp_path):
    dump = {"class_path": "tests.helpers.models.RankStateDump", "init_args": {"directory": str(tmp_path)}}
    result = run_script(
        REPO / "examples" / "cli.py",
        "fit",
        "--config",
        config_path("cpu"),
        "--config",
        BLOBS,
        "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.callbacks+={dump}".replace("'", '"'),
        timeout=150,
        cwd=tmp_path,
    )
    assert result["rc"] == 0, result["output"][-3000:]
    dumps = load_rank_dumps(tmp_path)
    assert [d["global_step"] for d in dumps] == [2, 2]
    assert all(d["strategy"] == "MultiGPUStrategy" and d["choice"].mode == "ddp" for d in dumps)
    for name, value in dumps[0]["params"].items():
        assert torch.equal(value, dumps[1]["params"][name]), name
    # sync_batchnorm: auto stays off because the config has OOMBackoff (which re-runs batches on one rank only)
    assert "BatchNorm1d" in dumps[0]["layer_classes_during_fit"]
    assert "DistributedBatchNorm" not in dumps[0]["layer_classes_during_fit"]
    # the run's config.yaml records the batch size the interpolation produced
    saved = next(tmp_path.rglob("config.yaml")).read_text()
    assert "per_device_batch_size: 64" in saved and "batch_size: 64" in saved
