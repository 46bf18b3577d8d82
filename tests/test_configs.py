"""The shipped LightningCLI configs: each parses and builds its objects, the interpolation resolves, CPU one trains."""

import inspect
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mgpu import GPUMemoryMonitor, GradientClipping, MultiGPUStrategy, NaNSkip, OOMBackoff
from lightning_mgpu.cli import MGPULightningCLI
from lightning_mgpu.configs import CONFIG_NAMES, config_path
from tests.helpers.models import load_rank_dumps
from tests.helpers.processes import run_script

REPO = Path(__file__).resolve().parents[1]
BLOBS = REPO / "examples" / "configs" / "blobs.yaml"
PACK_CALLBACKS = {NaNSkip, GradientClipping, GPUMemoryMonitor, OOMBackoff}
CUDA_CONFIGS = {"single_gpu", "multi_gpu", "robust_long_run"}
# the per-process batch each config gives with the blobs model; the GPU configs with --trainer.devices=4 where there are
# no GPUs to count (single_gpu keeps its one device)
EXPECTED_BATCH = {"base": 256, "cpu": 64, "single_gpu": 256, "multi_gpu": 64, "robust_long_run": 64}


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # the configs name blobs.BlobClassifier
    # LightningCLI warns ("args parameter is intended to run from within Python") when sys.argv holds pytest's flags
    monkeypatch.setattr(sys, "argv", ["cli.py"])


class ParseOnlyOnCPU(MGPULightningCLI):
    """Builds everything a config names; a config that needs CUDA where there is none gets a CPU Trainer instead.

    The CPU Trainer takes every other setting of the config (precision, callbacks, strategy...), so Lightning still
    checks them; it is built here and kept in ``cpu_trainer`` (``trainer`` stays ``None``).
    """

    def instantiate_trainer(self, **kwargs):
        trainer_init = self._get(self.config_init, "trainer")
        strategy = trainer_init["strategy"]  # MultiGPUStrategy turns into another class for one device: look now
        self.strategy_from_config = (type(strategy), strategy.bucket_cap_mb, strategy.sync_batchnorm)
        accelerator = trainer_init["accelerator"]
        if accelerator == "cuda" and not torch.cuda.is_available():
            init = {**trainer_init, **kwargs, "accelerator": "cpu", "devices": 1}
            accepted = inspect.signature(Trainer.__init__).parameters
            self.cpu_trainer = Trainer(**{k: v for k, v in init.items() if k in accepted})
            return None
        return super().instantiate_trainer(**kwargs)


def build(*args: str) -> ParseOnlyOnCPU:
    return ParseOnlyOnCPU(run=False, args=list(args), save_config_callback=None)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_shipped_config_parses_and_builds_the_strategy_and_every_callback(name):
    # devices=-1 (every GPU) needs GPUs to count: without them, name a node's GPUs as on a login node
    count_gpus = name in {"multi_gpu", "robust_long_run"}
    without_gpus = ["--trainer.devices=4"] if count_gpus and not torch.cuda.is_available() else []
    cli = build("--config", str(config_path(name)), "--config", str(BLOBS), *without_gpus)
    trainer_config = cli.config["trainer"]
    callbacks = cli.config_init["trainer"]["callbacks"]
    wanted = PACK_CALLBACKS - {OOMBackoff} if name == "multi_gpu" else PACK_CALLBACKS  # multi_gpu: speed first
    assert {type(cb) for cb in callbacks} >= wanted
    assert cli.strategy_from_config == (MultiGPUStrategy, "auto", "auto")

    assert trainer_config["num_nodes"] == 1 and trainer_config["accumulate_grad_batches"] == 1
    assert cli.config["per_device_batch_size"] == EXPECTED_BATCH[name]
    assert cli.datamodule.batch_size == EXPECTED_BATCH[name]  # blobs.yaml reads ${per_device_batch_size}
    trainer = cli.trainer if cli.trainer is not None else cli.cpu_trainer
    assert cli.trainer is not None or name in CUDA_CONFIGS
    configured = cli.config_init["trainer"]["strategy"]
    # the configured MultiGPUStrategy runs, or (one device here) hands the Trainer the strategy it chose
    assert trainer.strategy is configured or trainer.strategy.choice is configured.choice
    assert isinstance(configured, MultiGPUStrategy) and configured.choice is not None
    assert {type(cb) for cb in trainer.callbacks} >= wanted
    if name in CUDA_CONFIGS:
        assert trainer_config["precision"] == "bf16-mixed" and trainer.precision == "bf16-mixed"


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


