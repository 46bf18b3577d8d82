import dataclasses
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import pytest
import torch

from lightning_mgpu.core.batch_split import batch_size_of, slice_batch, split_batch
from lightning_mgpu.core.step_pieces import merge_outputs


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


LegacyPair = namedtuple("LegacyPair", ["inputs", "names"])


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    path: list[str]
    source: str = "disk"
    cache: dict = dataclasses.field(default_factory=dict, init=False)


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    x: torch.Tensor
    tag: str = dataclasses.field(default="default", init=False)


class ReadOnlyMapping(Mapping):
    """A Mapping whose constructor does not take a dict: split must fall back to a plain dict."""

    def __init__(self, *, data: dict) -> None:
        self._data = data

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def assert_same(actual: Any, expected: Any) -> None:
    """Equal structure, equal types and equal tensor values (dtype included)."""
    assert type(actual) is type(expected), f"{type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype
        assert torch.equal(actual, expected)
    elif isinstance(expected, Mapping):
        assert list(actual.keys()) == list(expected.keys())
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(getattr(actual, f.name), getattr(expected, f.name))
    else:
        assert actual == expected


def round_trip(batch: Any, micro_batch_size: int) -> Any:
    pieces = split_batch(batch, micro_batch_size)
    assert len(pieces) > 1
    return merge_outputs([piece for piece, _ in pieces], [size for _, size in pieces])


# batch_size_of


def test_batch_size_of_tensor_and_collections():
    assert batch_size_of(torch.zeros(7, 3)) == 7
    assert batch_size_of((torch.zeros(4), torch.zeros(9))) == 4
    assert batch_size_of([torch.zeros(2, 5)]) == 2
    assert batch_size_of(Pair(torch.zeros(6), torch.zeros(3))) == 6
    assert batch_size_of(Sample(torch.zeros(5, 2), torch.zeros(5), ["a"] * 5)) == 5


def test_batch_size_of_is_depth_first_in_order_and_skips_scalars():
    batch = {"step": torch.tensor(3), "meta": {"ids": torch.arange(8)}, "x": torch.zeros(2)}
    assert batch_size_of(batch) == 8
    assert batch_size_of([["not a tensor", torch.tensor(1.0)], (torch.zeros(3, 1),), torch.zeros(11)]) == 3


def test_batch_size_of_ignores_init_false_fields():
    @dataclasses.dataclass
    class DerivedFirst:
        derived: torch.Tensor = dataclasses.field(init=False)  # declared first, but split never slices it
        x: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(4))

        def __post_init__(self) -> None:
            self.derived = torch.zeros(99)

    assert batch_size_of(DerivedFirst()) == 4


@pytest.mark.parametrize(
    "batch",
    [
        {"names": ["a", "b"], "n": 3},
        [torch.tensor(1.0), torch.tensor(2.0)],
        torch.tensor(5),
        None,
        "text",
        (),
    ],
)
def test_batch_size_of_without_a_tensor_raises(batch):
    with pytest.raises(ValueError, match=r"no tensor with at least one dimension") as info:
        batch_size_of(batch)
    assert type(batch).__name__ in str(info.value)


# split_batch: pieces


