"""Repeated-block discovery and activation checkpointing (``lightning_mgpu.utilities.blocks``)."""

import pytest
import torch
from torch import nn

from lightning_mgpu.utilities.blocks import (
    apply_activation_checkpointing,
    checkpoint_activations,
    find_repeated_blocks,
    undo_checkpoint_activations,
)
from tests.helpers.tiny_transformer import Block, TinyTransformer


def test_the_outermost_repeated_blocks_are_found():
    model = TinyTransformer(depth=3)
    assert find_repeated_blocks(model) == list(model.blocks)  # not the Linear layers inside each block


def test_blocks_nested_in_a_wrapper_and_a_sequential():
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(4, 4)
            self.body = nn.Sequential(*(Block(4) for _ in range(2)))

    model = nn.Sequential(Wrapper(), nn.Linear(4, 2))
    assert find_repeated_blocks(model) == list(model[0].body)


def test_a_model_without_repeats_has_no_blocks_and_names_override():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Conv1d(3, 3, 1))
    assert find_repeated_blocks(model) == []
    assert find_repeated_blocks(model, ["Conv1d"]) == [model[2]]
    with pytest.raises(ValueError, match=r"\['Block'\].*classes are \['Conv1d', 'Linear', 'ReLU', 'Sequential'\]"):
        find_repeated_blocks(model, ["Block"])


def test_parameterless_repeats_are_not_blocks():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.ReLU())
    assert find_repeated_blocks(model) == []


def test_checkpointed_blocks_give_the_same_gradients_with_dropout_and_keep_their_keys():
    def grads(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        model = TinyTransformer(dropout=0.2)
        keys = list(model.state_dict())
        if checkpointed:
            assert apply_activation_checkpointing("Test", model, "auto") == [
                "blocks.0",
                "blocks.1",
                "blocks.2",
                "blocks.3",
            ]
            assert list(model.state_dict()) == keys
        torch.manual_seed(1)
        tokens = torch.randint(0, 32, (4, 8))
        model(tokens).square().mean().backward()
        return {name: param.grad.clone() for name, param in model.named_parameters()}

    plain, recomputed = grads(False), grads(True)
    assert all(torch.equal(plain[name], recomputed[name]) for name in plain)


def test_checkpointing_saves_fewer_tensors_and_undo_restores_the_forward():
    model = TinyTransformer(depth=4, dim=32)
    tokens = torch.randint(0, 32, (8, 8))

    def saved_bytes() -> int:
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(tokens).sum()
        return total

    before = saved_bytes()
    checkpoint_activations(model.blocks)
    checkpoint_activations(model.blocks)  # idempotent
    during = saved_bytes()
    undo_checkpoint_activations(model.blocks)
    assert during < before / 2
    assert saved_bytes() == before
    assert "forward" not in vars(model.blocks[0])


def test_auto_checkpointing_without_blocks_says_what_to_name():
    with pytest.raises(ValueError, match=r"found no repeated blocks in Sequential; name the classes"):
        apply_activation_checkpointing("DDPStrategy", nn.Sequential(nn.Linear(2, 2)), "auto")
