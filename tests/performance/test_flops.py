"""FLOPs counted by torch against the analytic count, and the peak FLOP/s the MFU is measured against."""

import math

import pytest
import torch
from torch import nn

from lightning_mgpu.performance.flops import FlopCount, matmul_dtype, measure_matmul_flops, table_peak_flops


class TinyTransformer(nn.Module):
    """A decoder-style transformer small enough for a CPU test, its attention written out as matrix products."""

    def __init__(self, vocab: int, width: int, heads: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(width),
                    "qkv": nn.Linear(width, 3 * width),
                    "proj": nn.Linear(width, width),
                    "norm2": nn.LayerNorm(width),
                    "up": nn.Linear(width, hidden),
                    "down": nn.Linear(hidden, width),
                }
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        batch, length, width = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).split(width, dim=-1)
            q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(width // self.heads), dim=-1)
            x = x + block["proj"]((attention @ v).transpose(1, 2).reshape(batch, length, width))
            x = x + block["down"](torch.relu(block["up"](block["norm2"](x))))
        return self.head(x)


def test_counted_flops_of_a_small_transformer_match_the_analytic_count():
    vocab, width, heads, hidden, layers, batch, length = 64, 32, 4, 128, 2, 4, 16
    model = TinyTransformer(vocab, width, heads, hidden, layers)
    tokens = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))

    count = FlopCount()
    count.start()
    logits = model(tokens)
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    total = count.stop()

    n = batch * length
    linear_per_layer = 2 * n * (width * 3 * width + width * width + width * hidden + hidden * width)
    attention_per_layer = 2 * (2 * batch * length * length * width)  # q k^T and (attention) v
    forward = layers * (linear_per_layer + attention_per_layer) + 2 * n * width * vocab
    # backward computes two products per forward product (input and weight gradients): three times forward in all
    analytic = 3 * forward
    assert total == count.total
    assert abs(total - analytic) / analytic < 0.05, (total, analytic)


def test_dropped_attempts_are_left_out_once_however_their_drops_overlap():
    # what a batch that backs off with synchronized BatchNorm does: a micro-batch dropped, dropped again after a
    # replay, then the whole batch dropped and redone; and a save taken before an earlier, wider drop
    layer, x = nn.Linear(64, 64, bias=False), torch.randn(8, 64)
    one = 2 * 8 * 64 * 64  # the FLOPs of one forward through the layer
    count = FlopCount()
    count.start()
    batch = count.counted()
    layer(x)  # a micro-batch that succeeded
    piece = count.counted()
    layer(x)  # the micro-batch that failed
    count.drop_since(piece)
    layer(x)  # the replay of its collectives
    count.drop_since(piece)
    count.drop_since(batch)  # every rank starts the batch over
    layer(x)
    layer(x)  # the redo, in two micro-batches
    assert count.stop() == 2 * one

    count.start()
    outer = count.counted()
    layer(x)
    inner = count.counted()
    layer(x)
    count.drop_since(outer)
    count.drop_since(inner)  # a save inside a span dropped already
    layer(x)
    assert count.stop() == one


def test_a_count_that_was_not_started_gives_none():
    count = FlopCount()
    assert count.stop() is None and not count.running


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("16-mixed", "fp16"), ("32-true", "fp32"), ("64-true", "fp64")],
)
def test_the_precision_names_the_matmul_dtype(precision, dtype):
    assert matmul_dtype(precision) == dtype


def test_float32_counts_as_tf32_when_torch_allows_it():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert matmul_dtype("32-true") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_peak_table_matches_the_most_specific_name():
    assert table_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.5e12)
    assert table_peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5e12)
    assert table_peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156e12)
    assert table_peak_flops("NVIDIA L40S", "fp32") == pytest.approx(91.6e12)
    assert table_peak_flops("NVIDIA L40", "bf16") == pytest.approx(181e12)  # not the L4
    assert table_peak_flops("NVIDIA L4", "bf16") == pytest.approx(121e12)
    assert table_peak_flops("NVIDIA H200 NVL", "bf16") == pytest.approx(835.5e12)
    assert table_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert table_peak_flops("Tesla V100-SXM2-16GB", "tf32") == pytest.approx(15.7e12)  # no tf32: the fp32 rate
    assert table_peak_flops("Some Future GPU", "bf16") is None


def test_the_cpu_matmul_peak_is_measured():
    flops = measure_matmul_flops(torch.device("cpu"), size=128, iterations=2)
    assert 1e6 < flops < 1e13
