"""Name the rank that hangs a distributed run, with every rank's Python stack, and end the run in seconds.

A rank stuck in its training step (a deadlock, a dataloader that never returns, a collective only some ranks
entered) leaves every other rank waiting inside a collective for the process group's timeout, 30 minutes by default,
after which the error names the collective that timed out on each rank but not the rank that caused it. Each rank
here runs a :class:`HangWatchdog` thread that publishes a heartbeat in the process group's key-value store and
watches its own main thread's progress. The first rank to see its main thread idle for ``timeout`` seconds
declares a hang in the store; every rank then publishes its main thread's stack, reads everyone's, writes a report
that names the ranks that are behind (or dead), and exits with :data:`HANG_EXIT_CODE`, so a scheduler sees the job
fail within ``timeout`` plus a few seconds and a person sees where it was stuck.

Only the store is used (set, get, check, compare_set): no collective, which could itself be what hangs, and nothing
on the training thread but a few attribute assignments in :meth:`HangWatchdog.beat`.
"""

import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_mgpu.core.validation import check_bool, check_int, check_positive

__all__ = ["HANG_EXIT_CODE", "PHASES", "HangWatchdog"]

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 124  # the exit status of every process that the watchdog ends (as coreutils' ``timeout``)
# the order of a training step's phases: among ranks at the same step, the one at an earlier phase is behind
PHASES = ("batch_start", "forward", "backward", "optimizer_step", "batch_end", "validation", "checkpoint")
_HANG_KEY = "hang"
_POLL_SECONDS = 0.1


