"""Stop every rank at the same batch after a SIGTERM on any rank, without a collective per training step.

Stock Lightning (2.5+) runs a blocking ``torch.distributed.broadcast`` of a one-element tensor and an ``.item()``
before every training batch so that rank 0's SIGTERM reaches the other ranks; a SIGTERM on another rank issues an
unmatched broadcast from inside the signal handler. :class:`SigtermAgreement` replaces both, on one trainer
instance: the signal handler only records the signal, and at each batch boundary a signalled rank publishes a stop
batch in the process group's key-value store (first writer wins). Every rank checks the store, a host-side TCP
round trip with no collective and no device synchronisation, and stops exactly at the published batch.

SLURM's requeue signal (SIGUSR1 before the time limit, for ``SLURMEnvironment(auto_requeue=True)``) goes the same
way. Lightning saves its ``hpc_ckpt_<n>.ckpt`` and requeues the job from inside the signal handler, wherever each
rank's step happens to be, so the save's collectives can meet a gradient all-reduce in flight and the checkpoint holds
a half-done step. Here the handler only records the signal; every rank saves that checkpoint at the agreed batch,
rank 0 runs ``scontrol requeue``, and every rank stops.

A fit's end is a meeting point in the same store, not a collective: a rank that finished its batches while another
still trains (different numbers of batches per rank) gets :class:`EndOfFitTimeoutError` within seconds instead of
waiting in a barrier for the process group's timeout.
"""

import atexit
import contextlib
import functools
import gc
import logging
import signal
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from typing_extensions import override

from lightning_mgpu.core import compat
from lightning_mgpu.long_runs.slurm import requeue_slurm_job

log = logging.getLogger(__name__)

_KEY = "stop_batch"
# set by a rank before it publishes a stop batch, saying why: read once every rank has arrived at the stop
_SIGTERM_KEY, _REQUEUE_KEY = "reason/sigterm", "reason/requeue"
# what the ranks do at the meeting, decided once by compare_set: save and requeue, nothing, or abandoned by a rank that
# stopped waiting for the others
_DECISION_KEY, _SAVE, _NO_SAVE, _ABANDON = "decision", "save", "none", "abandon"
# the store is read every this many batches: a lookup costs 0.3-0.6 ms per step on 2 busy CPU processes
CHECK_INTERVAL = 4
# seconds a rank that reached the end of its fit waits for a rank that has not even started its final training batch
# (such a rank is stuck in a gradient all-reduce for a batch the others do not have); a rank that has started it
# (one finishing a last validation or slow end-of-epoch hooks) is waited for up to the process group's timeout
END_OF_FIT_TIMEOUT = 30.0
_POLL_SECONDS = 0.05
# the exit status of a process stopped by the agreement: 128 + SIGTERM, as a shell reports a process killed by it
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class EndOfFitTimeoutError(RuntimeError):
    """A rank did not reach the end of the fit while the others had: the ranks ran different numbers of batches."""


