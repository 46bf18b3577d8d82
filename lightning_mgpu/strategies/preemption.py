"""Stop every rank at the same batch after a SIGTERM on any rank, without a collective per training step.

Stock Lightning (2.5+) runs a blocking ``torch.distributed.broadcast`` of a one-element tensor and an ``.item()``
before every training batch so that rank 0's SIGTERM reaches the other ranks; a SIGTERM on another rank issues an
unmatched broadcast from inside the signal handler. :class:`SigtermAgreement` replaces both, on one trainer
instance: the signal handler only records the signal, and at each batch boundary a signalled rank publishes a stop
batch in the process group's key-value store (first writer wins). Every rank checks the store, a host-side TCP
round trip with no collective and no device synchronisation, and stops exactly at the published batch.
"""

import contextlib
import logging
from types import FrameType
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

log = logging.getLogger(__name__)

# Lightning releases whose training loop and signal connector internals this replaces, as tested
TESTED_LIGHTNING_MINOR = ("2.6",)
_KEY = "stop_batch"
# the store is read every this many batches: a lookup costs 0.3-0.6 ms per step on 2 busy CPU processes
CHECK_INTERVAL = 4


class SigtermAgreement:
    """Replace Lightning's per-batch SIGTERM broadcast on one trainer with a store-based agreement.

    Every rank reads the store at the same batches, every ``interval``-th. A rank that receives SIGTERM publishes
    as stop batch the first of those at or after ``current batch + accumulate_grad_batches``. A rank reaching any
    boundary at or past ``publish + accumulate_grad_batches`` has synchronised gradients with the publisher after it
    published, so it sees the key at that read at the latest; all ranks then raise Lightning's ``SIGTERMException``
    at the same batch boundary, after one barrier.

    Args:
        store: a ``torch.distributed`` store shared by all ranks (a fresh prefix per fit).
        margin: batches a rank may trail the publisher: ``accumulate_grad_batches``, at least 1; re-read from the
            trainer at every batch once installed.
        interval: read the store every this many batches.
        cuda: the model trains on CUDA: reads wait for the previous read's event and the stop moves one
            interval later.

    Example::

        agreement = SigtermAgreement.for_trainer(trainer)  # None where unsupported: stock behaviour stays
        if agreement is not None:
            agreement.install(trainer)
    """

    _fits = 0  # per-process count of installed agreements: identical on all ranks, so it names a fresh prefix

    def __init__(self, store: dist.Store, margin: int = 1, interval: int = CHECK_INTERVAL, cuda: bool = False) -> None:
        self.store = store
        self.margin = margin
        self.interval = interval
        # on CUDA the host runs ahead of the device and DDP's all-reduce does not block it: before each read, wait
        # for the event recorded at the previous read (long done), which restores what blocking gives on gloo
        self.cuda = cuda
        self._event: Any = None
        self.batch = 0
        self.signalled = False
        self.published = False
        self.stop_batch: int | None = None
        self._trainer: pl.Trainer | None = None

    @classmethod
    def for_trainer(cls, trainer: "pl.Trainer") -> "SigtermAgreement | None":
        """Build an agreement for ``trainer``'s fit, or ``None`` (with one debug line) where it cannot apply."""
        reason = _unsupported_reason(trainer)
        if reason is not None:
            log.debug(f"lightning_mgpu: keeping Lightning's per-step SIGTERM broadcast: {reason}")
            return None
        cls._fits += 1
        store = dist.PrefixStore(f"lightning_mgpu/sigterm/{cls._fits}/", dist.distributed_c10d._get_default_store())
        return cls(store, cuda=trainer.strategy.root_device.type == "cuda")

    def install(self, trainer: "pl.Trainer") -> None:
        """Take over the per-batch check and the SIGTERM notifier of this trainer instance only."""
        self._trainer = trainer
        # instance attributes shadow the class's methods for this trainer only; the signal connector builds its
        # handler from `_sigterm_notifier_fn` when the fit registers handlers, after strategy.setup
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self.at_batch_boundary
        trainer._signal_connector._sigterm_notifier_fn = self.on_sigterm

    def uninstall(self) -> None:
        """Give the trainer its stock behaviour back."""
        trainer = self._trainer
        if trainer is not None:
            trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
            trainer._signal_connector.__dict__.pop("_sigterm_notifier_fn", None)
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

    def at_batch_boundary(self) -> None:
        """Called by the training loop before every batch; raises ``SIGTERMException`` at the agreed batch."""
        self.batch += 1
        if self._trainer is not None:  # accumulation may change between epochs (GradientAccumulationScheduler)
            self.margin = max(1, self._trainer.accumulate_grad_batches)
        if self.signalled and not self.published:
            self._publish()
        if self.stop_batch is None and self.batch % self.interval == 0 and self._read():
            self.stop_batch = int(self.store.get(_KEY))
        if self.stop_batch is not None and self.batch >= self.stop_batch:
            self._stop()

    def _publish(self) -> None:
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
        """A signal too close to the end to reach a stop batch: all ranks meet once and leave together."""
        if self.signalled and not self.published:
            self.store.compare_set(_KEY, "", str(self.batch))
        if dist.is_initialized():
            dist.barrier()  # every rank has published what it had before anyone reads
        if self.store.check([_KEY]):
            self._stop()

    def _stop(self) -> None:
        trainer = self._trainer
        if trainer is not None:
            trainer._signal_connector.received_sigterm = True
            log.info(rank_prefixed_message(f"Stopping at batch {self.batch} after a SIGTERM", trainer.local_rank))
        with contextlib.suppress(Exception):
            dist.barrier()  # every rank is at this same boundary: leave together
        raise SIGTERMException()


def _unsupported_reason(trainer: "pl.Trainer") -> str | None:
    minor = ".".join(lightning.__version__.split(".")[:2])
    if minor not in TESTED_LIGHTNING_MINOR:
        return f"Lightning {lightning.__version__} is not among the tested {TESTED_LIGHTNING_MINOR}"
    if not (dist.is_available() and dist.is_initialized()) or trainer.world_size <= 1:
        return "no process group of more than one process"
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return "this Lightning's training loop has no per-step SIGTERM broadcast"
    if not hasattr(getattr(trainer, "_signal_connector", None), "_sigterm_notifier_fn"):
        return "this Lightning's signal connector differs"
    if not hasattr(dist.distributed_c10d, "_get_default_store"):
        return "this torch has no default store"
    return None
