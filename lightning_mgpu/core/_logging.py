"""When the pack's callbacks log: a ``self.log`` call costs about 0.6 ms of Python on CPU, so only when it counts."""

import lightning.pytorch as pl
import torch


def has_progress_bar(trainer: "pl.Trainer") -> bool:
    """Whether the Trainer draws a progress bar (``enable_progress_bar``, or a ``ProgressBar`` of the user's)."""
    return trainer.progress_bar_callback is not None


def show_in_progress_bar(
    pl_module: "pl.LightningModule", name: str, value: float, rank_zero_only: bool = False
) -> None:
    """Put a number already on the host in Lightning's progress bar, and nowhere else.

    ``self.log(prog_bar=True, logger=False)``, without ``sync_dist``: no collective, so some ranks may call it and
    others not. The value goes in as a CPU tensor because Lightning reads every progress-bar value with ``.item()``
    after each batch until the epoch ends: on the GPU, that would be a host-device synchronisation per step. Call it
    from a hook where logging is allowed (``on_train_batch_end``), and only when the value changes or is refreshed.

    Args:
        pl_module: the module whose ``log`` is called.
        name: the field shown in the bar.
        value: the number.
        rank_zero_only: ``True`` when only rank 0 calls this (Lightning's flag for it: the key, missing on the other
            ranks, is not one for a callback to monitor).
    """
    pl_module.log(
        name,
        torch.tensor(float(value)),
        prog_bar=True,
        logger=False,
        on_step=True,
        on_epoch=False,
        sync_dist=False,
        rank_zero_only=rank_zero_only,
    )
