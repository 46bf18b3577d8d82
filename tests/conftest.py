import os

import pytest

LAUNCHER_VARIABLES = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Lightning's launchers write MASTER_PORT, LOCAL_RANK, ... into os.environ; a later test (or a subprocess it
    starts) would take them for a launch context and wait for peers that never come."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
