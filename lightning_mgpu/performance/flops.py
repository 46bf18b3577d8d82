"""Model FLOPs, counted by torch, and the peak FLOP/s of the device they run on, for model FLOPs utilisation."""

import re
import time
from typing import Literal

import torch
from torch.utils.flop_counter import FlopCounterMode

MatmulDtype = Literal["fp64", "fp32", "tf32", "fp16", "bf16"]

# dense (no sparsity) peak TFLOP/s from NVIDIA's data sheets, by a word of the name torch reports ("L4" is not
# "L40"); the first match wins, so the more specific names come first. fp32 is the CUDA-core rate, tf32 and 16-bit
# the tensor-core rates; a GPU without tf32 runs float32 products at its fp32 rate.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    ("H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.8, "fp32": 60.0}),
    ("H200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("GH200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.8, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
)


def matmul_dtype(precision: str) -> MatmulDtype:
    """The dtype the model's matrix products run in under a Lightning ``precision`` setting.

    ``"32-true"`` counts as tf32 when torch lets float32 products use tensor cores
    (``torch.set_float32_matmul_precision("high")`` or ``"medium"``).
    """
    precision = str(precision)
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("64"):
        return "fp64"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def table_peak_flops(device_name: str, dtype: MatmulDtype) -> float | None:
    """The data-sheet peak FLOP/s of a GPU for ``dtype``, or ``None`` when the table does not know it."""
    for name, peaks in PEAK_TFLOPS:
        if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w])", device_name, flags=re.IGNORECASE):
            value = peaks.get(dtype, peaks.get("fp32") if dtype == "tf32" else None)
            return value * 1e12 if value is not None else None
    return None


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype = torch.float32, size: int = 512, iterations: int = 5
) -> float:
    """The FLOP/s a square matrix product reaches on ``device`` with the threads this process has; the CPU's peak.

    Synchronises ``device`` (it is meant for set-up, not for the training loop).
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device, dtype)
    b = torch.randn(size, size, generator=generator).to(device, dtype)
    a @ b  # warm-up
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        a @ b
    _synchronize(device)
    seconds = (time.perf_counter() - start) / iterations
    return 2 * size**3 / seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FlopCount:
    """Count the FLOPs of the work done between :meth:`start` and :meth:`stop` on this thread (and autograd's).

    ``torch.utils.flop_counter`` counts matrix products, convolutions and attention, forward and backward, as
    they are dispatched; element-wise work is not counted (as in the usual model-FLOPs definition). The two calls
    may sit in different hooks of the training loop: the count covers the real step, with its real batch.
    """

    def __init__(self) -> None:
        self._mode: FlopCounterMode | None = None
        self._drops: list[tuple[int, int]] = []  # spans of the count (start, end) in attempts dropped and redone
        self.total: int | None = None
        # whether a count is in progress (a plain attribute: the training loop reads it every batch)
        self.running = False

    def start(self) -> None:
        """Start counting (nothing if already counting)."""
        if self._mode is None:
            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()
            self.running = True
            self._drops = []

    def counted(self) -> int:
        """The FLOPs counted so far in the count under way (0 if none is)."""
        return int(self._mode.get_total_flops()) if self._mode is not None else 0

    def drop_since(self, counted: int) -> None:
        """Leave out of the count what was counted since :meth:`counted` returned ``counted`` (a dropped attempt).

        Drops may overlap (an attempt inside a batch dropped, then the whole batch; or one attempt dropped twice):
        each span is left out once.
        """
        kept = [(start, min(end, counted)) for start, end in self._drops if start < counted]
        self._drops = [*kept, (counted, self.counted())]

    def stop(self) -> int | None:
        """Stop counting; returns the FLOPs counted (``None`` if it was not running)."""
        mode, self._mode = self._mode, None
        self.running = False
        if mode is None:
            return None
        mode.__exit__(None, None, None)
        self.total = int(mode.get_total_flops()) - sum(end - start for start, end in self._drops)
        return self.total
