"""A checkpoint save that fails part-way leaves the previous checkpoint under its name, and no partial file."""

import io
from typing import ClassVar

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Trainer

from lightning_mgpu.core import compat
from lightning_mgpu.long_runs.atomic_save import PARTIAL_SUFFIX, _partial_stem, save_atomically


def test_save_writes_a_loadable_file_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "last.ckpt"
    save_atomically(TorchCheckpointIO(), {"step": 1, "weight": torch.ones(3)}, target, None)
    assert torch.load(target)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


class KilledMidWrite(BaseException):
    """Stands for the process dying while the checkpoint's bytes are being written."""


def write_half_then_die(self, checkpoint, path, storage_options=None):
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    with open(path, "wb") as file:
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    raise KilledMidWrite


def test_a_save_killed_mid_write_keeps_the_previous_checkpoint_where_stock_truncates_it(tmp_path, monkeypatch):
    ours, stock = tmp_path / "ours" / "last.ckpt", tmp_path / "stock" / "last.ckpt"
    for target in (ours, stock):
        save_atomically(TorchCheckpointIO(), {"step": 1, "weights": torch.randn(1000)}, target, None)
    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", write_half_then_die)
    update = {"step": 2, "weights": torch.randn(1000)}
    with pytest.raises(KilledMidWrite):
        save_atomically(TorchCheckpointIO(), update, ours, None)
    with pytest.raises(KilledMidWrite):
        TorchCheckpointIO().save_checkpoint(update, stock)  # Lightning's own save writes the target in place
    assert torch.load(ours)["step"] == 1
    assert [p.name for p in ours.parent.iterdir()] == ["last.ckpt"]  # the partial file is gone too
    with pytest.raises(RuntimeError):
        torch.load(stock)


def test_partial_files_left_by_a_killed_save_are_removed_by_the_next(tmp_path):
    left = tmp_path / ".last.ckpt.0badc0de.partial"
    left.write_bytes(b"half a checkpoint")
    save_atomically(TorchCheckpointIO(), {"step": 3}, tmp_path / "last.ckpt", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_other_checkpoint_ios_save_as_they_always_do(tmp_path):
    class Recording(TorchCheckpointIO):
        paths: ClassVar[list] = []

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.paths.append(path)
            super().save_checkpoint(checkpoint, path, storage_options)

    save_atomically(Recording(), {"step": 1}, tmp_path / "a.ckpt", None)
    assert Recording.paths == [tmp_path / "a.ckpt"]  # in place: a subclass may write elsewhere or asynchronously


def test_a_partial_file_left_beside_slurm_checkpoints_is_not_taken_for_one(tmp_path):
    # Lightning finds hpc_ckpt_<n>.ckpt by reading the digits of every file name holding "ckpt_" in the folder
    save_atomically(TorchCheckpointIO(), {"step": 1}, tmp_path / "hpc_ckpt_1.ckpt", None)
    target = tmp_path / "hpc_ckpt_2.ckpt"
    leftover = target.with_name(f"{_partial_stem(target)}.0badc0de{PARTIAL_SUFFIX}")  # as a SIGKILL mid-write leaves
    leftover.write_bytes(b"half a checkpoint")
    trainer = Trainer(default_root_dir=tmp_path, logger=False)
    assert compat.slurm_checkpoint_path(trainer) == str(target)  # not hpc_ckpt_20 or the like
    save_atomically(TorchCheckpointIO(), {"step": 2}, target, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt"]
