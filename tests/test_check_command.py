"""``python -m lightning_mgpu check`` on 2 CPU processes (gloo): it measures, verifies, and fails when a check does."""

import os
import re
import subprocess
import sys
import time

import pytest

from lightning_mgpu.commands.check import FAULT_VARIABLE
from tests.helpers.processes import LAUNCHER_VARIABLES, REPO


def check(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARIABLES, FAULT_VARIABLE)}
    env.update(PYTHONPATH=REPO, **({FAULT_VARIABLE: fault} if fault else {}))
    command = [sys.executable, "-m", "lightning_mgpu", "check", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=170, check=False)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_every_check_passes_on_two_cpu_processes(record_property):
    start = time.monotonic()
    completed = check()
    record_property("seconds", round(time.monotonic() - start, 1))
    output = completed.stdout
    assert completed.returncode == 0, output + completed.stderr[-3000:]
    assert output.startswith("lightning_mgpu check: 2 processes, gloo on cpu")
    sizes = re.findall(r"^\s+(\d+ [KM]B)\s+[\d,.]+\s+[\d.]+\s+[\d.]+$", output, flags=re.MULTILINE)
    assert sizes == ["4 KB", "16 KB", "64 KB", "256 KB", "1 MB", "4 MB", "16 MB", "64 MB", "256 MB"]
    results = dict(re.findall(r"^(\S+)\s+(PASS|FAIL|SKIP)\s", output, flags=re.MULTILINE))
    assert results == {
        "all-reduce": "PASS",
        "matmul": "PASS",
        "host-to-device": "SKIP",  # no GPU here
        "sync-batchnorm": "PASS",
        "nvml": "SKIP",
        "nan-skip": "PASS",
    }
    assert "steps skipped per rank [1, 1]" in output


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_corrupted_batchnorm_statistics_on_one_rank_fail_the_check_with_status_1():
    completed = check("--checks", "sync-batchnorm", "--gpu-tests", fault="bn_stats")
    assert completed.returncode == 1, completed.stdout + completed.stderr[-3000:]
    assert re.search(r"^sync-batchnorm\s+FAIL\s+rank 1: .*running_mean off by 5\.00e-01", completed.stdout, re.M)
    assert re.search(r"^gpu-tests\s+SKIP\s+no GPU", completed.stdout, re.M)  # the CUDA tests need a GPU


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checks", "bogus"], "--checks: unknown bogus; choose from all-reduce, matmul"),
        (["--processes", "0"], "--processes must be at least 1, got 0"),
        (["--max-mb", "0"], "--max-mb must be at least 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(args, message):
    completed = check(*args)
    assert completed.returncode == 2
    assert message in completed.stderr