def test_split_uneven_last_piece():
    x = torch.arange(10)
    pieces = split_batch(x, 4)
    assert [size for _, size in pieces] == [4, 4, 2]
    assert [piece.tolist() for piece, _ in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_split_sizes_match_pieces_and_sum_to_batch():
    batch = {"x": torch.randn(13, 2), "y": torch.arange(13)}
    for micro in range(1, 13):
        pieces = split_batch(batch, micro)
        sizes = [size for _, size in pieces]
        assert sum(sizes) == 13
        assert all(size == micro for size in sizes[:-1])
        assert 1 <= sizes[-1] <= micro
        assert [batch_size_of(piece) for piece, _ in pieces] == sizes
        assert [piece["y"].shape[0] for piece, _ in pieces] == sizes


@pytest.mark.parametrize("micro", [10, 11, 1000])
def test_split_micro_at_least_batch_size_returns_the_same_object(micro):
    batch = {"x": torch.zeros(10, 3), "names": [str(i) for i in range(10)]}
    pieces = split_batch(batch, micro)
    assert len(pieces) == 1
    assert pieces[0][0] is batch
    assert pieces[0][1] == 10


def test_split_micro_one_gives_one_sample_per_piece():
    pieces = split_batch((torch.arange(3), ["a", "b", "c"]), 1)
    assert [size for _, size in pieces] == [1, 1, 1]
    assert [piece[1] for piece, _ in pieces] == [["a"], ["b"], ["c"]]
    assert [piece[0].tolist() for piece, _ in pieces] == [[0], [1], [2]]


def test_split_pieces_are_views_not_copies():
    x = torch.randn(10, 3)
    t = torch.randn(3, 10).t()  # non-contiguous, still sliced as a view
    pieces = split_batch({"x": x, "t": t}, 4)
    for key, original in (("x", x), ("t", t)):
        storage = original.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        for piece, _ in pieces:
            part = piece[key]
            assert part._is_view()
            assert part.untyped_storage().data_ptr() == storage.data_ptr()
            assert start <= part.data_ptr() < end
    pieces[1][0]["x"].fill_(0.0)
    assert torch.equal(x[4:8], torch.zeros(4, 3))


def test_split_scalars_and_other_first_dims_go_unchanged_into_every_piece():
    scalar = torch.tensor(0.5)
    table = torch.randn(3, 2)  # first dim 3 != 8: not per-sample
    batch = {"x": torch.zeros(8), "scale": scalar, "table": table, "name": "train", "none": None, "k": 2}
    pieces = split_batch(batch, 3)
    assert len(pieces) == 3
    for piece, _ in pieces:
        assert piece["scale"] is scalar
        assert piece["table"] is table
        assert piece["name"] == "train"
        assert piece["none"] is None
        assert piece["k"] == 2


def test_split_per_sample_lists_and_element_wise_lists():
    names = [f"img{i}.png" for i in range(6)]
    ids = tuple(range(6))
    not_per_sample = ["a", "b", "c"]  # length 3 != 6: unchanged in every piece
    mixed = [torch.arange(6), "tag"]  # holds a tensor: split element-wise
    batch = {"x": torch.zeros(6), "names": names, "ids": ids, "classes": not_per_sample, "mixed": mixed}
    pieces = split_batch(batch, 4)
    first, second = pieces[0][0], pieces[1][0]
    assert first["names"] == names[:4] and second["names"] == names[4:]
    assert first["ids"] == (0, 1, 2, 3) and second["ids"] == (4, 5)
    assert type(first["ids"]) is tuple
    assert first["classes"] == not_per_sample and second["classes"] == not_per_sample
    assert first["mixed"][0].tolist() == [0, 1, 2, 3] and first["mixed"][1] == "tag"
    assert second["mixed"][0].tolist() == [4, 5] and second["mixed"][1] == "tag"


def test_split_namedtuple_of_strings_is_a_record_not_per_sample():
    Meta = namedtuple("Meta", ["a", "b"])
    meta = Meta("left", "right")  # length 2 == batch size, but a namedtuple is a record
    pieces = split_batch((torch.zeros(2), meta), 1)
    for piece, _ in pieces:
        assert piece[1] == meta
        assert type(piece[1]) is Meta


def test_split_keeps_container_types():
    batch = OrderedDict(
        x=torch.arange(4),
        counts=defaultdict(int, {"y": torch.arange(4)}),
        pair=Pair(torch.arange(4), torch.arange(4) * 2),
        legacy=LegacyPair(torch.arange(4), ["a", "b", "c", "d"]),
        items=[torch.arange(4)],
    )
    for piece, _ in split_batch(batch, 3):
        assert type(piece) is OrderedDict
        assert list(piece.keys()) == list(batch.keys())
        assert type(piece["counts"]) is defaultdict
        assert piece["counts"].default_factory is int
        assert type(piece["pair"]) is Pair
        assert type(piece["legacy"]) is LegacyPair
        assert type(piece["items"]) is list
    assert split_batch(batch, 3)[1][0]["legacy"].names == ["d"]


def test_split_mapping_without_dict_constructor_falls_back_to_dict():
    batch = ReadOnlyMapping(data={"x": torch.arange(5)})
    pieces = split_batch(batch, 2)
    assert [type(piece) for piece, _ in pieces] == [dict, dict, dict]
    assert [piece["x"].tolist() for piece, _ in pieces] == [[0, 1], [2, 3], [4]]


def test_split_dataclass_replaces_init_fields_and_copies_init_false_fields():
    sample = Sample(torch.randn(5, 2), torch.arange(5), [f"p{i}" for i in range(5)], source="s3")
    sample.cache["hit"] = True
    pieces = split_batch(sample, 2)
    assert [size for _, size in pieces] == [2, 2, 1]
    for (piece, _), start in zip(pieces, (0, 2, 4), strict=True):
        assert type(piece) is Sample
        assert piece is not sample
        assert torch.equal(piece.image, sample.image[start : start + 2])
        assert piece.path == sample.path[start : start + 2]
        assert piece.source == "s3"
        assert piece.cache is sample.cache


def test_split_frozen_dataclass_with_init_false_field():
    sample = FrozenSample(torch.arange(3))
    object.__setattr__(sample, "tag", "custom")
    pieces = split_batch(sample, 2)
    assert [piece.x.tolist() for piece, _ in pieces] == [[0, 1], [2]]
    assert all(piece.tag == "custom" for piece, _ in pieces)


# split_batch: round trips


def test_round_trip_tensor():
    x = torch.randn(10, 3, 2)
    assert_same(round_trip(x, 4), x)


def test_round_trip_input_target_tuple():
    batch = (torch.randn(9, 4), torch.randint(0, 5, (9,)))
    assert_same(round_trip(batch, 2), batch)


def test_round_trip_dict_with_strings_and_a_scalar_tensor():
    scalar = torch.tensor(3.0)
    batch = {"x": torch.randn(7, 2), "names": [f"f{i}" for i in range(7)], "temperature": scalar, "split": "val"}
    pieces = split_batch(batch, 3)
    assert all(piece["temperature"] is scalar for piece, _ in pieces)
    # the same scalar in every piece averages back to itself; the per-sample parts give the batch back
    assert_same(round_trip(batch, 3), batch)


def test_round_trip_namedtuples():
    batch = Pair(torch.randn(6, 2), torch.arange(6))
    assert_same(round_trip(batch, 4), batch)
    legacy = LegacyPair(torch.randn(5), [f"n{i}" for i in range(5)])
    assert_same(round_trip(legacy, 2), legacy)


def test_round_trip_dataclass():
    sample = Sample(torch.randn(5, 2), torch.arange(5), [f"p{i}" for i in range(5)])
    rebuilt = round_trip(sample, 2)
    assert_same(rebuilt, sample)
    assert type(rebuilt) is Sample


def test_round_trip_nested():
    batch = {
        "inputs": [
            {"ids": torch.arange(11), "mask": torch.ones(11, 4, dtype=torch.bool)},
            Pair(torch.randn(11, 3), torch.randn(11)),
        ],
        "meta": OrderedDict(paths=tuple(f"x{i}" for i in range(11)), dataset="coco"),
        "sample": Sample(torch.randn(11, 1), torch.arange(11), [str(i) for i in range(11)]),
        "optional": None,
    }
    rebuilt = round_trip(batch, 3)
    assert_same(rebuilt, batch)
    assert type(rebuilt["meta"]) is OrderedDict


# split_batch: errors


@pytest.mark.parametrize("micro", [0, -3])
def test_split_micro_batch_size_below_one_raises(micro):
    with pytest.raises(ValueError, match=rf"micro_batch_size must be a positive int, got {micro}\b"):
        split_batch(torch.zeros(4), micro)


@pytest.mark.parametrize("micro", [2.0, True, "2"])
def test_split_micro_batch_size_not_an_int_raises(micro):
    with pytest.raises(TypeError, match=r"micro_batch_size must be a positive int"):
        split_batch(torch.zeros(4), micro)


def test_split_batch_without_a_tensor_raises():
    with pytest.raises(ValueError, match=r"cannot find the batch size of a dict batch"):
        split_batch({"names": ["a", "b", "c"]}, 1)


# slice_batch


def test_slice_batch_cuts_like_split_batch():
    batch = (torch.arange(10), [f"n{i}" for i in range(10)], torch.tensor(7.0))
    sliced = slice_batch(batch, 6, 10)
    assert torch.equal(sliced[0], torch.arange(6, 10))
    assert sliced[1] == ["n6", "n7", "n8", "n9"]
    assert sliced[2] is batch[2]
    assert slice_batch(batch, 0, 10) is batch
    with pytest.raises(ValueError, match="outside a batch of 10"):
        slice_batch(batch, 4, 11)
