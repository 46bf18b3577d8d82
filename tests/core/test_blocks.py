"""Repeated-block discovery and activation checkpointing (``lightning_mgpu.core.blocks``)."""

import copy
import functools
import io

import pytest
import torch
from torch import nn

from lightning_mgpu.core.blocks import (
    TiedParameter,
    TiedParameterSplitError,
    apply_activation_checkpointing,
    checkpoint_activations,
    find_repeated_blocks,
    sharding_units,
    tied_parameters,
    undo_checkpoint_activations,
)
from lightning_mgpu.fsdp.memory_plan import model_memory
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


def test_leaf_layers_are_never_blocks_even_when_their_class_repeats():
    # two embeddings side by side (GPT-2's wte and wpe) and two heads are leaf layers, not a transformer's layers
    class TwoEmbeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(8, 4)
            self.positions = nn.Embedding(8, 4)
            self.layers = nn.ModuleList(Block(4) for _ in range(2))
            self.head_a, self.head_b = nn.Linear(4, 8), nn.Linear(4, 8)

    model = TwoEmbeddings()
    assert find_repeated_blocks(model) == list(model.layers)


def test_repeats_in_a_container_win_over_repeated_attributes():
    # T5 keeps its encoder and decoder (one class) as attributes and its layers in ModuleLists: the layers are units
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block(4) for _ in range(2))

    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.decoder = Stack(), Stack()

    model = EncoderDecoder()
    assert find_repeated_blocks(model) == [*model.encoder.layers, *model.decoder.layers]

    class Attributes(nn.Module):  # no container repeats anything: repeated attributes are the blocks
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = Block(4), Block(4)

    plain = Attributes()
    assert find_repeated_blocks(plain) == [plain.first, plain.second]


class OwnParameters(nn.Module):  # a block that holds its parameters itself, with no layer inside
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_every_repeat_inside_a_container_is_a_block_leaf_layers_too():
    model = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList(OwnParameters() for _ in range(3)))
    assert find_repeated_blocks(model) == list(model[1])
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_repeated_blocks(mlp) == [mlp[0], mlp[2], mlp[4]]


def test_cnn_stages_give_their_repeated_blocks_and_are_units_themselves_where_nothing_repeats_inside():
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)

    class ResNetLike(nn.Module):  # torchvision's layout, stages of [2, 1, 1, 1] blocks
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 2, 3)
            self.layer1 = nn.Sequential(Residual(), Residual())
            self.layer2, self.layer3, self.layer4 = (nn.Sequential(Residual()) for _ in range(3))
            self.fc = nn.Linear(2, 10)

    model = ResNetLike()
    assert find_repeated_blocks(model) == [*model.layer1, model.layer2, model.layer3, model.layer4]


def test_a_modulelist_or_moduledict_is_never_a_block_its_members_are():
    nested = nn.ModuleList([nn.ModuleList([Block(4), Block(4)]), nn.ModuleList([Block(4), Block(4)])])
    assert find_repeated_blocks(nested) == [*nested[0], *nested[1]]  # fully_shard needs a forward
    stages = nn.ModuleDict({f"s{i}": nn.Sequential(nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 1)) for i in range(4)})
    assert find_repeated_blocks(stages) == list(stages.values())


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.layers = nn.ModuleList(Block(4) for _ in range(2))
        self.out = nn.Linear(4, 16, bias=False)
        self.out.weight = self.embed.weight


def test_tied_parameters_are_found_by_identity_under_every_name():
    model = TiedLM()
    assert tied_parameters(model) == [TiedParameter(("embed.weight", "out.weight"), 64)]
    assert tied_parameters(TinyTransformer()) == []


def test_a_unit_holding_part_of_a_tied_parameter_is_opened_into_its_own_blocks():
    class Stage(nn.Module):
        def __init__(self, embed: bool) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 4) if embed else None
            self.layers = nn.ModuleList(Block(4) for _ in range(2))

    class Wrapped(nn.Module):  # the embedding inside one repeated stage, its tied head outside: split if a unit
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList([Stage(embed=True), Stage(embed=False)])
            self.head = nn.Linear(4, 16, bias=False)
            self.head.weight = self.stages[0].embed.weight

    model = Wrapped()
    assert find_repeated_blocks(model) == list(model.stages)  # the two stages repeat
    # stage 0 holds the embedding, the head is outside: stage 0 is opened, its layers become the units
    assert sharding_units(model) == [*model.stages[0].layers, model.stages[1]]


def test_named_units_that_split_a_tied_parameter_are_refused_naming_it_and_both_modules():
    model = TiedLM()
    assert sharding_units(model, ["Block"]) == list(model.layers)  # the tied pair stays with the root
    with pytest.raises(TiedParameterSplitError, match=r"shard_units=\['Embedding'\] would split the tied parameter "
                       r"'embed.weight' \(also named 'out.weight'\): module 'embed' is in the unit 'embed' "
                       r"\(Embedding\) and module 'out' is outside it"):  # fmt: skip
        sharding_units(model, ["Embedding"], owner="FSDPStrategy")
    # both holders in units of their own: still two units
    with pytest.raises(TiedParameterSplitError, match=r"'embed.weight'"):
        sharding_units(model, ["Embedding", "Linear"])


def test_the_memory_plan_counts_a_tied_parameter_once():
    model = TiedLM()
    memory = model_memory(model, 0, 0, 0, sharding_units(model))
    unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert memory.param_bytes == 4 * unique == 4 * (64 + 2 * sum(p.numel() for p in Block(4).parameters()))
    assert memory.largest_unit_bytes == 4 * sum(p.numel() for p in Block(4).parameters())  # a layer
    model.embed = nn.Embedding(1000, 4)  # a large vocabulary: the root, which keeps it gathered, is the largest unit
    model.out.weight = model.embed.weight
    assert model_memory(model, 0, 0, 0, sharding_units(model)).largest_unit_bytes == 4 * 4000


