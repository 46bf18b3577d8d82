"""Turn a sharded checkpoint (torch distributed checkpoint, as :class:`FSDPStrategy` writes it) into one state dict.

Runs in one process with no process group, on host memory: the whole checkpoint (model and optimizer state) is read
once, so it needs about as much host memory as the checkpoint folder's size.
"""

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


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


def export_state_dict(checkpoint: str | Path, out: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Write the model's full state dict from ``checkpoint`` to the single file ``out`` and return it.

    Args:
        checkpoint: a sharded checkpoint folder or a Lightning checkpoint file.
        out: where to ``torch.save`` the state dict.
        prefix: keep only keys starting with this (e.g. ``"model."`` for a LightningModule's ``self.model``) and
            drop it, so the result loads into that submodule's class with ``load_state_dict``.

    Raises:
        FileNotFoundError: ``checkpoint`` is not a checkpoint.
        KeyError: it holds no model state, or no key starts with ``prefix``.

    Example::

        state = export_state_dict("checkpoints/epoch=0-step=10.ckpt", "model.pt")
        net.load_state_dict(torch.load("model.pt"))
    """
    full = load_full_checkpoint(checkpoint)
    if "state_dict" not in full:
        raise KeyError(f"{checkpoint} holds no 'state_dict' (keys: {sorted(full)})")
    state = {key[len(prefix) :]: value for key, value in full["state_dict"].items() if key.startswith(prefix)}
    if not state:
        raise KeyError(
            f"no key of {checkpoint}'s state_dict starts with {prefix!r}; keys: {sorted(full['state_dict'])}"
        )
    torch.save(state, out)
    return state
