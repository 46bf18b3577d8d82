import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.runif import needs_cuda


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread in each pytest process, as in every process its tests start: two test files run at a time
    on two cores (``-n auto``), each starting processes of its own. ``OMP_NUM_THREADS`` too, which the processes the
    tests start inherit: where it is unset, Lightning's strategies set as many threads as the cores allow."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's: without it installed, this is never called
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: 2 workers up to 4 cores, then one per 2 cores, at most 8; one where a CUDA GPU is present.

    Most tests start 2 processes, and a third of the suite's time is spent waiting (for a hang to be named, a timeout,
    an injected sleep): on 2 cores, two files at a time keep both busy (the main suite: 20:56 -> 14:47, 92% of both
    cores busy instead of 30-85%). GPU tests measure and share the devices' memory, so with a GPU the files run one at
    a time, as before.
    """
    if torch.cuda.is_available():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 2 if cores <= 4 else min(cores // 2, 8)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark what the fast subset (``python -m pytest -m "not slow"``) leaves out: every multi-process test is slow.

    A module named ``*_distributed.py`` holds multi-process tests, so its tests are ``distributed`` whether or not
    they say so; every ``distributed`` test is also ``slow``. Other slow tests (the README's commands, the examples)
    carry the ``slow`` marker themselves.
    """
    for item in items:
        if needs_cuda(item) and item.get_closest_marker("cuda") is None:
            item.add_marker(pytest.mark.cuda)  # run_if(min_cuda_gpus=...) is the only GPU marking a test needs
        if item.path.name.endswith("_distributed.py") and item.get_closest_marker("distributed") is None:
            item.add_marker(pytest.mark.distributed)
        if item.get_closest_marker("distributed") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Lightning's launchers write MASTER_PORT, LOCAL_RANK, ... into os.environ; a later test (or a subprocess it
    starts) would take them for a launch context and wait for peers that never come."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A one-process FSDP or DDP fit in the pytest process leaves its default process group behind (Lightning does not
    destroy it at teardown); the next test starts without one, whatever file its worker ran before."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
