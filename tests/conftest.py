import os

import pytest

from tests.helpers.runif import needs_cuda


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
