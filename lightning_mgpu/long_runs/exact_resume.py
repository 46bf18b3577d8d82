"""Exact mid-epoch resume: every rank sees the batches it would have seen, with its own random streams restored.

Stock Lightning restores its loop counters from a mid-epoch checkpoint but starts the loader's epoch over: the batches
before the checkpoint are trained twice in that epoch and as many at its end never, and no random stream is
restored. :class:`ExactResume` is the strategies' part of the fix:

- the training loader's index sampler becomes a :class:`~lightning_mgpu.long_runs.resumable_batches.ResumableBatches`,
  which records the random streams each epoch's order is drawn from;
- every checkpoint (``ModelCheckpoint``, ``OnExceptionCheckpoint`` on a SIGTERM, Lightning's SLURM requeue) gets,
  from every rank (one ``all_gather_object`` per save), those streams and the rank's streams at the save, plus how
  many batches of the epoch were trained;
- a fit resumed from it replays the epoch's draw, passes over the trained batches without reading them, and puts each
  rank's streams back at ``on_train_start``;
- a callback whose state differs between ranks (NaNSkip's loss window) declares it (:class:`KeepsRankState`), gives
  it through ``rank_state()`` at the save and gets its own rank's back through ``load_rank_state(state)`` at
  ``on_train_start``, after Lightning
  restored rank 0's ``state_dict``.
"""

import abc
import copy
import logging
import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_mgpu.long_runs.atomic_save import save_atomically
from lightning_mgpu.long_runs.random_states import capture_random_states, restore_random_states
from lightning_mgpu.long_runs.resumable_batches import (
    ResumableBatches,
    ResumePoint,
    make_resumable,
    unresumable_reason,
)

log = logging.getLogger(__name__)

RESUME_CHECKPOINT_KEY = "lightning_mgpu_exact_resume"


class KeepsRankState(abc.ABC):
    """A callback whose state differs between ranks: the pack's strategies save every rank's and give each its own back.

    Lightning's checkpoint holds one ``state_dict`` per callback, rank 0's. A declared role, read with ``isinstance``.
    """

    state_key: str

    @abc.abstractmethod
    def rank_state(self) -> dict[str, Any]:
        """This rank's part of the state, at a save (every rank)."""

    @abc.abstractmethod
    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Take this rank's part back, at the start of a resumed fit."""