def test_devices_as_a_list_of_indices_resolves_on_a_machine_without_them():
    cli = build("--config", str(config_path("single_gpu")), "--config", str(BLOBS), "--trainer.devices=[0, 1]")
    assert cli.datamodule.batch_size == 128


def test_zero_accumulation_is_refused_with_the_parameter_named(capsys):
    with pytest.raises(SystemExit):
        build("--config", str(config_path("cpu")), "--config", str(BLOBS), "--trainer.accumulate_grad_batches=0")
    assert "accumulate_grad_batches must be a positive int, got 0" in capsys.readouterr().err


def test_robust_long_run_resumes_from_its_last_checkpoint_with_ckpt_path_last(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    on_cpu = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true"]
    common = ["--config", str(config_path("robust_long_run")), "--config", str(BLOBS), *on_cpu]
    common += ["--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0", "--data.num_samples=512"]

    first = MGPULightningCLI(args=["fit", *common, "--trainer.max_steps=3"])
    assert first.trainer.global_step == 3
    last = tmp_path / "runs" / "robust_long_run" / "checkpoints" / "last.ckpt"
    assert last.is_file()  # under the fixed dirpath, not under a logger version that a restart would bump

    second = MGPULightningCLI(args=["fit", *common, "--trainer.max_steps=5", "--ckpt_path=last"])
    assert second.trainer.global_step == 5
    assert second.trainer.ckpt_path == str(last)  # it resumed from step 3, not from scratch
    nan_skip = next(cb for cb in second.trainer.callbacks if isinstance(cb, NaNSkip))
    assert nan_skip.optimizer_steps == 5  # the callback's state came back from the checkpoint too


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


def test_config_command_imports_neither_torch_nor_lightning():
    import subprocess

    # python -m lightning_mgpu imports the package before its __main__: that import must not pull torch in
    for args in (["config", "cpu"], ["config"]):
        command = [sys.executable, "-X", "importtime", "-m", "lightning_mgpu", *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
        assert {"lightning_mgpu", "lightning_mgpu.configs"} <= imported
        assert not [name for name in imported if name.split(".")[0] in ("torch", "lightning", "lightning_fabric")]
    assert result.stdout.count(str(config_path("cpu"))) == 1


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
    # sync_batchnorm: auto synchronises BatchNorm, OOMBackoff among the callbacks (it replays a failed rank's part)
    assert "DistributedBatchNorm" in dumps[0]["layer_classes_during_fit"]
    assert "BatchNorm1d" not in dumps[0]["layer_classes_during_fit"]
    # the run's config.yaml records the batch size the interpolation produced
    saved = next(tmp_path.rglob("config.yaml")).read_text()
    assert "per_device_batch_size: 64" in saved and "batch_size: 64" in saved


def test_devices_chosen_by_free_memory_in_a_config(monkeypatch):
    import lightning_mgpu.memory.gpu_selection as gpu_selection
    from tests.memory.test_gpu_selection import three_gpus

    monkeypatch.setitem(sys.modules, "pynvml", three_gpus())  # free: torch 0 10 GiB, torch 1 6 GiB, torch 2 14 GiB
    monkeypatch.setattr(gpu_selection, "num_cuda_devices", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,1")
    monkeypatch.setenv(gpu_selection.SELECTED_GPUS_VARIABLE, "")
    cli = build(
        "--config", str(config_path("multi_gpu")), "--config", str(BLOBS), "--trainer.devices=${mgpu.free_gpus:2}"
    )
    assert cli.config["trainer"]["devices"] == [2, 0]
    assert cli.datamodule.batch_size == 128  # the global 256 over the 2 chosen GPUs
