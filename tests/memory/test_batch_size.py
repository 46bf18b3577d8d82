"""Process counting and the per-process share of a global batch, as the configs' resolver uses them."""

import pytest

from lightning_mgpu.core import devices
from lightning_mgpu.memory.batch_size import count_processes, per_device_batch_size


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees ``n`` CUDA GPUs (counting them never initialises CUDA, so this is what the code reads)."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(devices, "num_cuda_devices", lambda: n)

    return set_count


@pytest.mark.parametrize(
    ("devices", "accelerator", "expected"),
    [(2, "cpu", 2), ("3", "cpu", 3), ("auto", "cpu", 1), ([0, 1, 2], "cuda", 3), ("0,1", "cuda", 2), ("1,", "cuda", 1)],
)
def test_devices_are_counted_as_the_trainer_counts_them(devices, accelerator, expected):
    assert count_processes(devices, 1, accelerator) == expected
    assert count_processes(devices, 3, accelerator) == 3 * expected


def test_every_gpu_and_auto_count_the_gpus_torch_sees(gpus):
    gpus(8)
    assert count_processes(-1, 2, "cuda") == 16
    assert count_processes("auto", 1, "cuda") == 8
    assert count_processes("auto", 1, "auto") == 8  # auto picks CUDA where there are GPUs
    assert count_processes(4, 1, "gpu") == 4
    gpus(0)
    assert count_processes("auto", 1, "auto") == 1  # ... and the CPU elsewhere
    with pytest.raises(ValueError, match="devices=-1 with accelerator='cuda': torch sees no CUDA GPU"):
        count_processes(-1, 1, "cuda")


@pytest.mark.parametrize(
    ("devices", "accelerator", "message"),
    [
        (-1, "cuda", r"devices=-1 with accelerator='cuda': torch sees no CUDA GPU on this machine to count; name"),
        ("auto", "cuda", r"devices='auto' with accelerator='cuda': torch sees no CUDA GPU"),
        (-1, "auto", r"devices=-1 counts every CUDA GPU, but accelerator='auto' found none here and chose 'cpu'; name"),
        (-1, "cpu", r"devices=-1 cannot be used with accelerator='cpu': give a count >= 1 \(--trainer.devices=N\)"),
    ],
)
def test_counting_gpus_where_there_are_none_says_to_name_the_count(gpus, devices, accelerator, message):
    gpus(0)
    with pytest.raises(ValueError, match=message) as raised:
        count_processes(devices, 1, accelerator)
    assert "--trainer.devices=N" in str(raised.value)


def test_a_count_given_as_a_string_is_shown_as_a_number():
    with pytest.raises(ValueError) as raised:
        per_device_batch_size(100, "3", "1", 1, "cpu")  # what interpolation passes from --trainer.devices=3
    assert "(devices=3 x num_nodes=1)" in str(raised.value)


@pytest.mark.parametrize("devices", [-1, 0, True, "two", [], [True], 1.5])
def test_a_device_value_the_trainer_would_not_count_is_refused(devices):
    with pytest.raises(ValueError, match=r"cannot be used with accelerator='cpu': give a count >= 1"):
        count_processes(devices, 1, "cpu")


def test_num_nodes_and_accelerator_are_checked():
    with pytest.raises(ValueError, match="num_nodes must be an int >= 1, got 0"):
        count_processes(2, 0, "cpu")
    with pytest.raises(ValueError, match="num_nodes must be an int >= 1, got True"):
        count_processes(2, True, "cpu")
    with pytest.raises(ValueError, match="accelerator='tpu9' is not one of"):
        count_processes(2, 1, "tpu9")


def test_per_device_batch_size_divides_by_processes_and_accumulation():
    assert per_device_batch_size(256, 4, 2, 1, "cpu") == 32
    assert per_device_batch_size(256, 2, 1, 4, "cpu") == 32
    assert per_device_batch_size("96", "3", "1", "2", "cpu") == 16  # values arrive as strings from interpolation


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((None, 2), "global_batch_size must be a positive int, got None"),
        ((0, 2), "global_batch_size must be a positive int, got 0"),
        ((64, 2, 1, 0), "accumulate_grad_batches must be a positive int, got 0"),
        ((64, 2, 1, -2), "accumulate_grad_batches must be a positive int, got -2"),
        ((100, 3), "global_batch_size=100 does not split evenly over 3 processes .* choose a multiple of 3"),
        ((4, 4, 1, 2), "choose a multiple of 8"),  # would be 0.5 samples per process
    ],
)
def test_per_device_batch_size_refuses_what_cannot_be_split(arguments, message):
    with pytest.raises(ValueError, match=message):
        per_device_batch_size(*arguments, accelerator="cpu")
