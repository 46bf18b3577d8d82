"""MGPULightningCLI with a user's own configs: the per-device batch, strategy names, devices, DDP options from YAML."""

import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu import MultiGPUStrategy
from lightning_mgpu.cli import MGPULightningCLI
from lightning_mgpu.configs import config_path

REPO = Path(__file__).resolve().parents[1]
BLOBS = REPO / "examples" / "configs" / "blobs.yaml"
# the README's own YAML block (section "Use"): a trainer section of the user's, no global_batch_size in it
README_TRAINER = """
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: lightning_mgpu.MultiGPUStrategy
    init_args:
      sync_batchnorm: auto
      bucket_cap_mb: 25
      comm_hook: bf16
  callbacks:
    - class_path: lightning_mgpu.NaNSkip
"""
# the README's dict_kwargs example: first-class options under init_args, any other DDP argument under dict_kwargs
DDP_OPTIONS = """
trainer:
  strategy:
    class_path: lightning_mgpu.MultiGPUStrategy
    init_args:
      find_unused_parameters: true
      broadcast_buffers: false
    dict_kwargs:
      skip_all_reduce_unused_params: true
"""


@pytest.fixture(autouse=True)
def cli_environment(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # blobs.yaml names blobs.BlobClassifier
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # LightningCLI warns when pytest's own flags are in sys.argv


@pytest.fixture
def user_trainer(tmp_path) -> Path:
    path = tmp_path / "trainer.yaml"
    path.write_text(README_TRAINER)
    return path


def build(*args: str) -> MGPULightningCLI:
    return MGPULightningCLI(run=False, args=list(args), save_config_callback=None)


def printed_config(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        MGPULightningCLI(args=["fit", *args, "--print_config"])
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), captured.err[-2000:]
    return yaml.safe_load(captured.out)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--global_batch_size=128"], 64),  # 128 over the README block's 2 devices
        (["--global_batch_size=128", "--trainer.devices=4"], 32),
        (["--global_batch_size=128", "--trainer.accumulate_grad_batches=2"], 32),
        (["--per_device_batch_size=16"], 16),
        (["--global_batch_size=128", "--per_device_batch_size=16"], 16),  # a per-device batch given wins
    ],
)
def test_a_users_own_trainer_config_derives_the_per_device_batch(user_trainer, overrides, expected):
    cli = build("--config", str(user_trainer), "--config", str(BLOBS), *overrides)
    assert cli.config["per_device_batch_size"] == expected
    assert cli.datamodule.batch_size == expected


def test_print_config_shows_the_derived_batch_under_the_fit_subcommand(user_trainer, capsys):
    config = printed_config(capsys, "--config", str(user_trainer), "--config", str(BLOBS), "--global_batch_size=128")
    assert config["global_batch_size"] == 128
    assert config["per_device_batch_size"] == 64
    assert config["data"]["init_args"]["batch_size"] == 64


def test_global_batch_size_as_a_key_of_the_users_config(user_trainer, tmp_path):
    sizes = tmp_path / "sizes.yaml"
    sizes.write_text("global_batch_size: 96\n")
    cli = build("--config", str(user_trainer), "--config", str(BLOBS), "--config", str(sizes))
    assert cli.datamodule.batch_size == 48