class HangWatchdog:
    """Detect a rank whose training thread stopped making progress, report every rank's stack, and end the run.

    :meth:`start` runs one daemon thread per rank. Every ``interval`` seconds it publishes this rank's heartbeat
    (``beat/{rank}`` in ``store``: progress counter, step, phase, time, pid, host) and checks for a hang. When the
    watched thread has not called :meth:`beat` for more than ``timeout`` seconds (counted from its first call, so a
    first step that compiles for minutes is no hang, and never while :meth:`pause` is in effect), this rank declares
    a hang in the store (first writer wins). On seeing a declaration, every rank's thread publishes its main
    thread's stack (``stack/{rank}``), waits up to ``min(2 * interval, 10)`` seconds for the other ranks' stacks and
    writes ``report_dir/hang_report_rank{rank}.txt``. A rank whose last heartbeat is older than ``3 * interval`` is
    not answering (dead or frozen); among the others, those at the earliest ``(step, phase)`` (phases ordered as in
    :data:`PHASES`, an unknown phase after them) are named as stuck; where all are at the same place, all are named
    and the report says that no rank is behind. The thread then prints one line to stderr, logs it at ``ERROR`` and
    ends the process with :data:`HANG_EXIT_CODE`.

    A store that stays unreachable for more than ``timeout`` seconds (rank 0, which serves it, died) is reported the
    same way, with this rank's stack only. A main thread that holds the GIL forever (a deadlock inside a C
    extension) starves the watchdog thread too: :mod:`faulthandler` then writes every thread's stack to
    standard error (the launcher's log) and ends the process with status 1, ``2 * timeout + 30`` seconds after
    the watchdog thread last ran while the main thread was making progress, paused, or had not beaten yet.

    Args:
        store: a ``torch.distributed`` store shared by all ranks; give each run a fresh ``PrefixStore`` so that keys
            of an earlier run are not read as this one's.
        rank: this process's global rank.
        world_size: the number of ranks, each running a watchdog on the same store.
        timeout: seconds without a :meth:`beat` after which this rank declares a hang.
        report_dir: the folder of the reports (created when needed).
        interval: seconds between heartbeats; ``max(0.5, min(timeout / 5, 30))`` by default.
        exit_process: end the process after writing the report; with ``False`` (tests) the thread ends instead,
            leaving :attr:`report_path`, :attr:`report` and :attr:`stuck_ranks` set, and faulthandler only prints.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a rank outside ``[0, world_size)``, or a timeout or interval that is not a positive number.

    Example::

        store = dist.PrefixStore("lightning_mgpu/hang", compat.default_store())  # the process group's store
        watchdog = HangWatchdog(store, rank, world_size, timeout=600, report_dir=trainer.log_dir)
        watchdog.start()
        for step, batch in enumerate(loader):
            watchdog.beat(step, "forward")
            ...
            watchdog.pause()  # a checkpoint save may legitimately take long
            save_checkpoint()
            watchdog.resume()
        watchdog.stop()
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: float,
        report_dir: str | os.PathLike,
        interval: float | None = None,
        exit_process: bool = True,
    ) -> None:
        owner = type(self).__name__
        check_int(owner, "world_size", world_size, minimum=1)
        check_int(owner, "rank", rank, minimum=0, maximum=world_size - 1)
        check_positive(owner, "timeout", timeout, unit="seconds")
        check_positive(owner, "interval", interval, allow_none=True, unit="seconds", hint="use None for the default")
        check_bool(owner, "exit_process", exit_process)
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.report_dir = Path(report_dir)
        self.interval = float(interval) if interval is not None else max(0.5, min(self.timeout / 5, 30.0))
        self.exit_process = exit_process
        self.step: int | None = None
        self.phase: str | None = None
        self.report_path: Path | None = None
        self.report: str | None = None
        self.stuck_ranks: list[int] | None = None
        self._progress = 0
        self._pause_depth = 0  # pauses nest: a checkpoint save inside a paused meeting
        self._watched_thread_id: int | None = None  # tests point it at a worker thread before start()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._faulthandler_armed = False
        self._host = socket.gethostname()
        self._store_down_since: float | None = None

    def start(self) -> None:
        """Start the watchdog thread (once; later calls do nothing)."""
        if self._thread is not None:
            return
        if self._watched_thread_id is None:
            self._watched_thread_id = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name=f"HangWatchdog-rank{self.rank}", daemon=True)
        self._thread.start()

    def beat(self, step: int, phase: str) -> None:
        """Record progress of the watched thread: attribute assignments only, no lock, no store, no system call."""
        self._progress += 1
        self.step = step
        self.phase = phase

    def mark(self, phase: str) -> None:
        """Record progress into ``phase`` of the step of the last :meth:`beat`, as cheaply."""
        self._progress += 1
        self.phase = phase

    @property
    def _paused(self) -> bool:
        return self._pause_depth > 0

    def pause(self) -> None:
        """Declare no hang from this rank until the matching :meth:`resume`; heartbeats and stack requests go on."""
        self._pause_depth += 1

    def resume(self) -> None:
        """End one :meth:`pause`; once none is left, the ``timeout`` counts from here."""
        self._pause_depth = max(0, self._pause_depth - 1)
        if self._pause_depth == 0:
            self._progress += 1

    def stop(self) -> None:
        """Stop the thread and wait for it (one interval and the stack wait at most); later calls do nothing."""
        self._stop_event.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=3 * self.interval + 10)
        if self._faulthandler_armed:
            faulthandler.cancel_dump_traceback_later()
            self._faulthandler_armed = False

    def _run(self) -> None:
        seen_progress = self._progress
        last_change = time.monotonic()
        while not self._stop_event.is_set():
            now = time.monotonic()
            progress = self._progress
            progressed = progress != seen_progress
            if progressed:
                seen_progress, last_change = progress, now
            idle = now - last_change
            self._store_call(self.store.set, f"beat/{self.rank}", self._heartbeat(idle))
            hang = self._store_call(self.store.check, [_HANG_KEY])
            if self._store_down_since is not None and now - self._store_down_since > self.timeout:
                self._end(*self._store_down_report(now - self._store_down_since))
                return
            stalled = self.step is not None and not self._paused and idle > self.timeout
            # a paused rank (one writing a checkpoint) may legitimately hold the others in a barrier or a collective
            if not hang and stalled and not self._any_rank_paused():
                declaration = json.dumps({"by": self.rank, "time": time.time()})
                self._store_call(self.store.compare_set, _HANG_KEY, "", declaration)
                hang = True
            if hang:
                self._end(*self._hang_report(idle))
                return
            if progressed or self._paused or self.step is None:
                self._arm_faulthandler()
            self._stop_event.wait(self.interval)

    def _store_call(self, method: Any, *args: Any) -> Any:
        """Call a store method; ``None`` while the store is unreachable (the caller's loop times that out)."""
        try:
            result = method(*args)
        except Exception as err:  # a dead store raises DistNetworkError or DistStoreError (RuntimeErrors)
            if self._store_down_since is None:
                self._store_down_since = time.monotonic()
                log.warning(f"lightning_mgpu: rank {self.rank}: the hang watchdog cannot reach the store: {err}")
            return None
        self._store_down_since = None
        return result

    def _heartbeat(self, idle: float) -> str:
        return json.dumps(
            {
                "progress": self._progress,
                "step": self.step,
                "phase": self.phase,
                "time": time.time(),
                "pid": os.getpid(),
                "host": self._host,
                "idle": idle,
                "paused": self._paused,
            }
        )

    def _any_rank_paused(self) -> bool:
        for r in range(self.world_size):
            if r == self.rank:
                continue
            beat = self._read(f"beat/{r}")
            if beat is None:
                continue
            heartbeat = json.loads(beat)
            # a rank that exited while paused (one that stopped waiting at a meeting) holds nobody back for long
            fresh = time.time() - heartbeat.get("time", 0.0) < 3 * self.interval
            if heartbeat.get("paused") and fresh:
                return True
        return False

    def _own_stack(self) -> str:
        header = f"rank {self.rank} on {self._host}, pid {os.getpid()}, step {self.step}, phase {self.phase}:\n"
        frame = sys._current_frames().get(self._watched_thread_id or -1)
        if frame is None:
            return header + "  (the watched thread has ended)\n"
        return header + "".join(traceback.format_stack(frame))

    def _hang_report(self, idle: float) -> tuple[str, list[int]]:
        own_stack = self._own_stack()
        self._store_call(self.store.set, f"beat/{self.rank}", self._heartbeat(idle))
        self._store_call(self.store.set, f"stack/{self.rank}", own_stack)
        stack_keys = [f"stack/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + min(2 * self.interval, 10.0)
        while time.monotonic() < deadline and not all(self._store_call(self.store.check, [k]) for k in stack_keys):
            time.sleep(_POLL_SECONDS)
        beats: dict[int, dict[str, Any]] = {}
        stacks: dict[int, str] = {self.rank: own_stack}
        for r in range(self.world_size):
            beat = self._read(f"beat/{r}")
            if beat is not None:
                beats[r] = json.loads(beat)
            if r != self.rank:
                stack = self._read(f"stack/{r}")
                if stack is not None:
                    stacks[r] = stack
        declaration = self._read(_HANG_KEY)
        if self._store_down_since is not None:
            return self._store_down_report(time.monotonic() - self._store_down_since)
        declared_by = json.loads(declaration)["by"] if declaration else None
        return _format_report(beats, stacks, self.world_size, 3 * self.interval, declared_by, time.time())

    def _read(self, key: str) -> str | None:
        # get() on a missing key waits for the store's timeout: check first
        if not self._store_call(self.store.check, [key]):
            return None
        value = self._store_call(self.store.get, key)
        return value.decode(errors="replace") if value is not None else None

    def _store_down_report(self, down: float) -> tuple[str, list[int]]:
        headline = (
            f"lightning_mgpu: hang detected: the store on rank 0 has been unreachable for {down:.0f} s (rank 0 died "
            "or froze, or the network failed); stuck: unknown"
        )
        return f"{headline}\n\nthis rank's stack:\n{self._own_stack()}", []

    def _end(self, report: str, stuck: list[int]) -> None:
        path = self.report_dir / f"hang_report_rank{self.rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report)
        names = ", ".join(map(str, stuck)) or "unknown"
        message = f"lightning_mgpu: rank {self.rank}: hang detected; stuck rank(s): {names}; report: {path}"
        print(message, file=sys.stderr)
        log.error(message)
        self._leave_store_last(stuck)
        if self.exit_process:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)
        # nothing ends this process: the last armed faulthandler dump would only print later, needlessly
        faulthandler.cancel_dump_traceback_later()
        self._faulthandler_armed = False
        self.report, self.stuck_ranks, self.report_path = report, stuck, path

    def _leave_store_last(self, stuck: list[int]) -> None:
        # rank 0 serves the store: the others may still be reading stacks from it, and a client whose server
        # vanished mid-request waits for the store's timeout. Rank 0 ends once every other live rank has reported.
        if self._store_down_since is not None:
            return
        self._store_call(self.store.add, "reported", 1)
        if self.rank != 0:
            return
        expected = self.world_size - len([r for r in stuck if r != 0 and self._silent(r)])
        deadline = time.monotonic() + min(2 * self.interval, 10.0) + 5.0
        while time.monotonic() < deadline:
            reported = self._store_call(self.store.add, "reported", 0)
            if reported is None or int(reported) >= expected:
                return
            time.sleep(_POLL_SECONDS)

    def _silent(self, rank: int) -> bool:
        beat = self._read(f"beat/{rank}")
        return beat is None or time.time() - json.loads(beat)["time"] > 3 * self.interval

    def _arm_faulthandler(self) -> None:
        if self._stop_event.is_set():
            return
        # standard error, not a file: a healthy run leaves nothing behind
        faulthandler.dump_traceback_later(2 * self.timeout + 30, exit=self.exit_process, file=sys.stderr)
        self._faulthandler_armed = True


def _phase_index(phase: Any) -> int:
    return PHASES.index(phase) if phase in PHASES else len(PHASES)


def _format_report(
    beats: dict[int, dict[str, Any]],
    stacks: dict[int, str],
    world_size: int,
    stale_after: float,
    declared_by: int | None,
    now: float,
) -> tuple[str, list[int]]:
    """Return the report's text and the stuck ranks, from every rank's last heartbeat and stack."""
    ages = {r: now - beat["time"] for r, beat in beats.items()}
    silent = [r for r in range(world_size) if r not in beats or ages[r] > stale_after]
    answering = [r for r in range(world_size) if r not in silent]
    places = {
        r: (-1, -1) if beats[r]["step"] is None else (beats[r]["step"], _phase_index(beats[r]["phase"]))
        for r in answering
    }
    behind = [r for r in answering if places[r] == min(places.values())]
    same_place = len(behind) == len(answering) and len(answering) > 1
    stuck = sorted(silent + ([] if silent and same_place else behind))
    # a rank's stall grows after its last heartbeat: the idle time it published plus that heartbeat's age
    stalls = [beats[r]["idle"] + ages[r] for r in stuck if r in beats]

    def describe(r: int) -> str:
        if r not in beats:
            return f"rank {r} (no heartbeat: never started a watchdog, or the store lost it)"
        if r in silent:
            return f"rank {r} (not answering (process dead or frozen): last heartbeat {ages[r]:.0f} s ago)"
        return f"rank {r} (step {beats[r]['step']}, phase {beats[r]['phase']})"

    names = ", ".join(map(str, stuck))
    headline = f"lightning_mgpu: hang detected: rank(s) {names} made no progress"
    headline += f" for {min(stalls):.0f} s" if stalls else ""
    headline += f"; stuck: {', '.join(map(describe, stuck))}"
    if same_place and not silent:
        headline += (
            "; no rank is behind the others: a collective that every rank is stuck in, or a hang at the same place "
            "on every rank"
        )
    if declared_by is not None:
        headline += f" (declared by rank {declared_by})"
    rows = [f"{'rank':>4}  {'host':<24} {'pid':>8} {'step':>8}  {'phase':<16} {'heartbeat age (s)':>17}"]
    for r in range(world_size):
        beat = beats.get(r)
        if beat is None:
            rows.append(f"{r:>4}  {'?':<24} {'?':>8} {'?':>8}  {'?':<16} {'no heartbeat':>17}")
        else:
            rows.append(
                f"{r:>4}  {beat['host']:<24} {beat['pid']:>8} {beat['step']!s:>8}  {beat['phase']!s:<16} "
                f"{ages[r]:>17.1f}"
            )
    sections = [f"--- rank {r} ---\n" + stacks.get(r, "no answer\n") for r in range(world_size)]
    return "\n".join([headline, "", *rows, "", *sections]), stuck
