"""MultiGPUStrategy as the Trainer builds it: names, choices, bad input. No process is launched here."""

import logging
import sys

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

import lightning_mgpu
from lightning_mgpu import DataParallelStrategy, DDPStrategy, FSDPStrategy, MultiGPUStrategy, SingleDeviceStrategy
from lightning_mgpu.strategies import REGISTERED_STRATEGIES
from tests.helpers.processes import clear_launch_environment
from tests.helpers.trainer import QUIET


def make_trainer(**kwargs):
    return Trainer(**QUIET, **kwargs)


@pytest.fixture(autouse=True)
def _clean_launch_env(monkeypatch):
    clear_launch_environment(monkeypatch)


@pytest.mark.parametrize("name", sorted(REGISTERED_STRATEGIES))
def test_every_registered_name_builds_a_trainer(name):
    if name == "mgpu_dp":
        with pytest.raises(ValueError, match="mode='dp'"):
            make_trainer(strategy=name, accelerator="cpu", devices=2)
        return
    trainer = make_trainer(strategy=name, accelerator="cpu", devices=2)
    expected_class = FSDPStrategy if name == "mgpu_fsdp" else MultiGPUStrategy
    assert isinstance(trainer.strategy, expected_class)
    expected_mode = REGISTERED_STRATEGIES[name][0]["mode"]
    assert trainer.strategy.choice.mode == (expected_mode if expected_mode != "auto" else "ddp")
    if "comm_hook" in REGISTERED_STRATEGIES[name][0]:
        assert trainer.strategy.comm_hook == REGISTERED_STRATEGIES[name][0]["comm_hook"]


def test_names_are_registered_on_import():
    from lightning.pytorch.strategies import StrategyRegistry

    lightning_mgpu.register_strategies()  # idempotent
    for name in ("mgpu", "mgpu_ddp", "mgpu_ddp_spawn", "mgpu_ddp_fork", "mgpu_dp", "mgpu_fsdp"):
        assert name in StrategyRegistry


def test_one_device_becomes_single_device_strategy(caplog):
    with caplog.at_level(logging.INFO):
        trainer = make_trainer(strategy="mgpu", accelerator="cpu", devices=1)
    strategy = trainer.strategy
    assert type(strategy) is SingleDeviceStrategy
    assert strategy.choice.mode == "single"
    assert strategy.root_device == torch.device("cpu")
    assert "chose 'single'" in caplog.text


def test_several_cpu_devices_from_a_script_use_ddp_with_subprocess_launch():
    trainer = make_trainer(strategy="mgpu", accelerator="cpu", devices=2)
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy.choice.mode == "ddp"
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)
    assert trainer.strategy.num_processes == 2