def test_an_unset_per_device_batch_that_a_config_reads_is_a_usage_error(user_trainer, capsys):
    with pytest.raises(SystemExit) as exit_info:
        MGPULightningCLI(args=["fit", "--config", str(user_trainer), "--config", str(BLOBS), "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "per_device_batch_size is not set, and data.init_args.batch_size reads it" in err
    assert "--global_batch_size=N" in err and "--per_device_batch_size=N" in err
    assert "python -m lightning_mgpu config" in err


def test_no_batch_size_is_needed_when_no_config_reads_it(user_trainer, tmp_path):
    data = tmp_path / "data.yaml"
    data.write_text(BLOBS.read_text().replace("${per_device_batch_size}", "24"))
    cli = build("--config", str(user_trainer), "--config", str(data))
    assert cli.config["per_device_batch_size"] is None
    assert cli.datamodule.batch_size == 24


@pytest.mark.parametrize("config", [None, "cpu"])
def test_a_misspelt_strategy_name_is_a_usage_error_naming_the_closest(user_trainer, capsys, config):
    first = str(config_path(config)) if config else str(user_trainer)
    with pytest.raises(SystemExit) as exit_info:
        build("--config", first, "--config", str(BLOBS), "--global_batch_size=64", "--trainer.strategy=mgpu_dpp")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "trainer.strategy='mgpu_dpp' is not a registered strategy name" in err
    assert "lightning_mgpu registers: mgpu, mgpu_ddp, mgpu_ddp_spawn" in err
    assert "did you mean 'mgpu_dp' or 'mgpu_ddp'?" in err


def test_a_registered_strategy_name_builds_the_trainer(user_trainer):
    cli = build("--config", str(user_trainer), "--config", str(BLOBS), "--per_device_batch_size=8")
    assert isinstance(cli.trainer.strategy, MultiGPUStrategy)
    cli = build(
        "--config",
        str(user_trainer),
        "--config",
        str(BLOBS),
        "--per_device_batch_size=8",
        "--trainer.strategy=mgpu_ddp",
    )
    assert isinstance(cli.trainer.strategy, MultiGPUStrategy) and cli.trainer.strategy.choice.mode == "ddp"


@pytest.mark.parametrize(
    ("flag", "expected"),
    [("4", 4), ("auto", "auto"), ("-1", -1), ("0,1", "0,1"), ("[0, 1]", [0, 1])],
)
def test_devices_from_the_command_line_keep_their_type(user_trainer, capsys, flag, expected):
    config = printed_config(
        capsys,
        "--config",
        str(user_trainer),
        "--config",
        str(BLOBS),
        "--per_device_batch_size=8",
        f"--trainer.devices={flag}",
    )
    assert config["trainer"]["devices"] == expected
    assert type(config["trainer"]["devices"]) is type(expected)


def test_devices_as_a_count_reach_the_batch_arithmetic_and_the_trainer_as_an_int(user_trainer):
    cli = build("--config", str(user_trainer), "--config", str(BLOBS), "--global_batch_size=96", "--trainer.devices=3")
    assert cli.config["trainer"]["devices"] == 3 and isinstance(cli.config["trainer"]["devices"], int)
    assert cli.datamodule.batch_size == 32
    assert cli.trainer.num_devices == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a machine without GPUs")
def test_every_gpu_on_a_machine_without_gpus_says_to_name_the_count(capsys):
    # the README's --print_config example with the multi_gpu config (devices: -1), on a machine without GPUs
    args = ["--config", str(config_path("multi_gpu")), "--config", str(BLOBS), "--global_batch_size=1024"]
    with pytest.raises(SystemExit):
        MGPULightningCLI(args=["fit", *args, "--trainer.num_nodes=2", "--print_config"])
    err = capsys.readouterr().err
    assert "devices=-1 with accelerator='cuda': torch sees no CUDA GPU on this machine to count" in err
    assert "--trainer.devices=N" in err


class RecordDDP(Callback):
    """Keeps the DistributedDataParallel wrapper's settings as the fit built them."""

    def on_train_start(self, trainer, pl_module):
        ddp = trainer.strategy.model
        assert isinstance(ddp, DistributedDataParallel)
        self.seen = {
            "find_unused_parameters": ddp.find_unused_parameters,
            "broadcast_buffers": ddp.broadcast_buffers,
            "skip_all_reduce_unused_params": getattr(ddp, "skip_all_reduce_unused_params", None),
        }


def test_ddp_options_from_yaml_first_class_and_dict_kwargs_reach_distributed_data_parallel(tmp_path):
    import inspect

    if "skip_all_reduce_unused_params" not in inspect.signature(DistributedDataParallel).parameters:
        pytest.skip("this torch's DistributedDataParallel has no skip_all_reduce_unused_params (torch >= 2.8)")
    torch.manual_seed(0)
    options = tmp_path / "ddp.yaml"
    options.write_text(DDP_OPTIONS)
    one_process = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy.init_args.mode=ddp"]
    quiet = ["--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
    cli = build(
        "--config", str(BLOBS), "--config", str(options), "--per_device_batch_size=16", "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=0", *one_process, *quiet,
    )  # fmt: skip
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MultiGPUStrategy)
    assert strategy._ddp_kwargs["broadcast_buffers"] is False
    assert strategy._ddp_kwargs["find_unused_parameters"] is True
    assert strategy._ddp_kwargs["skip_all_reduce_unused_params"] is True
    record = RecordDDP()
    cli.trainer.callbacks.append(record)
    try:
        cli.trainer.fit(cli.model, cli.datamodule)  # one process: DDP over a gloo group of size 1, in this process
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert cli.trainer.global_step == 2
    assert record.seen == {
        "find_unused_parameters": True,
        "broadcast_buffers": False,
        "skip_all_reduce_unused_params": True,
    }


def test_a_misspelt_ddp_option_under_dict_kwargs_is_refused_with_the_closest_name(tmp_path):
    options = tmp_path / "ddp.yaml"
    options.write_text(DDP_OPTIONS.replace("skip_all_reduce_unused_params", "brodcast_buffers"))
    # jsonargparse reports the strategy class's TypeError inside its own ValueError when it instantiates the Trainer
    with pytest.raises(
        ValueError, match=r"unexpected keyword argument 'brodcast_buffers' \(did you mean 'broadcast_buffers'\?\)"
    ):
        build(
            "--config", str(BLOBS), "--config", str(options), "--per_device_batch_size=16", "--trainer.accelerator=cpu"
        )


@pytest.mark.parametrize("parser_mode", ["yaml", "omegaconf"])
def test_other_parser_modes_leave_per_device_batch_size_unset(parser_mode):
    cli = MGPULightningCLI(
        BoringModel, args=["--trainer.accelerator=cpu"], run=False, parser_kwargs={"parser_mode": parser_mode}
    )
    assert cli.config["per_device_batch_size"] is None


def test_the_performance_monitor_is_configured_from_yaml(tmp_path):
    path = tmp_path / "monitors.yaml"
    path.write_text(
        """
trainer:
  accelerator: cpu
  callbacks:
    - class_path: lightning_mgpu.PerformanceMonitor
      init_args:
        tokens_key: tokens
        straggler_margin: 0.3
        straggler_windows: 5
        comm_timing: false
"""
    )
    cli = build("--config", str(BLOBS), "--config", str(path), "--global_batch_size=8")
    (monitor,) = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "PerformanceMonitor"]
    assert (monitor.tokens_key, monitor.straggler_margin, monitor.straggler_windows) == ("tokens", 0.3, 5)
    assert monitor.comm_timing is False
