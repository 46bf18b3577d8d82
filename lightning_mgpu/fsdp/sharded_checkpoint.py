"""Turn a sharded checkpoint (torch distributed checkpoint, as :class:`FSDPStrategy` writes it) into one state dict.

Runs in one process with no process group, on host memory: the whole checkpoint (model and optimizer state) is read
once, so it needs about as much host memory as the checkpoint folder's size.
"""

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_mgpu.fsdp.sharded_state import SHARDED_CALLBACK_STATES


def load_full_checkpoint(checkpoint: str | Path) -> dict:
    """Read a sharded checkpoint folder (or a single-file checkpoint) into one dict of full tensors on the CPU."""
    path = Path(checkpoint)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is neither a checkpoint file nor a torch distributed checkpoint folder (it has no .metadata file)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged.pt"
        dcp_to_torch_save(path, merged)
        return torch.load(merged, map_location="cpu", weights_only=False)


def export_state_dict(
    checkpoint: str | Path, out: str | Path, prefix: str = "", ema: bool = False
) -> dict[str, torch.Tensor]:
    """Write the model's full state dict from ``checkpoint`` to the single file ``out`` and return it.

    Args:
        checkpoint: a sharded checkpoint folder or a Lightning checkpoint file.
        out: where to ``torch.save`` the state dict.
        prefix: keep only keys starting with this (e.g. ``"model."`` for a LightningModule's ``self.model``) and
            drop it, so the result loads into that submodule's class with ``load_state_dict``.
        ema: write the :class:`~lightning_mgpu.callbacks.EMA` average of the parameters instead of the trained ones
            (buffers, which are not averaged, as trained).

    Raises:
        FileNotFoundError: ``checkpoint`` is not a checkpoint.
        KeyError: it holds no model state, no key starts with ``prefix``, or ``ema`` and it holds no average.

    Example::

        state = export_state_dict("checkpoints/epoch=0-step=10.ckpt", "model.pt")
        net.load_state_dict(torch.load("model.pt"))
    """
    full = load_full_checkpoint(checkpoint)
    if "state_dict" not in full:
        raise KeyError(f"{checkpoint} holds no 'state_dict' (keys: {sorted(full)})")
    model = dict(full["state_dict"])
    if ema:
        model.update(averaged_weights(checkpoint, full))
    state = {key[len(prefix) :]: value for key, value in model.items() if key.startswith(prefix)}
    if not state:
        raise KeyError(
            f"no key of {checkpoint}'s state_dict starts with {prefix!r}; keys: {sorted(full['state_dict'])}"
        )
    torch.save(state, out)
    return state


def averaged_weights(checkpoint: str | Path, full: dict | None = None) -> dict[str, torch.Tensor]:
    """The :class:`~lightning_mgpu.callbacks.EMA` average of the parameters that ``checkpoint`` holds, by name.

    A sharded checkpoint keeps it in its ``callback_states`` subfolder, a one-file checkpoint in the callback's state.

    Args:
        checkpoint: a sharded checkpoint folder or a Lightning checkpoint file.
        full: ``checkpoint`` already read by :func:`load_full_checkpoint`, if it was.

    Raises:
        KeyError: it holds no average, or more than one (two EMA callbacks).
    """
    path = Path(checkpoint)
    if path.is_dir() and (path / SHARDED_CALLBACK_STATES / ".metadata").is_file():
        states = load_full_checkpoint(path / SHARDED_CALLBACK_STATES)  # only EMA writes there
    else:
        full = full if full is not None else load_full_checkpoint(path)
        # an EMA's state, or a subclass's: its counters beside the whole averaged tensors
        states = {
            key: state["weights"]
            for key, state in full.get("callbacks", {}).items()
            if isinstance(state, dict) and "updates" in state and isinstance(state.get("weights"), dict)
        }
    found = {key: weights for key, weights in states.items() if weights}
    if len(found) != 1:
        what = "no EMA average" if not found else f"{len(found)} EMA averages ({sorted(found)})"
        raise KeyError(f"{checkpoint} holds {what}; train with callbacks=[EMA(...)] to export one")
    return next(iter(found.values()))
