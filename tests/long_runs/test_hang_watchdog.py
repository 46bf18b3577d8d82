"""HangWatchdog on real TCPStores: who is named stuck, no false alarm, a beat that never touches the store."""

import json
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_mgpu.long_runs.hang_watchdog import HANG_EXIT_CODE, HangWatchdog
from tests.helpers.processes import find_free_port, run_script


@pytest.fixture
def stores():
    """A master TCPStore and a function that returns a new client of it."""
    port = find_free_port()
    master = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=True, wait_for_workers=False)
    clients = []

    def client() -> dist.TCPStore:
        store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timedelta(seconds=10))
        clients.append(store)
        return store

    yield master, client


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _train(watchdog: HangWatchdog, last_step: int, last_phase: str, release: threading.Event, stuck) -> None:
    for step in range(last_step):
        for phase in ("forward", "backward"):
            watchdog.beat(step, phase)
            time.sleep(0.05)
    watchdog.beat(last_step, last_phase)
    stuck(release)


def waiting_in_a_collective(release: threading.Event) -> None:
    release.wait()


def sleeping_forever_in_training_step(release: threading.Event) -> None:
    release.wait()


def _watch(thread: threading.Thread, watchdog: HangWatchdog) -> None:
    thread.start()
    watchdog._watched_thread_id = thread.ident
    watchdog.start()


@pytest.mark.timeout(60)
def test_every_rank_names_the_rank_behind_with_its_stack(stores, tmp_path):
    master, client = stores
    release = threading.Event()
    watchdogs = [
        HangWatchdog(store, rank, 2, timeout=2, report_dir=tmp_path, exit_process=False)
        for rank, store in enumerate((master, client()))
    ]
    threads = [
        threading.Thread(target=_train, args=(watchdogs[0], 7, "backward", release, waiting_in_a_collective)),
        threading.Thread(target=_train, args=(watchdogs[1], 7, "forward", release, sleeping_forever_in_training_step)),
    ]
    try:
        for thread, watchdog in zip(threads, watchdogs, strict=True):
            _watch(thread, watchdog)
        # 7 steps of 0.1 s, then the timeout, one interval to notice, one for the other rank, the stack wait
        assert _wait_for(lambda: all(w.report_path is not None for w in watchdogs), 0.7 + 2 + 4)
    finally:
        release.set()
        for watchdog in watchdogs:
            watchdog.stop()
    for rank, watchdog in enumerate(watchdogs):
        assert watchdog.stuck_ranks == [1]
        assert watchdog.report_path == tmp_path / f"hang_report_rank{rank}.txt"
        report = watchdog.report_path.read_text()
        assert report == watchdog.report
        headline = report.splitlines()[0]
        assert headline.startswith("lightning_mgpu: hang detected: rank(s) 1 made no progress for ")
        assert "stuck: rank 1 (step 7, phase forward)" in headline
        assert "sleeping_forever_in_training_step" in report  # rank 1's stack, in both reports
        assert "waiting_in_a_collective" in report
        assert "rank 1 on " in report and "step 7, phase forward" in report


@pytest.mark.timeout(60)
def test_all_ranks_at_the_same_place_are_all_named(stores, tmp_path):
    master, client = stores
    release = threading.Event()
    watchdogs = [
        HangWatchdog(store, rank, 2, timeout=1, report_dir=tmp_path, exit_process=False)
        for rank, store in enumerate((master, client()))
    ]
    threads = [
        threading.Thread(target=_train, args=(w, 3, "backward", release, waiting_in_a_collective)) for w in watchdogs
    ]
    try:
        for thread, watchdog in zip(threads, watchdogs, strict=True):
            _watch(thread, watchdog)
        assert _wait_for(lambda: all(w.report_path is not None for w in watchdogs), 0.3 + 1 + 4)
    finally:
        release.set()
        for watchdog in watchdogs:
            watchdog.stop()
    for watchdog in watchdogs:
        assert watchdog.stuck_ranks == [0, 1]
        assert "no rank is behind the others" in watchdog.report.splitlines()[0]


