"""Write a checkpoint so that a crash during the save never leaves a partial file under the checkpoint's name.

Lightning's ``TorchCheckpointIO`` serialises into memory and then writes the target file in place: a process killed
during that write (a preemption's SIGKILL, a node failure) leaves a truncated ``last.ckpt`` that the next attempt's
``ckpt_path="last"`` picks and fails to load. :func:`save_atomically` writes a hidden partial file beside the
target, flushes it to disk and renames it over the target, which POSIX makes atomic on one filesystem: the name
holds the old checkpoint or the new one, never a mix.
"""

import os
import shutil
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
    for stale in (*_partials(target), *target.parent.glob(f".{target.name}.*{PARTIAL_SUFFIX}")):  # killed mid-save
        stale.unlink(missing_ok=True)
    partial = target.with_name(f"{_partial_stem(target)}.{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}")
    try:
        checkpoint_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
        with open(partial, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    _sync_directory(target.parent)


def staging_folder(target: Path, token: str) -> Path:
    """Where a checkpoint folder for ``target`` is written before :func:`replace_folder` moves it there.

    Folders left by a process killed mid-save (this target's, any token) are removed first: call it on one process,
    before any process writes into the new one.
    """
    for stale in target.parent.glob(f"{_partial_stem(target)}.*{PARTIAL_SUFFIX}"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    return target.with_name(f"{_partial_stem(target)}.{token}{PARTIAL_SUFFIX}")


def replace_folder(staging: Path, target: Path) -> None:
    """Put the fully written checkpoint folder ``staging`` under ``target``'s name, then delete what was there.

    A sharded checkpoint's shards and metadata file are written one after the other, so writing into ``target``
    itself would let a kill between them leave new shards beside old metadata, which loads without an error and
    resumes wrongly. Here the name holds a complete checkpoint at every moment but one: between the two renames, a
    kill leaves no folder under it (the previous one survives under a hidden name, and the next save removes it).
    """
    previous = None
    if target.exists():
        previous = target.with_name(f"{_partial_stem(target)}.{uuid.uuid4().hex[:8]}.previous{PARTIAL_SUFFIX}")
        os.replace(target, previous)
    os.replace(staging, target)
    _sync_directory(target.parent)
    if previous is not None:
        if previous.is_dir():
            shutil.rmtree(previous, ignore_errors=True)
        else:
            previous.unlink(missing_ok=True)


def _partial_stem(target: Path) -> str:
    # a name no checkpoint lookup of Lightning's takes for a checkpoint: the suffix is not .ckpt (ModelCheckpoint's
    # "last"), and no "ckpt_" (the SLURM hpc_ckpt_<n> lookup reads the digits of any file name holding "ckpt_")
    return "." + target.name.replace("_", "-")


def _partials(target: Path) -> list[Path]:
    return list(target.parent.glob(f"{_partial_stem(target)}.*{PARTIAL_SUFFIX}"))


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
