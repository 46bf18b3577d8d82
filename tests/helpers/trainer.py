"""Trainer keyword arguments, multi-process fits in a process of their own, and a logger shared by the tests."""

import os
import pickle
import random
import traceback
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger

# no logger, checkpoints, progress bar or model summary: tests read what they assert on from the objects
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def in_process_start() -> str:
    """How a test's ``Trainer(devices=2)`` starts its workers: ``"fork"`` (:func:`fit_apart`), or ``"spawn"`` with
    ``MGPU_TESTS_COLD=1``."""
    return "spawn" if os.environ.get("MGPU_TESTS_COLD") else "fork"


def fit_apart(trainer_kwargs: dict[str, Any], model: Any, **fit_kwargs: Any) -> None:
    """``Trainer(**trainer_kwargs).fit(model, **fit_kwargs)`` for a multi-process fit, in a process of its own.

    A ``ddp_spawn`` worker is a fresh interpreter that spends 4-6 s of the two cores importing torch and Lightning
    before it trains a few steps. Here the fit runs in a process forked from :mod:`tests.helpers.warm`'s server (torch
    and Lightning imported, one thread, nothing else running), with this process's environment, random states and
    deterministic-algorithms flag, as Lightning's spawn launcher restores them in each worker; its strategy forks the
    workers from there (``start_method="fork"``: :func:`in_process_start`). Not from the pytest process itself: a
    fork inherits whatever earlier tests left there (a process group, a thread holding a lock, OpenMP's pool), and a
    forked worker can hang on it. What this leaves out is spawn's pickling of the trainer to each worker (the model
    and the Trainer's arguments are pickled once, to this process): the tests of that keep ``ddp_spawn``
    (``tests/ddp/test_ddp.py``'s first test, ``test_save_after_fit``, ``test_strategy_pickles_for_spawned_workers``).
    The weights are not loaded back into ``model``: the tests read each rank's dump. With ``MGPU_TESTS_COLD=1`` the
    fit runs here (its strategy then spawns).

    Raises:
        RuntimeError: the fit raised (its traceback is in the message) or its process died.
    """
    if in_process_start() == "spawn":
        Trainer(**trainer_kwargs).fit(model, **fit_kwargs)
        return
    from tests.helpers import warm
    from tests.helpers.processes import _kill_session

    context = warm.ready()
    receive, send = context.Pipe(duplex=False)
    states = (dict(os.environ), random.getstate(), torch.get_rng_state(), torch.are_deterministic_algorithms_enabled())
    # plain pickle: multiprocessing's would move every tensor to shared memory, which the forked workers would share
    payload = pickle.dumps((trainer_kwargs, model, fit_kwargs, states))
    process = context.Process(target=_fit_here, args=(payload, send))
    process.start()
    send.close()
    try:
        failure = receive.recv()
    except EOFError:  # closed with nothing said
        process.join()
        failure = f"its process died (exit status {process.exitcode}) before it said how the fit ended"
    finally:  # also when pytest-timeout interrupts the wait: the fit's process and its workers are killed
        _kill_session(process.pid, leader_running=process.exitcode is None)  # it may not have made its session yet
        process.join(timeout=10)
    if failure is not None:
        raise RuntimeError(f"the fit in its own process failed:\n{failure}")


def _fit_here(payload: bytes, send: Any) -> None:
    os.setsid()  # a session of its own: the test kills it with the workers it forks
    trainer_kwargs, model, fit_kwargs, (environment, python_state, torch_state, deterministic) = pickle.loads(payload)
    os.environ.clear()
    os.environ.update(environment)
    random.setstate(python_state)
    torch.set_rng_state(torch_state)
    torch.use_deterministic_algorithms(deterministic)
    try:
        Trainer(**trainer_kwargs).fit(model, **fit_kwargs)
    except BaseException:
        send.send(traceback.format_exc())
        raise
    send.send(None)


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call: a key logged twice for one step shows up twice."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def values(self, key: str) -> list[float]:
        return [metrics[key] for _, metrics in self.calls if key in metrics]