def test_interactive_session_on_cpu_forks(monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    trainer = make_trainer(strategy="mgpu", accelerator="cpu", devices=2)
    assert trainer.strategy.choice.mode == "ddp_fork"
    assert isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
    assert trainer.strategy.launcher._start_method == "fork"


def test_torchrun_environment_means_ddp_without_launcher(monkeypatch):
    for key, value in {
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": "x",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }.items():
        monkeypatch.setenv(key, value)
    trainer = make_trainer(strategy="mgpu", accelerator="cpu", devices=1)
    assert trainer.strategy.choice.mode == "ddp"
    assert "TorchElasticEnvironment" in trainer.strategy.choice.reason
    assert trainer.strategy.launcher.is_interactive_compatible is False
    assert not trainer.strategy.launcher.__class__.__name__.startswith("_MultiProcessing")


def test_slurm_environment_means_ddp(monkeypatch):
    # srun started 2 tasks on one node, one per device. num_nodes=1, so the multi-node rule does not decide: the mode
    # alone cannot tell the SLURM detection from the rule for 2 devices in a script (also DDP); the reason can
    for key, value in {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NAME": "train",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "node1",
        "SLURM_JOB_ID": "1",
    }.items():
        monkeypatch.setenv(key, value)
    trainer = make_trainer(strategy="mgpu", accelerator="cpu", devices=2, num_nodes=1)
    assert trainer.strategy.choice.mode == "ddp"
    assert trainer.strategy.choice.reason == (
        "processes were launched by SLURMEnvironment (world size 2): DDP joins them"
    )
    assert trainer.strategy.cluster_environment.creates_processes_externally  # srun started them: none re-run
    assert trainer.world_size == 2 and trainer.global_rank == 0


def test_num_nodes_means_ddp():
    trainer = make_trainer(strategy="mgpu", accelerator="cpu", devices=1, num_nodes=2)
    assert trainer.strategy.choice.mode == "ddp"
    assert "num_nodes=2" in trainer.strategy.choice.reason


@pytest.mark.parametrize(("mode", "start"), [("ddp", None), ("ddp_spawn", "spawn"), ("ddp_fork", "fork")])
def test_forced_ddp_modes_pick_their_launcher(mode, start):
    trainer = make_trainer(strategy=MultiGPUStrategy(mode=mode), accelerator="cpu", devices=2)
    assert trainer.strategy.choice.mode == mode
    assert trainer.strategy.choice.reason == f"mode={mode!r} was set explicitly"
    launcher = trainer.strategy.launcher
    if start is None:
        assert isinstance(launcher, _SubprocessScriptLauncher)
    else:
        assert launcher._start_method == start


def test_strategy_object_and_cuda_untouched():
    strategy = MultiGPUStrategy(bucket_cap_mb=5, comm_hook="bf16", static_graph=True)
    trainer = make_trainer(strategy=strategy, accelerator="cpu", devices=2)
    assert trainer.strategy is strategy
    assert strategy._ddp_kwargs["bucket_cap_mb"] == 5
    assert strategy._ddp_kwargs["static_graph"] is True
    assert not torch.cuda.is_initialized()


def test_forced_dp_on_cpu_fails_at_trainer_construction():
    strategy = MultiGPUStrategy(mode="dp")  # building the strategy alone is fine
    with pytest.raises(ValueError, match=r"mode='dp'\) needs CUDA GPUs.*'cpu'"):
        make_trainer(strategy=strategy, accelerator="cpu", devices=2)


def test_forced_single_with_two_devices_fails_at_trainer_construction():
    with pytest.raises(ValueError, match=r"mode='single'.*2 device"):
        make_trainer(strategy=MultiGPUStrategy(mode="single"), accelerator="cpu", devices=2)


def test_dataparallel_strategy_refuses_cpu_devices_at_fit():
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    trainer = make_trainer(strategy=DataParallelStrategy(), accelerator="cpu", devices=1, max_steps=1)
    with pytest.raises(MisconfigurationException, match="CUDA"):
        trainer.fit(BoringModel())


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"mode": "fastest"}, ValueError, r"mode must be one of 'auto', 'single'.*got 'fastest'"),
        ({"bucket_cap_mb": 0}, ValueError, r"bucket_cap_mb must be a positive number of MB, got 0"),
        ({"bucket_cap_mb": -5}, ValueError, r"bucket_cap_mb must be a positive number of MB, got -5"),
        ({"bucket_cap_mb": float("nan")}, ValueError, r"bucket_cap_mb"),
        (
            {"bucket_cap_mb": "25"},
            TypeError,
            r"bucket_cap_mb must be a positive number of MB, got '25'; use None for torch's default \(25\) or 'auto'",
        ),
        (
            {"comm_hook": "zstd"},
            ValueError,
            r"comm_hook must be one of None, 'auto', 'fp16', 'bf16', 'powersgd', got 'zstd'$",
        ),
        ({"comm_hook": 16}, TypeError, r"comm_hook must be one of None, 'auto', 'fp16', 'bf16', 'powersgd', got 16$"),
        ({"mode": 2}, TypeError, r"mode must be one of 'auto', 'single'.*got 2$"),
        ({"bucket_cap_mb": "fast"}, TypeError, r"bucket_cap_mb must be a positive number of MB, got 'fast'; use None"),
        ({"bucket_tuning_steps": 9}, ValueError, r"bucket_tuning_steps must be an int >= 10, got 9"),
        ({"bucket_tuning_steps": 30.0}, TypeError, r"bucket_tuning_steps must be an int >= 10, got 30.0"),
        (
            {"comm_hook": "auto", "comm_hook_candidates": []},
            TypeError,
            r"comm_hook_candidates must be a non-empty list",
        ),
        (
            {"comm_hook_candidates": ["bf16"]},
            ValueError,
            r"comm_hook_candidates=\['bf16'\] only applies with comm_hook='auto'",
        ),
        (
            {"comm_hook": "auto", "comm_hook_candidates": ["powersgd"]},
            ValueError,
            r"comm_hook_candidates may hold 'fp16', 'bf16', got 'powersgd' \(its warm-up steps are exact",
        ),
        (
            {"comm_hook": "auto", "comm_hook_candidates": ["zstd"]},
            ValueError,
            r"comm_hook_candidates may hold 'fp16', 'bf16', got 'zstd'$",
        ),
        (
            {"comm_hook": "auto", "comm_hook_candidates": "bf16"},
            TypeError,
            r"comm_hook_candidates must be a non-empty list.*got .bf16.$",
        ),
        ({"comm_hook": "auto", "ddp_comm_hook": print}, ValueError, r"comm_hook='auto' chooses the hook itself"),
        ({"sync_batchnorm": "yes"}, ValueError, r"sync_batchnorm must be one of True, False, 'auto', got 'yes'"),
        ({"sync_batchnorm": 1}, TypeError, r"sync_batchnorm must be one of True, False, 'auto', got 1"),
        ({"static_graph": "true"}, TypeError, r"static_graph must be True or False, got 'true'"),
        ({"gradient_as_bucket_view": 1}, TypeError, r"gradient_as_bucket_view must be True or False"),
        ({"find_unused_parameters": None}, TypeError, r"find_unused_parameters must be True or False"),
        ({"powersgd_rank": 0}, ValueError, r"powersgd_rank must be an int >= 1, got 0"),
        ({"powersgd_rank": 2.0}, TypeError, r"powersgd_rank must be an int >= 1, got 2.0"),
        ({"powersgd_warmup_steps": -1}, ValueError, r"powersgd_warmup_steps must be an int >= 0, got -1"),
        (
            {"bucket_cap_mb_list": [5, 25]},  # MultiGPUStrategy's default bucket_cap_mb is "auto"
            ValueError,
            r"bucket_cap_mb='auto' and bucket_cap_mb_list=\[5, 25\] both set the bucket sizes.*ignores bucket_cap_mb"
            r".*Pass bucket_cap_mb=None.*to let 'auto' time sizes$",
        ),
        (
            {"bucket_cap_mb": 50, "bucket_cap_mb_list": [5]},
            ValueError,
            r"bucket_cap_mb=50 and bucket_cap_mb_list=\[5\] both set.*or leave bucket_cap_mb_list out$",
        ),
    ],
)
def test_bad_input_is_named_at_construction(kwargs, error, pattern):
    with pytest.raises(error, match=f"MultiGPUStrategy: {pattern}"):
        MultiGPUStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"brodcast_buffers": False},
            r"unexpected keyword argument 'brodcast_buffers' \(did you mean 'broadcast_buffers'",
        ),
        ({"static_grpah": True}, r"unexpected keyword argument 'static_grpah' \(did you mean 'static_graph'"),
        ({"ddp_comm_hok": None}, r"unexpected keyword argument 'ddp_comm_hok' \(did you mean 'ddp_comm_hook'"),
        ({"device_ids": [0]}, r"device_ids is set by the strategy from the Trainer's devices"),
        ({"broadcast_buffers": "no"}, r"broadcast_buffers must be True, False or None, got 'no'"),
    ],
)
def test_a_misspelt_ddp_keyword_argument_is_refused_at_construction(kwargs, pattern):
    with pytest.raises(TypeError, match=f"^MultiGPUStrategy: {pattern}"):
        MultiGPUStrategy(**kwargs)
    with pytest.raises(TypeError, match=f"^DDPStrategy: {pattern}"):
        DDPStrategy(**kwargs)


