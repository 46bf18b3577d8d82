"""Callback state sharded like the model: what a callback hands :class:`FSDPStrategy` to save and load with the shards.

Lightning puts a callback's ``state_dict()`` in the checkpoint's metadata, which rank 0 alone writes: right for a
counter, wrong for a tensor each rank holds a different shard of (an exponential moving average of FSDP's parameters).
A callback that derives from :class:`ShardedCallbackState` hands such tensors to the strategy instead, as ``DTensor``
shards; the strategy writes them as a torch distributed checkpoint of their own (each rank its own shards, keyed
``<state_key>.<name>``) in the subfolder ``callback_states`` of the checkpoint folder, which Lightning's loading passes
over, and loads them back in place when a fit resumes.
"""

from abc import ABC, abstractmethod

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

# the subfolder of a sharded checkpoint that holds the callbacks' sharded states
SHARDED_CALLBACK_STATES = "callback_states"


class ShardedCallbackState(ABC):
    """The part of a callback's state that is sharded like the model's parameters.

    :class:`~lightning_mgpu.strategies.FSDPStrategy` calls :meth:`sharded_state_dict` on every rank when it saves a
    distributed checkpoint, and again when it loads one (after its ``setup`` and, in ``fit``, after ``on_fit_start``),
    where the tensors returned are filled in place. The rest of the callback's state goes through Lightning's
    ``state_dict``.
    """

    @abstractmethod
    def sharded_state_dict(self, pl_module: "pl.LightningModule") -> dict[str, torch.Tensor]:
        """Tensors to save, or to load into in place: ``DTensor`` shards laid out as the parameters are."""


def as_sharded_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part) as a ``DTensor`` laid out as ``param``, sharing ``local``'s memory; or ``local``.

    Writing into the result writes into ``local``, so a distributed checkpoint can load into it in place.
    """
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
