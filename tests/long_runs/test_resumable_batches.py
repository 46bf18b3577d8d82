"""ResumableBatches replays an epoch's random order and passes over its first batches without reading them."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler

from lightning_mgpu.long_runs.random_states import capture_random_states, restore_random_states
from lightning_mgpu.long_runs.resumable_batches import ResumePoint, make_resumable, unresumable_reason
from tests.helpers.runif import run_if


class Recording(Dataset):
    """Twenty samples whose reads are recorded, so a test can tell skipped batches were never read."""

    def __init__(self) -> None:
        self.read: list[int] = []

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> int:
        self.read.append(index)
        return index


def batches(loader, count=None):
    out = []
    for batch in loader:
        out.append(torch.as_tensor(batch).tolist())
        if count is not None and len(out) == count:
            break
    return out


def interrupted_then_resumed(make_loader, trained=3, epoch=0):
    """Train `trained` batches of an epoch, then resume the epoch in a 'new process' (other random state)."""
    torch.manual_seed(0)
    first = make_loader()
    wrapper = make_resumable(first)
    head = batches(first, trained)
    saved = wrapper.epoch_start
    torch.manual_seed(12345)  # the resumed process has other streams until they are restored
    second = make_loader()
    make_resumable(second).resume_at(ResumePoint(batches=trained, epoch=epoch, epoch_start=saved))
    before = capture_random_states()
    tail = batches(second)
    after_first_batch = capture_random_states()
    return head, tail, second, before, after_first_batch


def uninterrupted(make_loader):
    torch.manual_seed(0)
    return batches(make_loader())


def test_random_sampler_on_the_global_stream_resumes_in_order_without_reading_skipped_samples():
    dataset = Recording()
    make = lambda: DataLoader(dataset, batch_size=3, shuffle=True)  # noqa: E731
    expected = uninterrupted(make)
    dataset.read.clear()
    head, tail, _, before, after = interrupted_then_resumed(make)
    assert head + tail == expected
    assert dataset.read[: 3 * 3] == [i for batch in expected[:3] for i in batch]  # the first attempt's reads
    assert dataset.read[9:] == [i for batch in expected[3:] for i in batch]  # the resumed one read only the rest
    # the caller's stream moved by the loader's own draw (its workers' base seed) only, not by the replayed order
    restore_random_states(before)
    torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(torch.get_rng_state(), after["torch"])


def test_random_sampler_with_its_own_generator_resumes_in_order():
    def make():
        return DataLoader(Recording(), batch_size=4, sampler=RandomSampler(range(20), generator=generator))

    generator = torch.Generator().manual_seed(7)
    expected = batches(make())
    generator.manual_seed(7)
    first = make()
    wrapper = make_resumable(first)
    head = batches(first, 2)
    generator.manual_seed(999)
    second = make()
    make_resumable(second).resume_at(ResumePoint(2, 0, wrapper.epoch_start))
    assert head + batches(second) == expected


def test_distributed_sampler_resumes_the_saved_epoch_even_before_set_epoch():
    def make():
        return DataLoader(Recording(), batch_size=2, sampler=DistributedSampler(range(20), 2, 1, shuffle=True))

    reference = make()
    reference.sampler.set_epoch(3)
    expected = batches(reference)
    head, tail, _, _, _ = interrupted_then_resumed(lambda: _at_epoch(make(), 3), trained=2, epoch=3)
    assert head == expected[:2]
    fresh = make()  # epoch 0 until set_epoch: the resume point's epoch is set by the wrapper
    make_resumable(fresh).resume_at(ResumePoint(2, 3, None))
    assert batches(fresh) == expected[2:]
    assert head + tail == expected


def _at_epoch(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return loader


def test_loader_without_batching_and_with_workers():
    make_unbatched = lambda: DataLoader(Recording(), batch_size=None, shuffle=True)  # noqa: E731
    head, tail, _, _, _ = interrupted_then_resumed(make_unbatched, trained=5)
    assert head + tail == uninterrupted(make_unbatched)
    make_workers = lambda: DataLoader(Recording(), batch_size=3, shuffle=True, num_workers=2)  # noqa: E731
    head, tail, _, _, _ = interrupted_then_resumed(make_workers, trained=2)
    assert head + tail == uninterrupted(make_workers)


def test_next_epoch_after_a_resumed_one_is_drawn_afresh():
    loader = DataLoader(Recording(), batch_size=5, shuffle=True)
    wrapper = make_resumable(loader)
    torch.manual_seed(0)
    batches(loader)
    wrapper.resume_at(ResumePoint(1, 0, wrapper.epoch_start))
    assert len(batches(loader)) == 3  # the resumed epoch: 4 batches, one passed over
    assert len(batches(loader)) == 4  # the next epoch: all of them
    assert make_resumable(loader) is wrapper  # wrapping twice keeps one wrapper
    assert len(loader) == 4 and loader.batch_sampler.batch_size == 5  # the rest is the wrapped sampler's


def test_iterable_dataset_cannot_be_resumed_part_way():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    loader = DataLoader(Stream(), batch_size=2)
    assert "IterableDataset (Stream)" in unresumable_reason(loader)
    with pytest.raises(ValueError, match="cannot resume this loader part-way: its dataset is an IterableDataset"):
        make_resumable(loader)
    assert "not a torch DataLoader" in unresumable_reason([1, 2, 3])


def test_random_states_round_trip_every_stream():
    import random

    import numpy as np

    saved = capture_random_states()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    restore_random_states(saved)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and (got[1] == expected[1]).all() and got[2] == expected[2]


class UnevenBatches:
    """A batch sampler of one's own: batches of 1, 2, 3... indices from a permutation drawn on the global stream."""

    def __len__(self) -> int:
        return 5

    def __iter__(self):
        order = torch.randperm(15).tolist()
        start = 0
        for size in range(1, 6):
            yield order[start : start + size]
            start += size


def test_a_batch_sampler_of_ones_own_resumes_whole_batches_in_order():
    make = lambda: DataLoader(Recording(), batch_sampler=UnevenBatches())  # noqa: E731
    head, tail, _, _, _ = interrupted_then_resumed(make, trained=2)
    assert head + tail == uninterrupted(make)
    assert [len(batch) for batch in tail] == [3, 4, 5]  # batches passed over whole, whatever their size


@run_if(min_cuda_gpus=2)
def test_random_states_round_trip_every_data_parallel_replica_gpu():
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    torch.rand(1, device=devices[1])  # initialise CUDA
    saved = capture_random_states(devices[0], devices[1:])
    expected = [torch.rand(4, device=device) for device in devices]
    for device in devices:
        torch.rand(100, device=device)  # move every stream on
    restore_random_states(saved, devices[0], devices[1:])
    for device, values in zip(devices, expected, strict=True):
        assert torch.equal(torch.rand(4, device=device), values)