def test_ddp_and_lightning_keyword_arguments_are_accepted_and_passed_on():
    strategy = MultiGPUStrategy(init_sync=True, output_device=None, model_averaging_period=None, start_method="spawn")
    assert strategy._ddp_kwargs["init_sync"] is True and strategy._ddp_kwargs["output_device"] is None
    assert "model_averaging_period" not in strategy._ddp_kwargs  # Lightning's DDPStrategy keeps that one itself
    assert "broadcast_buffers" not in strategy._ddp_kwargs  # torch's default unless asked for (2.13 deprecates it)
    assert MultiGPUStrategy(broadcast_buffers=False)._ddp_kwargs["broadcast_buffers"] is False
    listed = MultiGPUStrategy(bucket_cap_mb=None, bucket_cap_mb_list=[5, 25])
    assert listed._ddp_kwargs["bucket_cap_mb_list"] == [5, 25] and "bucket_cap_mb" not in listed._ddp_kwargs
    assert not listed.tunes_buckets


def test_a_misspelt_strategy_name_gets_the_registered_names_and_the_closest():
    with pytest.raises(ValueError, match="You selected an invalid strategy name") as raised:
        make_trainer(strategy="mgpu_dpp", accelerator="cpu", devices=2)
    message = str(raised.value)
    assert "lightning_mgpu registers: mgpu, mgpu_ddp, mgpu_ddp_spawn, mgpu_ddp_fork, mgpu_dp" in message
    assert "did you mean 'mgpu_dp' or 'mgpu_ddp'?" in message
    with pytest.raises(ValueError, match=r"did you mean 'ddp_spawn' or 'mgpu_ddp_spawn'\?"):
        make_trainer(strategy="ddp_spwan")  # Lightning's own names are suggested too


def test_import_registers_the_names_in_a_fresh_process():
    import subprocess

    registered = (
        "import lightning_mgpu; from lightning.pytorch.strategies import StrategyRegistry as R; print('mgpu' in R)"
    )
    result = subprocess.run([sys.executable, "-c", registered], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "True", result.stderr[-2000:]


def test_ddp_strategy_names_itself_in_errors():
    with pytest.raises(ValueError, match=r"^DDPStrategy: start_method must be"):
        DDPStrategy(start_method="thread")
    with pytest.raises(ValueError, match=r"^DDPStrategy: sync_batchnorm"):
        DDPStrategy(sync_batchnorm="on")