@pytest.mark.timeout(60)
def test_a_rank_that_keeps_beating_writes_no_report(stores, tmp_path):
    master, _ = stores
    watchdog = HangWatchdog(master, 0, 1, timeout=1, report_dir=tmp_path, exit_process=False)
    watchdog.start()
    try:
        deadline = time.monotonic() + 3 * watchdog.timeout
        step = 0
        while time.monotonic() < deadline:
            watchdog.beat(step, "forward")
            step += 1
            time.sleep(0.05)
    finally:
        watchdog.stop()
    assert watchdog.report_path is None
    assert not (tmp_path / "hang_report_rank0.txt").exists()
    assert not watchdog._thread.is_alive()


@pytest.mark.timeout(60)
def test_a_paused_rank_writes_no_report_and_keeps_publishing_heartbeats(stores, tmp_path):
    master, _ = stores
    watchdog = HangWatchdog(master, 0, 1, timeout=1, report_dir=tmp_path, exit_process=False)
    watchdog.start()
    try:
        watchdog.beat(0, "forward")
        watchdog.pause()
        time.sleep(0.5)
        before = master.get("beat/0")
        time.sleep(3 * watchdog.timeout)
        assert watchdog.report_path is None
        assert master.get("beat/0") != before  # published again, with a later time
        watchdog.resume()  # the timeout counts from here, not from the last beat
        time.sleep(0.5 * watchdog.timeout)
        assert watchdog.report_path is None
    finally:
        watchdog.stop()
    assert not (tmp_path / "hang_report_rank0.txt").exists()


@pytest.mark.timeout(60)
def test_no_rank_declares_a_hang_while_another_is_paused(stores, tmp_path):
    # rank 0 writes a long checkpoint (paused); rank 1 waits for it in a barrier, idle past its timeout
    master, client = stores
    writing = HangWatchdog(master, 0, 2, timeout=1, report_dir=tmp_path, interval=0.2, exit_process=False)
    waiting = HangWatchdog(client(), 1, 2, timeout=1, report_dir=tmp_path, interval=0.2, exit_process=False)
    for watchdog in (writing, waiting):
        watchdog.start()
        watchdog.beat(5, "batch_start")
    writing.pause()
    try:
        time.sleep(4 * waiting.timeout)
        assert waiting.report_path is None and not master.check(["hang"])
        writing.resume()  # the save ends; the waiting rank never moved: now it is a hang
        assert _wait_for(lambda: waiting.report_path is not None, 10 * waiting.timeout)
    finally:
        for watchdog in (writing, waiting):
            watchdog.stop()


def test_pauses_nest_a_save_inside_a_paused_meeting_keeps_the_meeting_paused(stores, tmp_path):
    master, _ = stores
    watchdog = HangWatchdog(master, 0, 1, timeout=1, report_dir=tmp_path, exit_process=False)
    watchdog.pause()  # the meeting
    watchdog.pause()  # a checkpoint save inside it
    watchdog.resume()
    assert watchdog._paused
    watchdog.resume()
    assert not watchdog._paused


@pytest.mark.timeout(60)
def test_a_rank_that_exited_while_paused_holds_back_no_hang_report(stores, tmp_path):
    # rank 0's last heartbeat says paused, and then it is gone: rank 1, idle, still reports after a few intervals
    master, client = stores
    last_beat = {"progress": 1, "step": 5, "phase": "forward", "time": time.time(), "pid": 1, "host": "gone"}
    last_beat.update(idle=0.0, paused=True)
    master.set("beat/0", json.dumps(last_beat))
    waiting = HangWatchdog(client(), 1, 2, timeout=1, report_dir=tmp_path, interval=0.2, exit_process=False)
    waiting.start()
    try:
        waiting.beat(5, "batch_start")
        assert _wait_for(lambda: waiting.report_path is not None, 10 * waiting.timeout)
    finally:
        waiting.stop()


@pytest.mark.timeout(60)
def test_no_hang_is_declared_before_the_first_beat(stores, tmp_path):
    master, _ = stores
    watchdog = HangWatchdog(master, 0, 1, timeout=0.5, report_dir=tmp_path, interval=0.1, exit_process=False)
    watchdog.start()
    try:
        time.sleep(1.5)  # a first step that compiles
        assert watchdog.report_path is None
        watchdog.beat(0, "forward")
        assert _wait_for(lambda: watchdog.report_path is not None, 3)
    finally:
        watchdog.stop()
    assert watchdog.stuck_ranks == [0]