class ExactResume:
    """The per-strategy state of exact resume; the strategy calls one method from each of its matching hooks.

    Args:
        owner: the strategy's class name, for messages.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.batches: ResumableBatches | None = None
        self._loaded: dict[str, Any] | None = None  # this rank's part of the checkpoint the next fit resumes from
        self._pass: tuple[int, int] | None = None  # (epoch, loaders processed) of the loader set being processed

    def process_dataloader(self, trainer: "pl.Trainer | None", loader: Any) -> Any:
        """Return a resumable copy of the training loader, on a resumed fit pointed at the interrupted epoch's position.

        The user's loader object is left as it is (it may be used for validation or prediction too).
        """
        if trainer is None or not trainer.training or trainer.state.fn != TrainerFn.FITTING:
            return loader
        point = self._resume_point()
        mid_epoch = point is not None and point.batches > 0
        if self._count_loader(trainer) > 1:  # several training loaders (a CombinedLoader): cycled unevenly
            if self.batches is not None:
                self.batches.resume_at(None)
            self.batches = None
            if mid_epoch:
                self._warn(point, "the fit has several training loaders, whose positions the pack does not track")
            return loader
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
            return loader  # a stateful loader (StatefulDataLoader): Lightning saves and restores its position
        reason = unresumable_reason(loader)
        if reason is not None:
            if mid_epoch:
                self._warn(point, f"the training loader cannot be resumed there: {reason}")
            return loader
        loader = copy.copy(loader)
        self.batches = make_resumable(loader)
        if mid_epoch:
            self.batches.resume_at(point)
            log.info(f"{self.owner}: resuming epoch {point.epoch} after its first {point.batches} batches")
        return loader

    def _count_loader(self, trainer: "pl.Trainer") -> int:
        epoch = trainer.current_epoch
        count = self._pass[1] + 1 if self._pass is not None and self._pass[0] == epoch else 1
        self._pass = (epoch, count)
        return count

    def _warn(self, point: ResumePoint, why: str) -> None:
        rank_zero_warn(
            f"{self.owner}: the checkpoint was taken {point.batches} batches into epoch {point.epoch}, but {why}. "
            "The epoch starts over from its first batch."
        )

    def _resume_point(self) -> ResumePoint | None:
        loaded = self._loaded
        if loaded is None:
            return None
        trained, total = loaded["batches"], loaded["num_training_batches"]
        batches = trained if 0 < trained < total else 0  # at the epoch's end the next one starts afresh
        return ResumePoint(batches=batches, epoch=loaded["epoch"], epoch_start=loaded["epoch_start"])

    def save(
        self,
        trainer: "pl.Trainer | None",
        device: torch.device,
        checkpoint: dict[str, Any],
        replicas: Sequence[torch.device] = (),
    ) -> None:
        """Add every rank's streams and the epoch's position to ``checkpoint``; every rank calls it (a collective).

        ``replicas``: further CUDA devices the rank draws random numbers on (DataParallel's other GPUs).
        """
        if trainer is None:
            return
        mine = {
            "random": capture_random_states(device, replicas),
            "epoch_start": self.batches.epoch_start if self.batches is not None else None,
            "callbacks": {cb.state_key: cb.rank_state() for cb in trainer.callbacks if isinstance(cb, KeepsRankState)},
        }
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        ranks: list[Any] = [mine]
        if world_size > 1:
            ranks = [None] * world_size
            dist.all_gather_object(ranks, mine)
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        checkpoint[RESUME_CHECKPOINT_KEY] = {
            "world_size": world_size,
            "epoch": trainer.current_epoch,
            "batches": progress.processed,
            "num_training_batches": trainer.num_training_batches,
            "ranks": ranks,
        }

    def load(self, checkpoint: dict[str, Any], rank: int, world_size: int) -> None:
        """Keep this rank's part of ``checkpoint`` for the fit that resumes from it."""
        self._loaded = None
        saved = checkpoint.get(RESUME_CHECKPOINT_KEY)
        if saved is None:
            return
        if saved["world_size"] != world_size:
            rank_zero_warn(
                f"{self.owner}: the checkpoint was saved by {saved['world_size']} processes and {world_size} resume "
                "it: each rank's random streams are not restored, and a DistributedSampler splits the data anew, so "
                "the interrupted epoch starts over."
            )
            return
        self._loaded = {**saved, **saved["ranks"][rank]}

    def on_train_start(
        self, device: torch.device, replicas: Sequence[torch.device] = (), trainer: "pl.Trainer | None" = None
    ) -> None:
        """Put this rank's streams, and its callbacks' per-rank states, back as they were at the save."""
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return
        restore_random_states(loaded["random"], device, replicas)
        saved = loaded.get("callbacks", {})
        for callback in trainer.callbacks if trainer is not None else ():
            if isinstance(callback, KeepsRankState) and callback.state_key in saved:
                callback.load_rank_state(saved[callback.state_key])

    def teardown(self) -> None:
        """Forget a checkpoint that no fit resumed from (a ``validate(ckpt_path=...)``)."""
        self._loaded = None
        self.batches = None
        self._pass = None


class ExactResumeHooks(Strategy):
    """The strategy hooks of exact resume, for a strategy class to list before its Lightning base.

    The strategy builds ``self._exact_resume`` in its ``__init__``, and calls :meth:`_add_resume_state` from its
    ``save_checkpoint``, :meth:`ExactResume.load` from its ``load_checkpoint`` and :meth:`ExactResume.teardown` from
    its ``teardown``.
    """

    _exact_resume: ExactResume

    @property
    def _trainer(self) -> "pl.Trainer | None":
        """The Trainer running a stage with the module in this process, or ``None``.

        ``None`` also where the strategy holds a module that no Trainer has attached: in the main process of a
        ``spawn`` or ``fork`` launch, which hands the module to the strategy and runs the stage in the workers. A
        checkpoint saved there after ``fit`` has no rank's streams or epoch position to add; it holds what stock
        Lightning saves.
        """
        module = self.lightning_module
        if module is None:
            return None
        try:
            return module.trainer
        except RuntimeError:  # LightningModule.trainer raises, rather than return None, for a module not attached
            return None

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return self._exact_resume.process_dataloader(self._trainer, super().process_dataloader(dataloader))

    @property
    def _replica_devices(self) -> list[torch.device]:
        """Devices besides ``root_device`` whose random streams this process draws on: none but in DataParallel."""
        return []

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._exact_resume.on_train_start(self.root_device, self._replica_devices, self._trainer)

    def _add_resume_state(self, checkpoint: dict[str, Any]) -> None:
        self._exact_resume.save(self._trainer, self.root_device, checkpoint, self._replica_devices)


class OneProcessCheckpoints(ExactResumeHooks):
    """Exact resume and atomic saves for a strategy of one process (one device, or DataParallel's GPUs)."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: "str | os.PathLike[str]", storage_options: Any | None = None
    ) -> None:
        self._add_resume_state(checkpoint)
        save_atomically(self.checkpoint_io, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._exact_resume.load(checkpoint, 0, 1)
        return checkpoint
