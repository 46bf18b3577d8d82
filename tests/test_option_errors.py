"""One rule for bad options across the pack: ``TypeError`` for a wrong type, ``ValueError`` for a wrong value, raised
at construction with a message naming the class, the parameter and the value.

Each public class (and each helper class the strategies and callbacks build) gets at least one wrong-type and one
wrong-value option. ``DataParallelStrategy`` takes only what the Trainer sets, so it has no option to refuse.
"""

import re

import pytest
from torch import nn

from lightning_mgpu import DDPStrategy, GPUMemoryMonitor, GradientClipping, MultiGPUStrategy, NaNSkip
from lightning_mgpu.core.nvml import NVMLSession
from lightning_mgpu.ddp.comm_hooks import PowerSGDState, register_comm_hook
from lightning_mgpu.memory.memory_headroom import HeadroomWatch
from lightning_mgpu.memory.memory_sampler import MemorySampler
from lightning_mgpu.memory.memory_timeline import MemoryTimeline
from lightning_mgpu.stability.clip_grad import GradNormStatistics

BUILDERS = {
    "NaNSkip": NaNSkip,
    "GradientClipping": GradientClipping,
    "GPUMemoryMonitor": GPUMemoryMonitor,
    "DDPStrategy": DDPStrategy,
    "MultiGPUStrategy": MultiGPUStrategy,
    "PowerSGDState": PowerSGDState,
    "register_comm_hook": lambda **kwargs: register_comm_hook(nn.Linear(2, 2), **kwargs),
    "GradNormStatistics": GradNormStatistics,
    "HeadroomWatch": lambda **kwargs: HeadroomWatch(**{"threshold_mb": None, "warn": print, **kwargs}),
    "MemorySampler": lambda **kwargs: MemorySampler([], NVMLSession(), step=lambda: 0, **kwargs),
}

