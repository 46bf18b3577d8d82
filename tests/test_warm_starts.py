"""A script started warm (forked from the suite's forkserver) sees what ``python script.py`` would show it."""

import json
import os
import signal
import sys

import pytest

from tests.helpers.processes import REPO, run_script

PROBE = """
import json, multiprocessing, os, subprocess, sys
record = {
    "start_method": multiprocessing.get_start_method(), "process": multiprocessing.current_process().name,
    "argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "path": sys.path[:2], "flag": os.environ.get("PROBE_FLAG"),
    "torch": "torch" in sys.modules, "pack": "lightning_mgpu" in sys.modules, "pid": os.getpid(),
    "leader": os.getpgid(0) == os.getpid(), "rank": os.environ.get("LOCAL_RANK"), "orig_argv": sys.orig_argv,
}
if "--seed" in sys.argv:
    import torch
    record["random"] = torch.rand(1).item()
print(json.dumps(record), flush=True)
if "--raise" in sys.argv:
    raise RuntimeError("raised in the probe")
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[-1]))
if "--grandchild" in sys.argv:  # as Lightning starts rank 1: it outlives this process by the given seconds
    pause = sys.argv[-1]
    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({pause}); print('grandchild done', flush=True)"])
if "--sleep" in sys.argv:
    import time
    time.sleep(60)
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    monkeypatch.setenv("PROBE_FLAG", "set by the test")
    return script


def record(result: dict) -> dict:
    return json.loads(next(line for line in result["output"].splitlines() if line.startswith("{")))


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_a_script_sees_its_arguments_folder_environment_and_path_as_a_fresh_interpreter_would(
    probe, tmp_path, monkeypatch, cold
):
    if cold:
        monkeypatch.setenv("MGPU_TESTS_COLD", "1")
    result = run_script(probe, "--a", 1, cwd=tmp_path, timeout=60)
    assert result["rc"] == 0, result["output"]
    seen = record(result)
    assert seen["argv"] == [str(probe), "--a", "1"]
    assert seen["orig_argv"] == [sys.executable, str(probe), "--a", "1"]
    assert seen["cwd"] == str(tmp_path)
    assert seen["name"] == "__main__"
    assert seen["path"] == [str(tmp_path), REPO]  # the script's folder, then PYTHONPATH
    assert seen["flag"] == "set by the test"  # the test's environment, not the forkserver's
    assert not seen["pack"]  # the pack is imported afresh by each script
    assert seen["leader"]  # a session of its own, so a hang is killed with everything it started
    assert seen["torch"] is not cold  # the point of a warm start
    assert (seen["start_method"], seen["process"]) == ("fork", "MainProcess")  # its own children fork, as usual


def test_exit_status_traceback_and_hang_are_reported_as_for_a_subprocess(probe):
    failed = run_script(probe, "--raise", timeout=60)
    assert failed["rc"] == 1
    assert "RuntimeError: raised in the probe" in failed["output"]
    assert failed["output"].index("{") < failed["output"].index("Traceback")
    assert run_script(probe, "--exit", 3, timeout=60)["rc"] == 3
    hung = run_script(probe, "--sleep", timeout=5)  # sleeps 60 s: killed at 5
    assert hung["hung"]
    assert hung["rc"] == -signal.SIGKILL


def test_each_warm_start_draws_its_own_random_state(probe):
    draws = [record(run_script(probe, "--seed", timeout=60))["random"] for _ in range(2)]
    assert draws[0] != draws[1]  # forks of one server would otherwise all draw the same numbers


@pytest.mark.distributed
def test_ranks_started_together_are_separate_processes(probe):
    result = run_script(probe, ranks=2, timeout=60)
    assert result["rc"] == 0, result["output"]
    seen = [json.loads(line) for line in result["output"].splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in seen) == ["0", "1"]
    assert len({s["pid"] for s in seen} | {os.getpid()}) == 3


def test_what_a_script_started_is_waited_for_and_killed_with_it_when_it_hangs(probe):
    finished = run_script(probe, "--grandchild", 2, timeout=60)
    assert (finished["rc"], finished["hung"]) == (0, False)
    assert "grandchild done" in finished["output"]  # its output is kept: the run ended only when it did
    hung = run_script(probe, "--grandchild", 60, timeout=5)  # outlives its parent past the timeout
    assert hung["hung"]
    assert "grandchild done" not in hung["output"]
