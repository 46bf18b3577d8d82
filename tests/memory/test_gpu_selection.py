"""GPU selection by free memory on a fake NVML (reordered ``CUDA_VISIBLE_DEVICES``), and on real GPUs where present."""

import sys

import pytest
import torch
from omegaconf import OmegaConf

import lightning_mgpu.memory.gpu_selection as gpu_selection
from lightning_mgpu.cli import register_resolvers
from lightning_mgpu.core.nvml import NVMLSession
from lightning_mgpu.memory.gpu_selection import SELECTED_GPUS_VARIABLE, GPUSelectionError, select_gpus
from tests.helpers.fake_pynvml import FakeGPU, FakeNVML, GiB, NVMLError_DriverNotLoaded
from tests.helpers.runif import run_if

UUIDS = [f"GPU-{digit * 8}-0000-1111-2222-333333333333" for digit in "123"]


def three_gpus(**kwargs) -> FakeNVML:
    """Three GPUs of one model with 16 GiB each: NVML's GPU 0 has 6 GiB free, GPU 1 14 GiB, GPU 2 10 GiB."""
    used = [10 * GiB, 2 * GiB, 6 * GiB]
    gpus = [FakeGPU("NVIDIA H100 80GB HBM3", uuid, memory_used=u) for uuid, u in zip(UUIDS, used, strict=True)]
    return FakeNVML(gpus, **kwargs)


@pytest.fixture(autouse=True)
def fresh_launch(monkeypatch):
    monkeypatch.setenv(SELECTED_GPUS_VARIABLE, "")  # restored (removed) after the test, whatever select_gpus sets
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,1")  # torch 0 is NVML's GPU 2, torch 1 GPU 0, torch 2 GPU 1
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


def select(count, min_free_mb=0.0, fake=None):
    session = NVMLSession(load=lambda: fake or three_gpus(), warn=lambda message: None)
    return select_gpus(count, min_free_mb, session=session, visible_count=3)


def test_the_gpus_with_the_most_free_memory_come_first_in_torch_numbering():
    # free: torch 0 (NVML 2) 10 GiB, torch 1 (NVML 0) 6 GiB, torch 2 (NVML 1) 14 GiB
    assert select(2) == [2, 0]
    assert select(3) == [2, 0, 1]


def test_a_floor_leaves_out_gpus_with_less_free_memory():
    assert select(1, min_free_mb=12 * 1024) == [2]
    with pytest.raises(GPUSelectionError) as error:
        select(2, min_free_mb=12 * 1024)
    message = str(error.value)
    assert "2 GPU(s) with at least 12,288 MiB free asked for, 1 have it" in message
    assert f"cuda:0 ({UUIDS[2]}): 10,240 MiB free" in message and f"cuda:2 ({UUIDS[1]}): 14,336 MiB free" in message


def test_more_gpus_than_visible_is_refused_naming_the_visible_ones(monkeypatch):
    with pytest.raises(GPUSelectionError, match=r"4 GPU\(s\) asked for, but torch sees 3 .*'2,0,1'"):
        select(4)


def test_gpus_that_cannot_be_told_apart_are_refused_not_guessed(monkeypatch):
    # different models numbered by index: CUDA's fastest-first order may differ from NVML's
    mixed = FakeNVML([FakeGPU("Tesla T4", UUIDS[0]), FakeGPU("NVIDIA A100", UUIDS[1]), FakeGPU("Tesla T4", UUIDS[2])])
    with pytest.raises(GPUSelectionError, match=r"cannot tell which NVML GPU torch device\(s\) \[0, 1, 2\] are"):
        select(1, fake=mixed)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(UUIDS[::-1]))  # by UUID, any order resolves
    assert select(1, fake=mixed) in ([0], [1], [2])


def test_without_nvml_the_error_says_why():
    with pytest.raises(GPUSelectionError, match=r"cannot read free GPU memory: .*Driver Not Loaded"):
        select(1, fake=three_gpus(init_error=NVMLError_DriverNotLoaded()))


@pytest.mark.parametrize(
    ("count", "min_free_mb", "error", "match"),
    [
        (0, 0, ValueError, "count must be an int >= 1, got 0"),
        ("2", 0, TypeError, "count must be an int"),
        (1, -5, ValueError, "min_free_mb must be a non-negative number of MiB, got -5"),
    ],
)
def test_bad_arguments_name_the_parameter(count, min_free_mb, error, match):
    with pytest.raises(error, match=match):
        select(count, min_free_mb)


def test_processes_this_launch_starts_inherit_the_first_choice():
    fake = three_gpus()
    assert select(2, fake=fake) == [2, 0]
    fake.gpus[0].memory_used = 0  # rank 0 started: the readings a further rank would see have changed
    fake.gpus[2].memory_used = 15 * GiB
    assert select(2, fake=fake) == [2, 0]  # the same GPUs on every rank, read from the environment


def test_the_omegaconf_resolver_fills_trainer_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", three_gpus())
    monkeypatch.setattr(gpu_selection, "num_cuda_devices", lambda: 3)
    register_resolvers()
    config = OmegaConf.create({"trainer": {"devices": "${mgpu.free_gpus:2,8000}"}})
    assert OmegaConf.to_container(config, resolve=True)["trainer"]["devices"] == [2, 0]


@run_if(min_cuda_gpus=1)
def test_on_real_gpus_the_choice_has_the_most_free_memory():
    count = torch.cuda.device_count()
    (chosen,) = select_gpus(1)
    free = [torch.cuda.mem_get_info(index)[0] for index in range(count)]
    assert 0 <= chosen < count
    assert free[chosen] >= max(free) - 512 * 2**20  # this process's own context takes some on the device it reads