class _RecordingStore:
    """Forwards every call to a real store and records the method and the calling thread."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def record(*args, **kwargs):
            self.calls.append((name, threading.get_ident()))
            return method(*args, **kwargs)

        return record


@pytest.mark.timeout(60)
def test_beat_never_touches_the_store(stores, tmp_path):
    master, _ = stores
    store = _RecordingStore(dist.PrefixStore("run", master))
    watchdog = HangWatchdog(store, 0, 1, timeout=5, report_dir=tmp_path, interval=0.05, exit_process=False)
    watchdog.start()
    try:
        for step in range(2000):
            watchdog.beat(step, "forward")
            if step % 100 == 0:
                time.sleep(0.02)
        assert _wait_for(lambda: len(store.calls) >= 4, 5)
    finally:
        watchdog.stop()
    callers = {ident for _, ident in store.calls}
    assert threading.get_ident() not in callers
    assert callers == {watchdog._thread.ident}
    assert {"set", "check"} <= {name for name, _ in store.calls}
    assert master.check(["run/beat/0"])


@pytest.mark.timeout(60)
def test_an_unreachable_store_is_reported_after_the_timeout(tmp_path):
    port = find_free_port()
    master = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timedelta(seconds=5))
    watchdog = HangWatchdog(client, 1, 2, timeout=1, report_dir=tmp_path, interval=0.5, exit_process=False)
    watchdog.start()
    try:
        watchdog.beat(0, "forward")
        assert _wait_for(lambda: client.check(["beat/1"]), 3)
        del master  # rank 0, which served the store, is gone
        assert _wait_for(lambda: watchdog.report_path is not None, 5)
    finally:
        watchdog.stop()
    assert watchdog.stuck_ranks == []
    assert "the store on rank 0 has been unreachable" in watchdog.report
    assert "test_an_unreachable_store_is_reported_after_the_timeout" in watchdog.report  # this rank's own stack


def test_arguments_are_checked(tmp_path):
    store = dist.HashStore()
    with pytest.raises(ValueError, match="HangWatchdog: rank must be"):
        HangWatchdog(store, 2, 2, timeout=1, report_dir=tmp_path)
    with pytest.raises(ValueError, match="HangWatchdog: timeout must be a positive number of seconds, got 0"):
        HangWatchdog(store, 0, 1, timeout=0, report_dir=tmp_path)
    assert HangWatchdog(store, 0, 1, timeout=600, report_dir=tmp_path).interval == 30
    assert HangWatchdog(store, 0, 1, timeout=1, report_dir=tmp_path).interval == 0.5
    assert HangWatchdog(store, 0, 1, timeout=100, report_dir=tmp_path).interval == 20


_STUCK_SCRIPT = """
import sys
import time

import torch.distributed as dist

from lightning_mgpu.long_runs.hang_watchdog import HangWatchdog
from tests.helpers.processes import find_free_port


def sleeping_in_a_stuck_step():
    time.sleep(1000)


store = dist.TCPStore("127.0.0.1", find_free_port(), world_size=1, is_master=True, wait_for_workers=False)
watchdog = HangWatchdog(store, 0, 1, timeout=2, report_dir=sys.argv[1])
watchdog.start()
for step in range(5):
    watchdog.beat(step, "forward")
    time.sleep(0.05)
sleeping_in_a_stuck_step()
"""


@pytest.mark.timeout(60)
def test_a_hung_process_exits_with_the_hang_code_and_leaves_a_report(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(_STUCK_SCRIPT))
    result = run_script(str(script), tmp_path / "reports", timeout=20)
    assert not result["hung"], result["output"]
    assert result["rc"] == HANG_EXIT_CODE, result["output"]
    report = (tmp_path / "reports" / "hang_report_rank0.txt").read_text()
    assert "sleeping_in_a_stuck_step" in report
    assert "stuck: rank 0 (step 4, phase forward)" in report
    assert "hang detected; stuck rank(s): 0; report: " in result["output"]


def test_a_mark_moves_the_phase_and_counts_as_progress_without_a_step(stores, tmp_path):
    _, client = stores
    watchdog = HangWatchdog(client(), rank=0, world_size=1, timeout=5, report_dir=tmp_path, exit_process=False)
    watchdog.beat(7, "batch_start")
    progress = watchdog._progress
    watchdog.mark("backward")
    assert (watchdog.step, watchdog.phase, watchdog._progress) == (7, "backward", progress + 1)
