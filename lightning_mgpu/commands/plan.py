"""``python -m lightning_mgpu plan``: the memory plan of a LightningModule, before any training run.

Builds the module on the CPU (or the first GPU), takes one batch from its ``train_dataloader()``, measures it as
``MultiGPUStrategy(mode="auto")`` does at ``setup``, and prints the table for the given number of devices and budget.
"""

import importlib
import json
from typing import Any

import torch

from lightning_mgpu.fsdp.memory_plan import MemoryPlan, plan_memory
from lightning_mgpu.fsdp.memory_planning import measure_model, plan_budget


def load_class(path: str) -> type:
    """Import ``package.module:ClassName`` (or ``package.module.ClassName``).

    Raises:
        ValueError: the path names no importable class.
    """
    module_name, _, class_name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not class_name:
        raise ValueError(f"--model must be 'package.module:ClassName', got {path!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--model {path!r}: cannot import {class_name!r} from {module_name!r} ({err})") from err
    if not isinstance(cls, type):
        raise ValueError(f"--model {path!r} is not a class")
    return cls


def model_plan(
    model: str,
    init_args: dict[str, Any] | None = None,
    devices: int = 1,
    budget_mb: float | None = None,
    shard_units: list[str] | None = None,
) -> MemoryPlan:
    """The plan for ``model`` (a class path) trained on ``devices`` processes with ``budget_mb`` each.

    Raises:
        ValueError: the class cannot be imported or built, or it defines no ``train_dataloader``.
    """
    cls = load_class(model)
    torch.manual_seed(0)
    module = cls(**(init_args or {}))
    hook = getattr(module, "train_dataloader", None)
    try:
        loader = hook() if callable(hook) else None
    except Exception as err:  # Lightning's default hook raises when the module defines none
        raise ValueError(f"{cls.__name__}.train_dataloader() failed: {err}") from err
    if loader is None:
        raise ValueError(f"{cls.__name__} defines no train_dataloader(); the plan needs one batch to measure")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    batch = _to(next(iter(loader)), device)
    memory = measure_model(module.to(device), batch, shard_units)
    budget, source = plan_budget(device, devices, budget_mb)
    return plan_memory(memory, world_size=devices, budget_mb=budget, budget_source=source,
                       cpu_offload_possible=device.type == "cuda")  # fmt: skip


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: _to(value, device) for key, value in batch.items()}
    return batch


def parse_init_args(text: str | None) -> dict[str, Any]:
    """``--init-args`` as a dict (JSON object).

    Raises:
        ValueError: not a JSON object.
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--init-args must be a JSON object, got {text!r} ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"--init-args must be a JSON object, got {text!r}")
    return value
