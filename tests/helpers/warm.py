"""Start ``python script.py args`` forked from a process that has already imported torch and Lightning.

A fresh interpreter on a 2-core machine spends 4-6 s importing torch and Lightning (and what Lightning pulls in:
torchmetrics imports ``transformers`` and ``matplotlib`` when they are installed, as the test extra installs them)
before a test's script does anything, and most multi-process tests start two or more. Here the forkserver of
``multiprocessing`` imports those third-party packages once for the session; each script then runs in a fork of it,
as its own process with its own pid, session, environment, working directory, ``sys.argv`` and ``sys.path``, and
imports the pack and the test helpers afresh, so their import-time behaviour is exercised as before. What a script
does not see: interpreter start-up itself. Its exit runs non-daemon threads to completion and the ``atexit``
handlers, as the interpreter would, then ends the process without tearing the interpreter down.

Limits, known and accepted: every warm process has the forkserver's string-hash seed (``PYTHONHASHSEED`` of the test
is not applied, and two ranks iterate a set of strings in the same order, where fresh ranks may not); interpreter
teardown (module finalisation, ``__del__`` at exit) never runs, so a crash there (gloo's abort at exit) cannot show;
environment variables read only at interpreter start (``PYTHONUNBUFFERED``, ``PYTHONWARNINGS``...) are the
forkserver's; a package the forkserver imported (torch, Lightning and what they import) cannot be replaced by a fake
on ``PYTHONPATH``. Tests about any of these start cold: Lightning's own launches still do.

This module imports only the standard library: the forkserver imports it in every child.
"""

import atexit
import contextlib
import functools
import json
import multiprocessing
import os
import random
import runpy
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence

# third-party only: lightning_mgpu and tests.* stay out, so each script imports them as a fresh interpreter would
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch")
_SESSION_ENVIRONMENT = dict(os.environ)
# imported in each fork while it unpickles its target, before multiprocessing makes it a child: the server's own
# "main process" identity, which the script gets back (a fresh `python script.py` is a main process)
_MAIN_PROCESS = multiprocessing.current_process()


@functools.cache
def base_path() -> list[str]:
    """``sys.path`` of a fresh ``python script.py`` after the script's folder, without ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    shown = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(shown)


@contextlib.contextmanager
def _session_environment() -> Iterator[None]:
    """The forkserver starts with the environment the session started with, whatever the current test set."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENVIRONMENT, OMP_NUM_THREADS="1")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@functools.cache
def ready() -> multiprocessing.context.ForkServerContext:
    """Start the forkserver once, and wait until it has imported :data:`PRELOAD` (seconds, not counted in a test's
    timeout): the first fork is served only then."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    with _session_environment():
        probe = context.Process(target=_noop)
        probe.start()
    probe.join()
    return context


def _noop() -> None:
    pass


def reseed() -> None:
    """Every fork would otherwise start from the forkserver's random state; a fresh interpreter starts at random."""
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].default_generator.seed()  # the CPU generator; CUDA's start fixed in a fresh process too


def _exit_status(exit_: SystemExit) -> int:
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code
    print(exit_.code, file=sys.stderr)
    return 1


def _finish(status: int) -> None:
    """End as an interpreter ends: wait for non-daemon threads, run ``atexit`` handlers, flush, exit."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _run_as_main(command: Sequence[str], env: dict[str, str], cwd: str | None, log: str, path: list[str]) -> None:
    """In the fork: become ``python <command>`` (a script path, or ``-m module``), writing to ``log``; ``path`` is
    :func:`base_path`."""
    os.setsid()
    # a main process again: its own children default to the platform's start method (fork), not the forkserver
    multiprocessing.process._current_process = _MAIN_PROCESS
    _MAIN_PROCESS.name = "MainProcess"  # spawn's preparation gave it the child's name
    multiprocessing.process._parent_process = None
    multiprocessing.context._default_context._actual_context = None
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    module = command[1] if command[0] == "-m" else None
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(command[0]))
    sys.path[:] = [first, *python_path, *path]
    sys.argv[:] = ["-m", *command[2:]] if module else list(command)  # run_module puts the module's file first
    sys.orig_argv = [sys.executable, *command]
    reseed()
    status = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exit_:
        status = _exit_status(exit_)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    _finish(status)


class WarmProcess:
    """A script running in a fork of the warm forkserver: the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, command: Sequence[str], env: dict[str, str], cwd: str | None, log: str) -> None:
        self.args = list(command)
        script = list(command[1:])  # command[0] is this interpreter
        self._process = ready().Process(target=_run_as_main, args=(script, env, cwd, log, base_path()))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode


def can_start_warm(command: Sequence[str]) -> bool:
    """Whether ``command`` is ``[python, script, ...]`` or ``[python, -m, module, ...]`` of this interpreter, and
    ``MGPU_TESTS_COLD`` is not set (set it to start every script in a fresh interpreter, as before)."""
    if os.environ.get("MGPU_TESTS_COLD") or len(command) < 2 or command[0] != sys.executable:
        return False
    return command[1] == "-m" or (command[1].endswith(".py") and os.path.isfile(command[1]))
