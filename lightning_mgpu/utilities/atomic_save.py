"""Write a checkpoint so that a crash during the save never leaves a partial file under the checkpoint's name.

Lightning's ``TorchCheckpointIO`` serialises into memory and then writes the target file in place: a process killed
during that write (a preemption's SIGKILL, a node failure) leaves a truncated ``last.ckpt`` that the next attempt's
``ckpt_path="last"`` picks and fails to load. :func:`save_atomically` writes a hidden partial file beside the
target, flushes it to disk and renames it over the target, which POSIX makes atomic on one filesystem: the name
holds the old checkpoint or the new one, never a mix.
"""

import os
import uuid
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

PARTIAL_SUFFIX = ".partial"


def save_atomically(
    checkpoint_io: CheckpointIO, checkpoint: dict[str, Any], filepath: "str | os.PathLike[str]", storage_options: Any
) -> None:
    """Save ``checkpoint`` to ``filepath`` through ``checkpoint_io``, atomically where it writes a local file.

    Other checkpoint IOs (asynchronous, remote filesystems) save as they always do.
    """
    if type(checkpoint_io) is not TorchCheckpointIO or "://" in str(filepath):  # a URL: s3://, gs://...
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    target = Path(filepath)
    for stale in target.parent.glob(f".{target.name}.*{PARTIAL_SUFFIX}"):  # left by a process killed mid-save
        stale.unlink(missing_ok=True)
    # a name no ModelCheckpoint pattern matches (its suffix is not .ckpt), so "last" never resolves to it
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}")
    try:
        checkpoint_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
        with open(partial, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    _sync_directory(target.parent)


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