class SigtermAgreement:
    """Replace Lightning's per-batch SIGTERM broadcast on one trainer with a store-based agreement.

    Every rank reads the store at the same batches, every ``interval``-th. A rank that receives SIGTERM publishes
    as stop batch the first of those at or after ``current batch + accumulate_grad_batches``. A rank reaching any
    boundary at or past ``publish + accumulate_grad_batches`` has synchronised gradients with the publisher after it
    published, so it sees the key at that read at the latest; all ranks then raise Lightning's ``SIGTERMException``
    at the same batch boundary. A SIGTERM during the batch that started as batch ``b`` therefore stops every rank
    after ``M`` to ``M + I - 1`` further batches (``M = accumulate_grad_batches``, ``I = interval``), ``M + I`` to
    ``M + 2I - 1`` on CUDA, or at the end of the fit if that comes first. Under accumulation the ranks go on to the
    end of the optimizer step in progress (up to ``M - 1`` batches more, alike on every rank), so a checkpoint
    taken at the stop holds no half-accumulated gradient.

    Every rank leaves the fit through one meeting in the store (:meth:`at_train_end`, or the agreed stop batch),
    never a collective: each rank records its batch count and waits for the others. A rank that has not arrived and
    has not started what may be its final training batch (published by :meth:`at_train_batch_start`) after
    :data:`END_OF_FIT_TIMEOUT` seconds is stuck in a batch the others do not have, and the ranks that arrived raise
    :class:`EndOfFitTimeoutError` naming it. Rank 0 serves the store, so it leaves last.

    SLURM's requeue signal (:meth:`on_requeue_signal`) publishes a stop batch in the same way. There the ranks save
    Lightning's SLURM checkpoint together (``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, which a requeued
    ``fit(ckpt_path=None)`` loads; a collective save, decided once in the store), rank 0 requeues the job, and all
    raise ``SIGTERMException``. A requeue signal too close to the fit's end for a stop batch neither saves nor
    requeues: the fit has finished.

    Args:
        store: a ``torch.distributed`` store shared by all ranks (a fresh prefix per fit).
        margin: batches a rank may trail the publisher: ``accumulate_grad_batches``, at least 1; re-read from the
            trainer when a stop is published, once installed.
        interval: read the store every this many batches.
        cuda: the model trains on CUDA: reads wait for the previous read's event and the stop moves one
            interval later.
        rank: this process's global rank.
        world_size: the number of processes that meet at the end of the fit.
        timeout: the longest wait for a rank that is still finishing its final batch: the process group's timeout.
        paused: a context manager factory for the save, the requeue and rank 0's last wait (the hang watchdog's
            pause).

    Example::

        agreement = SigtermAgreement.for_trainer(trainer)  # None where unsupported: stock behaviour stays
        if agreement is not None:
            agreement.install(trainer)
    """

    _fits = 0  # per-process count of installed agreements: identical on all ranks, so it names a fresh prefix

    def __init__(
        self,
        store: dist.Store,
        margin: int = 1,
        interval: int = CHECK_INTERVAL,
        cuda: bool = False,
        rank: int = 0,
        world_size: int = 1,
        timeout: timedelta = timedelta(minutes=30),
        paused: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.store = store
        self._paused = paused
        self.margin = margin
        self.interval = interval
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        # on CUDA the host runs ahead of the device and DDP's all-reduce does not block it: before each read, wait
        # for the event recorded at the previous read (long done), which restores what blocking gives on gloo
        self.cuda = cuda
        self._event: Any = None
        self.batch = 0
        self.signalled = False  # SIGTERM
        self.requeue_requested = False  # SLURM's requeue signal
        self.published = False
        self._published_reasons: set[str] = set()
        self.stop_batch: int | None = None
        self._trainer: pl.Trainer | None = None

    @classmethod
    def for_trainer(
        cls, trainer: "pl.Trainer", paused: Callable[[], AbstractContextManager[Any]] = nullcontext
    ) -> "SigtermAgreement | None":
        """Build an agreement for ``trainer``'s fit, or ``None`` (with one debug line) where it cannot apply.

        ``paused``: a context in which this rank's hang watchdog declares no hang (the meeting, the save, the requeue).
        """
        reason = _unsupported_reason(trainer)
        if reason is not None:
            log.debug(f"lightning_mgpu: keeping Lightning's per-step SIGTERM broadcast: {reason}")
            return None
        cls._fits += 1
        default_store = compat.default_store()
        return cls(
            dist.PrefixStore(f"lightning_mgpu/sigterm/{cls._fits}/", default_store),
            cuda=trainer.strategy.root_device.type == "cuda",
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            timeout=getattr(default_store, "timeout", timedelta(minutes=30)),  # the process group's
            paused=paused,
        )

    def install(self, trainer: "pl.Trainer") -> None:
        """Take over the per-batch check and the signal handlers of this trainer instance only."""
        self._trainer = trainer
        # whatever ends the loop (the data, max_steps, a Timer, EarlyStopping, should_stop): this rank's last batch
        # is behind it, so the meeting waits for it while callbacks' on_train_end hooks run
        compat.replace_sigterm_handling(
            trainer, self.at_batch_boundary, self.on_sigterm, self.on_requeue_signal, self.publish_possibly_last_batch
        )

    def uninstall(self) -> None:
        """Give the trainer its stock behaviour back."""
        trainer = self._trainer
        if trainer is not None:
            compat.restore_sigterm_handling(trainer)
        self._trainer = None

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler: record the signal and pass it on to launched processes; no collective here."""
        trainer = self._trainer
        if trainer is not None:
            log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
            launcher = trainer.strategy.launcher
            if not self.signalled and launcher is not None:
                launcher.kill(signum)  # as stock: the processes this one launched get the signal too
        self.signalled = True

    def on_requeue_signal(self, signum: int, frame: FrameType | None) -> None:
        """Signal handler for SLURM's requeue signal: record it; the save and the requeue wait for the agreed batch."""
        trainer = self._trainer
        if trainer is not None:
            log.info(rank_prefixed_message(f"Received SLURM's requeue signal: {signum}", trainer.local_rank))
        self.requeue_requested = True

    def at_batch_boundary(self) -> None:
        """Called by the training loop before every batch; raises ``SIGTERMException`` at the agreed batch."""
        self.batch += 1
        if (self.signalled or self.requeue_requested) and self._unpublished_reasons():
            self._publish()
        stop = self.stop_batch
        if stop is None:  # the common case: one modulo a batch, a store read every interval
            if self.batch % self.interval or not self._read():
                return
            stop = self.stop_batch = int(self.store.get(_KEY))
        if self.batch >= stop and self._optimizer_step_ended():
            self._leave(at_train_end=False)

    def _optimizer_step_ended(self) -> bool:
        """Whether the batch before this boundary ended an optimizer step (no gradients are half accumulated).

        A checkpoint taken inside an accumulation window would lack the gradients accumulated so far, and the resumed
        run would finish the window with part of its gradient. Every rank has the same batch counts (the agreement
        already assumes it), so all extend the agreed stop batch to the same window end.
        """
        trainer = self._trainer
        if trainer is None:
            return True
        return trainer.fit_loop.epoch_loop.batch_progress.current.ready % max(1, trainer.accumulate_grad_batches) == 0

    def at_train_batch_start(self) -> None:
        """Called by the strategy once a batch has started: publish its number when it may be this rank's last.

        One store write per epoch (a few more in the last optimizer step under ``max_steps``); the meeting at the
        end tells a rank finishing its last batch from one stuck in a batch the others do not have by it.
        """
        # installed agreements have several processes (for_trainer makes none for one), so a meeting at the end
        if self._trainer is not None and _may_end_the_fit(self._trainer):
            self.publish_possibly_last_batch()

    def publish_possibly_last_batch(self) -> None:
        """Record in the store that the batch this rank has just started may be its last of the fit."""
        self.store.set(f"final/{self.rank}", str(self.batch))

    def _unpublished_reasons(self) -> list[str]:
        wanted = [key for key, flag in ((_SIGTERM_KEY, self.signalled), (_REQUEUE_KEY, self.requeue_requested)) if flag]
        return [key for key in wanted if key not in self._published_reasons]

    def _publish_reasons(self) -> None:
        # a second signal after the stop batch was published (SIGTERM after SLURM's requeue signal) adds its reason
        for key in self._unpublished_reasons():
            self.store.set(key, "1")
            self._published_reasons.add(key)

    def _publish(self) -> None:
        self._publish_reasons()
        if self.published:
            return
        if self._trainer is not None:  # accumulation may change between epochs (GradientAccumulationScheduler)
            self.margin = max(1, self._trainer.accumulate_grad_batches)
        earliest = self.batch + self.margin + (self.interval if self.cuda else 0)
        target = -(-earliest // self.interval) * self.interval  # the first read at or after `earliest`
        # compare_set with expected "" inserts only if the key is absent: the first signalled rank wins
        self.stop_batch = int(self.store.compare_set(_KEY, "", str(target)))
        self.published = True

    def _read(self) -> bool:
        if self.cuda:
            if self._event is not None:
                self._event.synchronize()
            self._event = torch.cuda.Event()
            self._event.record()
        return self.store.check([_KEY])

    def at_train_end(self) -> None:
        """Meet every rank at the end of the fit; a signal too close to the end for a stop batch stops them all here.

        Raises:
            SIGTERMException: a rank was signalled.
            EndOfFitTimeoutError: a rank did not arrive and had not started its final batch (see the class).
        """
        self._leave(at_train_end=True)

    def _leave(self, at_train_end: bool) -> None:
        self._publish_late_signal()
        self.store.set(f"end/{self.rank}", str(self.batch))
        if at_train_end:
            self.store.add("ended", 1)
        self.store.add("arrived", 1)
        self._wait_for_arrivals(at_train_end)
        # every rank published what it had before it arrived, so all read the same here; the save is collective, so
        # it is decided once, in the store: a rank that stopped waiting (a signal, see _wait_for_arrivals) may have
        # decided "abandon" first
        sigterm, requeue = self.store.check([_SIGTERM_KEY]), self.store.check([_REQUEUE_KEY])
        # a rank that ended its fit has no stop batch to save at (the fit is over, or ranks ran uneven batch counts)
        proposal = _SAVE if requeue and int(self.store.add("ended", 0)) == 0 else _NO_SAVE
        decision = self.store.compare_set(_DECISION_KEY, "", proposal).decode()
        # the hang watchdog declares nothing from here: the save and the requeue may take longer than hang_timeout, and
        # the meeting is over (while ranks wait for each other above, a rank stuck elsewhere is still reported)
        with self._paused():
            if decision == _SAVE:
                self._save_and_requeue()
            self.store.add("left", 1)
            if self.rank == 0:
                # rank 0 serves the store: the others' last request must be answered before its process may exit
                self._wait_for("left", time.monotonic() + END_OF_FIT_TIMEOUT)
        if decision == _SAVE:
            self._raise_sigterm("for SLURM's requeue")
        # a requeue signal alone does not stop a rank whose fit has ended: the run is complete
        if sigterm or (requeue and not at_train_end) or decision == _ABANDON:
            self._raise_sigterm()
        if requeue:
            log.info(f"lightning_mgpu: the fit ended before an agreed requeue batch; rank {self.rank} did not requeue")

    def _save_and_requeue(self) -> None:
        """Every rank, at the agreed batch: save Lightning's SLURM checkpoint (a collective save); rank 0 requeues."""
        trainer = self._trainer
        if trainer is None:
            return
        path = compat.slurm_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            log.info(f"lightning_mgpu: saved {path} at batch {self.batch} for SLURM's requeue")
            requeue_slurm_job()

    def _raise_sigterm(self, reason: str = "after a SIGTERM") -> None:
        trainer = self._trainer
        if trainer is not None:
            compat.mark_sigterm_received(trainer)
            log.info(rank_prefixed_message(f"Stopping at batch {self.batch} {reason}", trainer.local_rank))
        # Lightning's SIGTERMException is a SystemExit: without a code the process would exit 0, and a launcher take
        # the stopped run for a finished one
        raise SIGTERMException(SIGTERM_EXIT_CODE)

    def _publish_late_signal(self) -> None:
        self._publish_reasons()
        if (self.signalled or self.requeue_requested) and not self.published:
            self.store.compare_set(_KEY, "", str(self.batch))
            self.published = True

    def _wait_for_arrivals(self, at_train_end: bool) -> None:
        start = time.monotonic()
        # at a stop batch every rank has finished the batch before it with this one: a missing rank is finishing
        # hooks or a validation; at the end of the data it may instead be stuck in a batch this rank does not have
        short_deadline = start + END_OF_FIT_TIMEOUT if at_train_end else None
        long_deadline = start + self.timeout.total_seconds()
        signal_deadline: float | None = None
        # a signal after this rank arrived is not published: every rank decides on the key after all have arrived,
        # so all decide alike; a signalled rank waits END_OF_FIT_TIMEOUT more at most, then stops alone
        while int(self.store.add("arrived", 0)) < self.world_size:
            now = time.monotonic()
            if self.signalled and signal_deadline is None:
                signal_deadline = now + END_OF_FIT_TIMEOUT
            if signal_deadline is not None and now > signal_deadline:
                # stop alone unless every rank has arrived and one has decided already: then that decision holds
                if self.store.compare_set(_DECISION_KEY, "", _ABANDON).decode() == _ABANDON:
                    self._raise_sigterm()
                signal_deadline = float("inf")
            if short_deadline is not None and now > short_deadline:
                missing = self._missing_ranks()
                stuck = {r: f for r, f in missing.items() if f != self.batch}
                if stuck:
                    raise EndOfFitTimeoutError(self._uneven_message(missing, now - start))
                short_deadline = None  # every missing rank is finishing its final batch: wait for it
            if now > long_deadline:
                names = ", ".join(map(str, self._missing_ranks()))
                raise EndOfFitTimeoutError(
                    f"lightning_mgpu: rank(s) {names} left their training loop but did not reach the end of the fit "
                    f"within the process group's timeout ({self.timeout}) of rank {self.rank}: a rank that crashed in "
                    "its on_train_end hooks, or hooks slower than the timeout (raise it with "
                    "MultiGPUStrategy(timeout=...))"
                )
            time.sleep(_POLL_SECONDS)

    def _wait_for(self, counter: str, deadline: float) -> None:
        while int(self.store.add(counter, 0)) < self.world_size and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)

    def _missing_ranks(self) -> dict[int, int | None]:
        """Ranks that have not arrived, each with the number of its last possibly-final batch (None: none yet)."""
        missing: dict[int, int | None] = {}
        for rank in range(self.world_size):
            if not self.store.check([f"end/{rank}"]):
                final = f"final/{rank}"
                missing[rank] = int(self.store.get(final)) if self.store.check([final]) else None
        return missing

    def _uneven_message(self, missing: dict[int, int | None], waited: float) -> str:
        arrived = {rank: int(self.store.get(f"end/{rank}")) for rank in range(self.world_size) if rank not in missing}
        names = ", ".join(map(str, missing))
        counts = "; ".join(f"rank {rank} ended after {count} training batches" for rank, count in arrived.items())
        known = [
            f"rank {rank} started batch {final} as possibly its last"
            for rank, final in missing.items()
            if final is not None
        ]
        return (
            f"lightning_mgpu: rank(s) {names} did not reach the end of the fit within {waited:.0f} s of rank "
            f"{self.rank}: {counts}"
            + (f"; {'; '.join(known)}" if known else f"; rank(s) {names} had not started a final batch")
            + ". The ranks ran different numbers of training batches, so the rank with more is waiting in a gradient "
            "all-reduce that the others will never join. This happens with an IterableDataset that yields a "
            "different number of batches on each rank, or a sampler that does not split the data evenly. Use a "
            "DistributedSampler (Lightning adds one for map-style datasets), or make every rank's loader yield the "
            "same number of batches (drop the extra ones). This wait is "
            "lightning_mgpu.long_runs.preemption.END_OF_FIT_TIMEOUT seconds."
        )


def _may_end_the_fit(trainer: "pl.Trainer") -> bool:
    """Whether the batch that has just started may be the fit's last: its epoch's last, or the step ``max_steps``.

    Reads the training epoch loop's ``batch_progress`` (probed in
    :func:`~lightning_mgpu.core.compat.sigterm_internals_missing`). A fit stopped
    mid-epoch otherwise (``trainer.should_stop`` from a Timer or EarlyStopping) publishes when it leaves the training
    loop, so a rank slow in its ``on_train_end`` hooks is waited for; only one slow in a validation run inside such
    a last batch is not, and meets the others under the short :data:`END_OF_FIT_TIMEOUT`.
    """
    # the loops' own figures, which the Trainer's num_training_batches, max_steps and global_step return: no property
    # calls in a check made every batch
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.batch_progress
    if progress.is_last_batch or progress.current.ready >= trainer.fit_loop.max_batches:
        return True
    return 0 <= epoch_loop.max_steps <= epoch_loop.global_step + 1


def _unsupported_reason(trainer: "pl.Trainer") -> str | None:
    if not (dist.is_available() and dist.is_initialized()) or trainer.world_size <= 1:
        return "no process group of more than one process"
    return compat.sigterm_internals_missing(trainer)


# the device meshes of this process's sharded fits, whose process groups are let go of at exit: held weakly, and
# by identity (a WeakSet would drop a new mesh equal to an earlier one, as a second fit's is)
_MESHES: list[weakref.ref] = []


@functools.cache
def _destroy_process_group_at_exit() -> None:
    """Destroy the process groups when the interpreter exits, before its objects are torn down (once).

    Left to the interpreter's teardown, a group's C++ threads could outlive their owner: the process then aborted
    after a finished fit ("terminate called without an active exception", exit status -6), seen on 2 CPU processes
    under torch 2.13. Under FSDP, ``destroy_process_group`` alone does not end them: the device mesh still holds its
    groups, and DTensor's caches hold the mesh (measured: 4 gloo run loops, 2 gloo TCP loops and the store's thread
    alive after it, none once the meshes let go, the case of an abort in CI). So the meshes of
    :func:`release_mesh_at_exit` let go of their groups here too.
    """

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        meshes = [mesh for mesh in (ref() for ref in _MESHES) if mesh is not None]
        for mesh in meshes:
            compat.release_mesh_process_groups(mesh)
        if meshes:
            gc.collect()  # one group was still held from a reference cycle (measured: its threads ended only here)

    atexit.register(destroy)


def release_mesh_at_exit(mesh: Any) -> None:
    """Have ``mesh`` let go of its process groups at interpreter exit, after they are destroyed."""
    _destroy_process_group_at_exit()
    _MESHES[:] = [ref for ref in _MESHES if ref() is not None]
    if not any(ref() is mesh for ref in _MESHES):
        _MESHES.append(weakref.ref(mesh))


class SigtermAgreementHooks(Strategy):
    """The strategy hooks of :class:`SigtermAgreement`, for a strategy class to list before its Lightning base.

    The strategy sets ``self._sigterm_agreement = None`` in its ``__init__`` and calls :meth:`_install_agreement`
    at the end of its ``setup``; list it after :class:`~lightning_mgpu.long_runs.hang_watch.HangWatchHooks`, whose
    ``on_train_end`` stops the watchdog before the meeting (which has timeouts of its own).
    """

    _sigterm_agreement: SigtermAgreement | None

    def _install_agreement(
        self, trainer: "pl.Trainer", paused: Callable[[], AbstractContextManager[Any]] = nullcontext
    ) -> None:
        _destroy_process_group_at_exit()
        if trainer.state.fn == TrainerFn.FITTING:
            self._sigterm_agreement = SigtermAgreement.for_trainer(trainer, paused=paused)
            if self._sigterm_agreement is not None:
                self._sigterm_agreement.install(trainer)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._sigterm_agreement is not None:
            self._sigterm_agreement.at_train_batch_start()

    @override
    def on_train_end(self) -> None:
        if self._sigterm_agreement is not None:
            self._sigterm_agreement.at_train_end()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self._sigterm_agreement is not None:
            self._sigterm_agreement.uninstall()
            self._sigterm_agreement = None
        super().teardown()