def hugging_face(name: str) -> nn.Module:
    if name != "tied":
        pytest.importorskip("transformers")
    from tests.helpers.lm_fit import build

    return build(name)


@pytest.mark.parametrize(
    ("name", "units", "tied"),
    [
        ("gpt2", ["transformer.h.0", "transformer.h.1"], [("transformer.wte.weight", "lm_head.weight")]),
        (
            "bert",
            ["bert.encoder.layer.0", "bert.encoder.layer.1"],
            [
                ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
                ("cls.predictions.bias", "cls.predictions.decoder.bias"),
            ],
        ),
        (
            "t5",
            ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
            [("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")],
        ),
        ("llama", ["model.layers.0", "model.layers.1"], []),  # an untied head
        ("tied", ["layers.0", "layers.1", "layers.2"], [("embed.weight", "out.weight")]),
    ],
)
def test_the_units_of_the_models_people_bring_are_their_layers(name, units, tied):
    model = hugging_face(name)
    names = {id(module): name for name, module in model.named_modules()}
    assert [names[id(unit)] for unit in sharding_units(model)] == units
    assert [param.names for param in tied_parameters(model)] == tied


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * scale


def _grads(checkpointed: bool, compile_backend: str | None = None, hook_calls: list | None = None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(_Scaled(), _Scaled())
    if hook_calls is not None:  # a pre-hook of the user's, registered before the strategy checkpoints the blocks
        model[0].register_forward_pre_hook(lambda module, args: hook_calls.append(1) or (args[0] * 2,))
    if checkpointed:
        checkpoint_activations(list(model))
    x = torch.randn(3, 4)

    def run(x: torch.Tensor) -> torch.Tensor:
        return model[1](model[0](x, scale=2.0), scale=0.5).sum()

    (torch.compile(run, backend=compile_backend) if compile_backend else run)(x).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def test_a_checkpointed_block_keeps_its_parameter_names_and_takes_keyword_arguments():
    plain, recomputed = _grads(False), _grads(True)
    assert recomputed.keys() == plain.keys()
    assert all(torch.equal(plain[name], recomputed[name]) for name in plain)


def test_a_checkpointed_block_runs_the_users_forward_hooks_once_a_step():
    # the recomputation replays the forward, not the call: a pre-hook that changes the input is not applied twice
    calls_plain, calls_recomputed = [], []
    plain, recomputed = _grads(False, hook_calls=calls_plain), _grads(True, hook_calls=calls_recomputed)
    assert calls_plain == calls_recomputed == [1]
    assert all(torch.equal(plain[name], recomputed[name]) for name in plain)


def test_checkpointed_blocks_train_under_torch_compile_as_without_checkpointing():
    plain, recomputed = _grads(False, "aot_eager"), _grads(True, "aot_eager")
    assert all(torch.allclose(plain[name], recomputed[name], rtol=1e-6, atol=1e-7) for name in plain)


def test_a_pre_hook_registered_after_checkpointing_changes_the_recomputed_input_too():
    # its change of the input runs inside the checkpoint; the recomputation takes the input the forward ran with
    torch.manual_seed(0)
    model = nn.Sequential(_Scaled(), _Scaled())
    reference = copy.deepcopy(model)
    checkpoint_activations(list(model))
    for net in (model, reference):
        net[0].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    x = torch.randn(3, 4)
    for net in (model, reference):
        net(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_a_copy_of_a_checkpointed_model_recomputes_its_own_blocks():
    torch.manual_seed(0)
    model = TinyTransformer(depth=3, dim=16)
    checkpoint_activations(model.blocks)
    copied = copy.deepcopy(model)
    with torch.no_grad():  # the copy's weights part from the model's: a recomputation from the model would show
        for param in copied.parameters():
            param.mul_(0.5)
    reference = copy.deepcopy(copied)
    undo_checkpoint_activations(reference.blocks)
    tokens = torch.randint(0, 32, (4, 8))
    for net in (copied, reference):
        net(tokens).square().mean().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(copied.parameters(), reference.parameters(), strict=True))
    assert all(param.grad is None for param in model.parameters())
    assert all(isinstance(block.forward, functools.partial) for block in copied.blocks)  # the copy still recomputes


def test_a_checkpointed_model_pickles_and_stays_checkpointed():
    torch.manual_seed(0)
    model = TinyTransformer(depth=3, dim=16)
    checkpoint_activations(model.blocks)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(isinstance(block.forward, functools.partial) for block in loaded.blocks)  # still checkpointed
    tokens = torch.randint(0, 32, (4, 8))
    for net in (model, loaded):
        net(tokens).square().mean().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), loaded.parameters(), strict=True))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x))) + x


@pytest.mark.parametrize("rows", [4, 8])
def test_a_compiled_model_of_checkpointed_residual_blocks_trains_as_without_checkpointing(rows):
    # a checkpoint put around a compiled forward by hooks recomputes in eager mode, whose saved tensors come in another
    # order than the compiled graph's: a CheckpointError with 4 rows, silently wrong gradients with 8
    def grads(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(_Residual(), _Residual(), _Residual())
        if checkpointed:
            checkpoint_activations(list(model))
        torch._dynamo.reset()
        torch.compile(model, backend="aot_eager")(torch.randn(rows, 8)).sum().backward()
        return [param.grad for param in model.parameters()]

    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(grads(False), grads(True), strict=True))
