"""``python -m lightning_mgpu env``: run for real on this machine, and against a fake NVML for the GPU parts."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from lightning_mgpu import MultiGPUStrategy
from lightning_mgpu.commands import env as env_module
from lightning_mgpu.commands.env import (
    build_launch_context,
    detect_launcher,
    environment_report,
    torch_device_lines,
)
from lightning_mgpu.core.devices import count_processes
from lightning_mgpu.core.nvml import NVMLSession
from lightning_mgpu.core.strategy_choice import LaunchContext, choose_strategy
from tests.helpers.fake_pynvml import FakeGPU, FakeMIG, FakeNVML, GiB, MiB
from tests.helpers.processes import clear_launch_environment
from tests.helpers.trainer import QUIET

ROOT = Path(__file__).resolve().parents[1]
A100 = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
T4 = "GPU-bbbbbbbb-0000-1111-2222-333333333333"
A100_MIG = "GPU-cccccccc-0000-1111-2222-333333333333"
MIG_1 = "MIG-dddddddd-0000-1111-2222-333333333333"


@pytest.fixture(autouse=True)
def _clean_launch_env(monkeypatch):
    clear_launch_environment(monkeypatch, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_mgpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )


def fake_nvml() -> FakeNVML:
    return FakeNVML(
        [
            FakeGPU("NVIDIA A100-SXM4-40GB", A100, memory_total=40 * GiB, memory_used=10 * GiB),
            FakeGPU("Tesla T4", T4, memory_total=15 * GiB, memory_used=512 * MiB),
            FakeGPU(
                "NVIDIA A100-SXM4-40GB",
                A100_MIG,
                memory_total=40 * GiB,
                migs=[FakeMIG(MIG_1, gpu_instance_id=3, compute_instance_id=0, memory_used=1 * GiB)],
            ),
        ],
        driver_version="550.54.15",
    )


def test_env_on_this_machine():
    session = NVMLSession(warn=lambda message: None)
    if session.start():
        session.shutdown()
        pytest.skip("NVML works here; this test describes a machine without it")
    result = run_cli("env")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "NVML unavailable: nvmlInit failed" in out and "Library Not Found" in out
    expected = choose_strategy(LaunchContext("cpu", 1))
    assert f"MultiGPUStrategy would choose: {expected.mode}" in out
    assert f"because: {expected.reason}" in out
    assert "torch.cuda.device_count(): 0" in out
    assert "gloo: yes" in out
    assert "CUDA initialised in this process: no" in out


def test_env_with_two_cpu_devices():
    result = run_cli("env", "--accelerator", "cpu", "--devices", "2")
    assert result.returncode == 0, result.stderr
    expected = choose_strategy(LaunchContext("cpu", 2))
    assert expected.mode == "ddp"
    assert "assuming: accelerator=cpu, devices=2, num_nodes=1" in result.stdout
    assert "MultiGPUStrategy would choose: ddp\n" in result.stdout
    assert f"because: {expected.reason}" in result.stdout


def test_env_under_torchrun_variables(monkeypatch):
    for name, value in {"TORCHELASTIC_RUN_ID": "run", "WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    result = run_cli("env", "--accelerator", "cpu")
    assert result.returncode == 0, result.stderr
    assert "WORLD_SIZE=4" in result.stdout and "LOCAL_RANK=1" in result.stdout
    assert "TorchElasticEnvironment: processes were started outside Lightning (world size 4)" in result.stdout
    assert "MultiGPUStrategy would choose: ddp\n" in result.stdout


def test_without_a_command_prints_help_and_exits_2():
    result = run_cli()
    assert result.returncode == 2
    assert "usage: python -m lightning_mgpu" in result.stderr and "env" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("env", "--devices", "x"), "devices='x' with accelerator='cpu': give a number of processes (--devices N)"),
        (("env", "--accelerator", "cpu", "--devices", "-1"), "devices=-1 with accelerator='cpu': give a number of"),
        # checked by environment_report now, so that building the parser imports no torch
        (("env", "--accelerator", "tpu"), "accelerator must be one of 'auto', 'cpu', 'cuda', 'gpu', got 'tpu'"),
    ],
)
def test_bad_arguments_exit_2(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert "error:" in result.stderr and message in result.stderr


def test_report_with_fake_gpus():
    fake = fake_nvml()
    messages: list[str] = []
    report = environment_report(
        accelerator="cpu", devices=1, session=NVMLSession(load=lambda: fake, warn=messages.append)
    )
    assert "driver: 550.54.15" in report
    assert "GPUs: 3" in report
    assert f"GPU 0: NVIDIA A100-SXM4-40GB, {A100}, memory 40960 MiB total, 30720 MiB free, 50% busy" in report
    assert f"GPU 1: Tesla T4, {T4}, memory 15360 MiB total, 14848 MiB free" in report
    assert f"GPU 2: NVIDIA A100-SXM4-40GB, {A100_MIG}, memory 40960 MiB total" in report
    assert (
        f"MIG 3/0 of GPU 2: NVIDIA A100-SXM4-40GB MIG 1g.5gb, {MIG_1}, memory 5120 MiB total, 4096 MiB free" in report
    )
    assert "NVML unavailable" not in report
    # different models without PCI_BUS_ID order: the report says how to make indices agree
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in report
    assert "MultiGPUStrategy would choose: single" in report


@pytest.mark.parametrize(
    ("visible", "order", "count", "expected"),
    [
        (
            f"{T4},{MIG_1}",
            None,
            2,
            [f"cuda:0 -> NVML GPU 1, Tesla T4, {T4}", f"cuda:1 -> MIG 3/0 of NVML GPU 2, {MIG_1}"],
        ),
        ("1,0", "PCI_BUS_ID", 2, [f"cuda:0 -> NVML GPU 1, Tesla T4, {T4}", "cuda:1 -> NVML GPU 0, NVIDIA A100"]),
        ("1,0", None, 2, ["cuda:0 -> unknown (see notes)", "cuda:1 -> unknown (see notes)"]),
    ],
)
def test_torch_device_mapping_lines(monkeypatch, visible, order, count, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if order is not None:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    notes: list[str] = []
    session = NVMLSession(load=fake_nvml, warn=notes.append)
    lines = torch_device_lines(session, notes, device_count=count)
    assert f"CUDA_VISIBLE_DEVICES: {visible!r}" in lines
    for line in expected:
        assert any(actual.startswith(line) for actual in lines), (line, lines)
    assert bool(notes) == ("unknown" in expected[0])


def test_torch_device_mapping_prefers_the_uuids_cuda_reports(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # ambiguous for GPUs of different models
    notes: list[str] = []
    session = NVMLSession(load=fake_nvml, warn=notes.append)
    lines = torch_device_lines(session, notes, device_count=2, uuids=[T4[4:], MIG_1])
    assert f"cuda:0 -> NVML GPU 1, Tesla T4, {T4}" in lines
    assert f"cuda:1 -> MIG 3/0 of NVML GPU 2, {MIG_1}" in lines
    assert notes == []


def test_torch_device_mapping_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    lines = torch_device_lines(NVMLSession(warn=lambda message: None), [], device_count=2)
    assert lines[-1] == "torch index -> NVML device: unknown, NVML is unavailable"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 0}, "devices=0 with accelerator='cpu': give a number of processes"),
        ({"devices": -2}, "devices=-2 with accelerator='cpu': give a number of processes"),
        ({"accelerator": "cpu", "devices": -1}, "devices=-1 with accelerator='cpu'"),
        ({"accelerator": "cpu", "devices": "0,1"}, "-1 and lists of GPU indices select CUDA GPUs"),
        ({"num_nodes": 0}, "num_nodes must be"),
        ({"accelerator": "tpu"}, "accelerator must be one of"),
    ],
)
def test_build_launch_context_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_launch_context(**kwargs)


def test_devices_are_counted_as_the_trainer_and_the_batch_arithmetic_count_them():
    # one home for device arithmetic: a list of GPU indices is 2 devices here as in the configs' batch size
    assert build_launch_context(accelerator="cuda", devices="0,1").num_devices == 2
    assert build_launch_context(accelerator="cpu", devices="3").num_devices == 3
    assert count_processes("0,1", 1, "cpu") == 2


def test_detect_launcher_leaves_the_environment_alone(monkeypatch):
    assert detect_launcher() == (None, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert detect_launcher() == ("LightningEnvironment", 1)
    assert detect_launcher(num_devices=2, num_nodes=2) == ("LightningEnvironment", 4)  # as set_world_ranks sets it
    for name, value in {"TORCHELASTIC_RUN_ID": "run", "WORLD_SIZE": "3", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    assert detect_launcher() == ("TorchElasticEnvironment", 3)
    assert dict(os.environ) == before


def test_detect_launcher_restores_what_lsf_writes(monkeypatch, tmp_path):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text(f"{socket.gethostname()}\n{socket.gethostname()}\n")
    for name, value in {
        "LSB_JOBID": "1234",
        "LSB_DJOB_RANKFILE": str(rankfile),
        "JSM_NAMESPACE_LOCAL_RANK": "0",
        "JSM_NAMESPACE_SIZE": "2",
        "JSM_NAMESPACE_RANK": "0",
    }.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    assert detect_launcher(num_devices=2) == ("LSFEnvironment", 2)
    assert dict(os.environ) == before  # LSFEnvironment() sets MASTER_ADDR and MASTER_PORT


def test_launch_environment_lightning_rejects_is_reported(monkeypatch):
    for name, value in {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(name, value)
    report = environment_report(accelerator="cpu", devices=2, session=NVMLSession(load=fake_nvml, warn=[].append))
    assert "MultiGPUStrategy cannot decide: Lightning would fail to start here: " in report
    assert "--ntasks-per-node" in report


@pytest.mark.parametrize(
    ("env", "devices", "num_nodes"),
    [
        ({}, 2, 1),
        ({}, 1, 1),
        ({}, 3, 1),
        ({"LOCAL_RANK": "0"}, 2, 1),
        ({"TORCHELASTIC_RUN_ID": "run", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, 2, 1),
        ({"TORCHELASTIC_RUN_ID": "run", "WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}, 2, 2),
    ],
)
def test_agrees_with_the_strategy_the_trainer_builds(monkeypatch, env, devices, num_nodes):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    context = build_launch_context("cpu", devices, num_nodes)
    strategy = MultiGPUStrategy()
    trainer = Trainer(**QUIET, accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy)
    assert trainer.strategy.choice == choose_strategy(context)
    if isinstance(trainer.strategy, MultiGPUStrategy):
        assert trainer.strategy.launch_context() == context


def test_env_with_cuda_and_no_gpu_reports_instead_of_failing(monkeypatch):
    # what a user runs env for: a broken driver, an empty CUDA_VISIBLE_DEVICES, a login node
    monkeypatch.setattr(env_module, "visible_cuda_devices", lambda: 0)
    context = build_launch_context(accelerator="cuda", devices="auto")
    assert (context.accelerator, context.num_devices) == ("cuda", 0)
    report = environment_report(accelerator="cuda", devices=-1, session=NVMLSession(load=fake_nvml, warn=[].append))
    assert "no CUDA device visible to torch: the Trainer would refuse to start" in report