# (class, options, the error, the parameter named, its value); the other options of the class keep their defaults
CASES = [
    ("NaNSkip", {"max_consecutive": 2.5}, TypeError, "max_consecutive", 2.5),
    ("NaNSkip", {"max_consecutive": True}, TypeError, "max_consecutive", True),
    ("NaNSkip", {"check": 3}, TypeError, "check", 3),
    ("NaNSkip", {"log_skipped": "yes"}, TypeError, "log_skipped", "yes"),
    ("NaNSkip", {"max_consecutive": 0}, ValueError, "max_consecutive", 0),
    ("NaNSkip", {"check": "weights"}, ValueError, "check", "weights"),
    ("GradientClipping", {"mode": "norm", "max_norm": "1"}, TypeError, "max_norm", "1"),
    ("GradientClipping", {"mode": "zscore", "warmup_steps": 2.5}, TypeError, "warmup_steps", 2.5),
    ("GradientClipping", {"mode": "zscore", "decay": "0.9"}, TypeError, "decay", "0.9"),
    ("GradientClipping", {"mode": 2}, TypeError, "mode", 2),
    ("GradientClipping", {"mode": "agc", "exclude": [3]}, TypeError, "exclude", [3]),
    ("GradientClipping", {"mode": "norm", "max_norm": 1.0, "log_norm": None}, TypeError, "log_norm", None),
    ("GradientClipping", {"mode": "zscore", "decay": 1.0}, ValueError, "decay", 1.0),
    ("GradientClipping", {"mode": "zscore", "warmup_steps": -1}, ValueError, "warmup_steps", -1),
    ("GradientClipping", {"mode": "l2"}, ValueError, "mode", "l2"),
    ("GPUMemoryMonitor", {"sample_hz": "2"}, TypeError, "sample_hz", "2"),
    ("GPUMemoryMonitor", {"warn_headroom_mb": "1024"}, TypeError, "warn_headroom_mb", "1024"),
    ("GPUMemoryMonitor", {"log_prefix": 3}, TypeError, "log_prefix", 3),
    ("GPUMemoryMonitor", {"metrics": "headroom_mb"}, TypeError, "metrics", "headroom_mb"),
    ("GPUMemoryMonitor", {"prometheus_port": "9400"}, TypeError, "prometheus_port", "9400"),
    ("GPUMemoryMonitor", {"plot": "no"}, TypeError, "plot", "no"),
    ("GPUMemoryMonitor", {"sample_hz": 0}, ValueError, "sample_hz", 0),
    ("GPUMemoryMonitor", {"warn_headroom_mb": -1}, ValueError, "warn_headroom_mb", -1),
    ("GPUMemoryMonitor", {"log_prefix": ""}, ValueError, "log_prefix", ""),
    ("GPUMemoryMonitor", {"metrics": ["allocated"]}, ValueError, "metrics", ["allocated"]),
    ("GPUMemoryMonitor", {"prometheus_port": 70000}, ValueError, "prometheus_port", 70000),
    ("MultiGPUStrategy", {"mode": 3}, TypeError, "mode", 3),
    ("MultiGPUStrategy", {"mode": "fastest"}, ValueError, "mode", "fastest"),
    ("PowerSGDState", {"rank": 1.5}, TypeError, "rank", 1.5),
    ("PowerSGDState", {"seed": "0"}, TypeError, "seed", "0"),
    ("PowerSGDState", {"min_compression_rate": "2"}, TypeError, "min_compression_rate", "2"),
    ("PowerSGDState", {"rank": 0}, ValueError, "rank", 0),
    ("PowerSGDState", {"min_compression_rate": 0.0}, ValueError, "min_compression_rate", 0.0),
    ("register_comm_hook", {"name": 16}, TypeError, "name", 16),
    ("register_comm_hook", {"name": "fp16", "powersgd_rank": True}, TypeError, "powersgd_rank", True),
    ("register_comm_hook", {"name": "int8"}, ValueError, "name", "int8"),
    ("register_comm_hook", {"name": "powersgd", "powersgd_warmup_steps": -1}, ValueError, "powersgd_warmup_steps", -1),
    ("GradNormStatistics", {"decay": "0.9"}, TypeError, "decay", "0.9"),
    ("GradNormStatistics", {"decay": 1.5}, ValueError, "decay", 1.5),
    ("HeadroomWatch", {"threshold_mb": "1024"}, TypeError, "threshold_mb", "1024"),
    ("HeadroomWatch", {"threshold_mb": -1.0}, ValueError, "threshold_mb", -1.0),
    ("MemorySampler", {"hz": None}, TypeError, "hz", None),
    ("MemorySampler", {"hz": 0}, ValueError, "hz", 0),
]
# DDPStrategy and MultiGPUStrategy take the same DDP options and name themselves
for _strategy in ("DDPStrategy", "MultiGPUStrategy"):
    CASES += [
        (_strategy, {"sync_batchnorm": 1}, TypeError, "sync_batchnorm", 1),
        (_strategy, {"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb", "25"),
        (_strategy, {"bucket_tuning_steps": 30.0}, TypeError, "bucket_tuning_steps", 30.0),
        (_strategy, {"static_graph": "true"}, TypeError, "static_graph", "true"),
        (_strategy, {"broadcast_buffers": 0}, TypeError, "broadcast_buffers", 0),
        (_strategy, {"comm_hook": 16}, TypeError, "comm_hook", 16),
        (_strategy, {"powersgd_rank": 2.0}, TypeError, "powersgd_rank", 2.0),
        (_strategy, {"sync_batchnorm": "on"}, ValueError, "sync_batchnorm", "on"),
        (_strategy, {"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb", 0),
        (_strategy, {"bucket_tuning_steps": 9}, ValueError, "bucket_tuning_steps", 9),
        (_strategy, {"comm_hook": "zstd"}, ValueError, "comm_hook", "zstd"),
        (_strategy, {"powersgd_warmup_steps": -1}, ValueError, "powersgd_warmup_steps", -1),
    ]
CASES.append(("DDPStrategy", {"start_method": None}, TypeError, "start_method", None))
CASES.append(("DDPStrategy", {"start_method": "thread"}, ValueError, "start_method", "thread"))


@pytest.mark.parametrize(
    ("owner", "kwargs", "error", "parameter", "value"),
    CASES,
    ids=[f"{owner}-{error.__name__}-{parameter}={value!r}" for owner, _, error, parameter, value in CASES],
)
def test_a_bad_option_raises_the_rule_s_error_naming_class_parameter_and_value(owner, kwargs, error, parameter, value):
    with pytest.raises(Exception) as raised:  # the type is asserted exactly below
        BUILDERS[owner](**kwargs)
    assert type(raised.value) is error, f"{type(raised.value).__name__}: {raised.value}"
    assert re.match(rf"^{owner}: {parameter} must be .+, got {re.escape(repr(value))}(;|$)", str(raised.value))


def test_every_class_gets_a_wrong_type_and_a_wrong_value():
    for owner in BUILDERS:
        assert {error for name, _, error, _, _ in CASES if name == owner} == {TypeError, ValueError}, owner


def test_memory_timeline_refuses_a_bad_flush_interval_before_creating_its_file(tmp_path):
    path = tmp_path / "timeline" / "memory.csv"
    with pytest.raises(TypeError, match=r"^MemoryTimeline: flush_every must be an int >= 1, got 2.5$"):
        MemoryTimeline(path, ["host/rss_mb"], flush_every=2.5)
    with pytest.raises(ValueError, match=r"^MemoryTimeline: flush_every must be an int >= 1, got 0$"):
        MemoryTimeline(path, ["host/rss_mb"], flush_every=0)
    assert not path.exists()
