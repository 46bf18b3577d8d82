"""The public API stays put: the names users write in code, in YAML and on the command line.

Internal module paths may move; these may not without a deprecation. A change here is a change users see: update
the lists only together with the README and a note in the release.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.strategies import StrategyRegistry

import lightning_mgpu
from lightning_mgpu.__main__ import main

EXPORTED = [
    "EMA",
    "BatchSizeSearch",
    "DDPStrategy",
    "DataParallelStrategy",
    "DeviceAgnosticSyncBatchNorm",
    "DistributedBatchNorm",
    "FSDPStrategy",
    "GPUMemoryMonitor",
    "GPUSelectionError",
    "GradientClipping",
    "MemoryHeadroomWarning",
    "MultiGPUStrategy",
    "NaNSkip",
    "NonFiniteStepsError",
    "OOMBackoff",
    "OOMRecoveryError",
    "PerformanceMonitor",
    "RollbackLimitError",
    "SingleDeviceStrategy",
    "StrategyChoice",
    "StragglerWarning",
    "select_gpus",
    "__version__",
]
ALSO_IMPORTABLE = ["register_strategies"]  # `from lightning_mgpu import register_strategies`, not in __all__
# registered name -> the class it builds and the arguments it passes
STRATEGY_NAMES = {
    "mgpu": ("MultiGPUStrategy", {"mode": "auto"}),
    "mgpu_ddp": ("MultiGPUStrategy", {"mode": "ddp"}),
    "mgpu_ddp_spawn": ("MultiGPUStrategy", {"mode": "ddp_spawn"}),
    "mgpu_ddp_fork": ("MultiGPUStrategy", {"mode": "ddp_fork"}),
    "mgpu_dp": ("MultiGPUStrategy", {"mode": "dp"}),
    "mgpu_fsdp": ("MultiGPUStrategy", {"mode": "fsdp"}),
    "mgpu_ddp_fp16": ("MultiGPUStrategy", {"mode": "ddp", "comm_hook": "fp16"}),
    "mgpu_ddp_bf16": ("MultiGPUStrategy", {"mode": "ddp", "comm_hook": "bf16"}),
    "mgpu_ddp_powersgd": (
        "MultiGPUStrategy",
        {"mode": "ddp", "comm_hook": "powersgd", "gradient_as_bucket_view": True},
    ),
}
PACK_CALLBACKS = ["lightning_mgpu.NaNSkip", "lightning_mgpu.GradientClipping", "lightning_mgpu.GPUMemoryMonitor"]
CONFIG_CLASS_PATHS = {
    "base": ["lightning_mgpu.MultiGPUStrategy", *PACK_CALLBACKS, "lightning_mgpu.OOMBackoff"],
    "cpu": ["lightning_mgpu.MultiGPUStrategy", *PACK_CALLBACKS, "lightning_mgpu.OOMBackoff"],
    "multi_gpu": ["lightning_mgpu.MultiGPUStrategy", *PACK_CALLBACKS],
    "robust_long_run": [
        "lightning_mgpu.MultiGPUStrategy",
        "lightning.pytorch.callbacks.ModelCheckpoint",
        *PACK_CALLBACKS,
        "lightning_mgpu.OOMBackoff",
    ],
    "single_gpu": ["lightning_mgpu.MultiGPUStrategy", *PACK_CALLBACKS, "lightning_mgpu.OOMBackoff"],
}
# `python -m lightning_mgpu <command>` and the options and arguments each takes
COMMANDS = {
    "env": ["--accelerator", "--devices", "--nodes"],
    "check": ["--processes", "--max-mb", "--checks", "--gpu-tests"],
    "config": ["base", "cpu", "single_gpu", "multi_gpu", "robust_long_run"],  # the names it takes
    "export": ["checkpoint", "out", "--prefix", "--ema"],
    "plan": ["--model", "--init-args", "--devices", "--budget-mb", "--shard-units"],
}


def test_every_exported_name_is_listed_and_importable():
    assert sorted(lightning_mgpu.__all__, key=str.lower) == sorted(EXPORTED, key=str.lower)
    for name in [*EXPORTED[:-1], *ALSO_IMPORTABLE]:
        assert getattr(lightning_mgpu, name).__name__ == name


def test_the_registered_strategy_names_build_what_they_built():
    ours = {
        name: (StrategyRegistry[name]["strategy"].__name__, StrategyRegistry[name]["init_params"])
        for name in StrategyRegistry.available_strategies()
        if name.startswith("mgpu")
    }
    assert ours == STRATEGY_NAMES


def class_paths(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["class_path"]] if "class_path" in node else []
        return own + [path for value in node.values() for path in class_paths(value)]
    if isinstance(node, list):
        return [path for value in node for path in class_paths(value)]
    return []


def test_the_shipped_configs_name_the_same_classes():
    folder = Path(lightning_mgpu.__file__).parent / "configs"
    found = {path.stem: class_paths(yaml.safe_load(path.read_text())) for path in sorted(folder.glob("*.yaml"))}
    assert found == CONFIG_CLASS_PATHS


def help_of(*argv: str) -> str:
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return shown.getvalue()


def test_the_commands_and_their_options_stay():
    listing = help_of()
    shown = {name for name in COMMANDS if re.search(rf"^\s+{name}\s", listing, flags=re.MULTILINE)}
    assert shown == set(COMMANDS)
    for command, options in COMMANDS.items():
        usage = help_of(command).split("\n\n")[0]  # the usage line: names, not the descriptions below it
        missing = [option for option in options if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", usage)]
        assert not missing, f"python -m lightning_mgpu {command} no longer takes {missing}"
