"""Our DDP strategy loads checkpoints with whatever signature this Lightning's ``Strategy.load_checkpoint`` has."""

import inspect
import pickle

import pytest
import torch
from lightning.pytorch.strategies import Strategy

from lightning_mgpu import DDPStrategy
from lightning_mgpu.ddp.ddp import BUCKET_TUNING_CHECKPOINT_KEY

BASE_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(Strategy.load_checkpoint).parameters


class NotAllowlisted:
    """A class ``torch.load(weights_only=True)`` refuses to unpickle."""


def test_load_checkpoint_without_weights_only_restores_the_tuned_setting(tmp_path):
    # the call Lightning 2.4 and 2.5 make; before the fix this raised TypeError there
    state = {"bucket_cap_mb": 50.0, "comm_hook": None, "reason": "tuned", "world_size": 2}
    torch.save({"state_dict": {}, BUCKET_TUNING_CHECKPOINT_KEY: state}, tmp_path / "a.ckpt")
    strategy = DDPStrategy()
    checkpoint = strategy.load_checkpoint(tmp_path / "a.ckpt")
    assert checkpoint[BUCKET_TUNING_CHECKPOINT_KEY] == state
    assert strategy._restored_tuning is not None and strategy._restored_tuning.bucket_cap_mb == 50.0


@pytest.mark.skipif(not BASE_TAKES_WEIGHTS_ONLY, reason="this Lightning's load_checkpoint has no weights_only")
def test_weights_only_is_forwarded_where_lightning_takes_it(tmp_path):
    torch.save({"state_dict": {}, "extra": NotAllowlisted()}, tmp_path / "a.ckpt")
    strategy = DDPStrategy()
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        strategy.load_checkpoint(tmp_path / "a.ckpt", weights_only=True)
    assert isinstance(strategy.load_checkpoint(tmp_path / "a.ckpt", weights_only=False)["extra"], NotAllowlisted)
