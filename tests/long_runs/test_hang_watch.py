"""The hang watchdog under a real 2-process fit: a rank that sleeps forever is named, with its stack, in seconds."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_mgpu import DDPStrategy, MultiGPUStrategy
from lightning_mgpu.long_runs.hang_watchdog import HANG_EXIT_CODE
from tests.helpers.processes import LAUNCHER_VARIABLES, REPO, run_script

SCRIPT = Path(REPO) / "tests" / "helpers" / "hang_fit.py"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["mgpu", "fsdp"])
def test_a_rank_sleeping_in_its_training_step_is_named_and_every_process_exits(tmp_path, strategy):
    command = ["--out", tmp_path, "--strategy", strategy, "--hang-rank", 1, "--hang-step", 7, "--hang-timeout", 8]
    result = run_script(SCRIPT, *command, timeout=90)
    ended = time.time()
    # the pipe closes only when both processes have ended: rank 1 (launched by rank 0) holds it too
    assert not result["hung"], result["output"][-3000:]
    assert result["rc"] == HANG_EXIT_CODE, result["output"][-3000:]
    hung_at = float((tmp_path / "hanging_rank1").read_text())
    # a hang, not a speed: every process is to end about the 8 s hang timeout after rank 1 fell asleep, where without
    # the watchdog rank 0 waits in a collective for the process group's 30 minutes (the 90 s kill ends that run)
    assert ended - hung_at < 35
    for rank in (0, 1):
        report = (tmp_path / f"hang_report_rank{rank}.txt").read_text()
        headline = report.splitlines()[0]
        stuck = r"hang detected: rank\(s\) 1 made no progress for \d+ s; stuck: rank 1 \(step 7, phase forward\)"
        assert re.search(stuck, headline)
        rank1_stack = report.split("--- rank 1 ---")[1]
        assert "sleeping_forever_in_training_step" in rank1_stack
        assert "--- rank 0 ---" in report and "step 7, phase backward" not in headline  # rank 0 waits, not named
        assert (
            f"rank {rank}: hang detected; stuck rank(s): 1; report: {tmp_path / f'hang_report_rank{rank}.txt'}"
            in (result["output"])
        )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_stock_lightning_in_the_same_case_names_no_rank_and_leaves_the_run_hanging(tmp_path):
    # stock Lightning's default process-group timeout is 30 minutes: 10 s after rank 1 fell asleep, nothing has
    # happened, and nothing will for another 29 minutes
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--strategy", "ddp"]
    with open(tmp_path / "output.txt", "wb") as output:
        proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "hanging_rank1").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (tmp_path / "hanging_rank1").exists(), (tmp_path / "output.txt").read_text()[-3000:]
        time.sleep(10)
        assert proc.poll() is None, (tmp_path / "output.txt").read_text()[-3000:]  # still hanging
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not list(tmp_path.glob("hang_report_rank*.txt"))
    assert "hang detected" not in (tmp_path / "output.txt").read_text()


@pytest.mark.parametrize("value", [0, -5.0])
def test_hang_timeout_must_be_positive_or_none(value):
    with pytest.raises(ValueError, match=rf"hang_timeout must be a positive number of seconds or None, got {value}"):
        MultiGPUStrategy(hang_timeout=value)


def test_hang_timeout_defaults_on_and_none_turns_it_off():
    assert MultiGPUStrategy().hang_timeout == DDPStrategy().hang_timeout == 600
    assert MultiGPUStrategy(hang_timeout=None).hang_timeout is None
