import os

import pytest


@pytest.fixture(autouse=True)
def _restore_environment():
    """Lightning's launchers write MASTER_PORT, LOCAL_RANK, ... into os.environ; a later test (or a subprocess it
    starts) would take them for a launch context and wait for peers that never come."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
