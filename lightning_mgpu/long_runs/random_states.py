"""Capture and restore one process's random streams: torch (CPU and its CUDA device), numpy and Python's ``random``.

Lightning's checkpoints hold no random state, and a rank's streams differ from the other ranks' (each seeds its own
dropout masks and augmentations), so a resumed run needs each rank's own captured at the save.
"""

import random
from collections.abc import Sequence
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None  # type: ignore[assignment]


def capture_random_states(device: torch.device | None = None, replicas: Sequence[torch.device] = ()) -> dict[str, Any]:
    """This process's random streams as plain, picklable values.

    Args:
        device: the CUDA device whose generator is captured too; CPU devices and ``None`` capture none.
        replicas: further CUDA devices this process draws on (DataParallel's other GPUs), captured in order.
    """
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if np is not None:
        # as plain values: Lightning loads checkpoints with torch.load(weights_only=True), which refuses numpy arrays
        kind, keys, position, has_gauss, cached = np.random.get_state()
        states["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached))
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state(device)
        states["cuda_device"] = device.index
        states["cuda_replicas"] = [torch.cuda.get_rng_state(replica) for replica in replicas]
    return states


def restore_random_states(
    states: dict[str, Any], device: torch.device | None = None, replicas: Sequence[torch.device] = ()
) -> None:
    """Put back streams captured by :func:`capture_random_states`; a stream missing from ``states`` is left alone.

    Args:
        states: what :func:`capture_random_states` returned.
        device: the CUDA device to restore the captured CUDA stream on (this process's device, which may have
            another index than at the save); ``None`` restores it on the device it was captured from.
        replicas: the devices to restore the captured ``replicas`` streams on, in the same order (as many as both
            have).
    """
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if np is not None and "numpy" in states:
        kind, keys, position, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        target = device if device is not None and device.type == "cuda" else states["cuda_device"]
        torch.cuda.set_rng_state(states["cuda"], target)
        for state, replica in zip(states.get("cuda_replicas", []), replicas, strict=False):
            torch.cuda.set_rng_state(state, replica)


def generator_states(*objects: Any) -> list[torch.Tensor | None]:
    """The state of each object's ``generator`` attribute (a sampler's, a loader's), ``None`` where it has none."""
    states: list[torch.Tensor | None] = []
    for obj in objects:
        generator = getattr(obj, "generator", None)
        states.append(generator.get_state() if isinstance(generator, torch.Generator) else None)
    return states


def set_generator_states(objects: tuple[Any, ...], states: list[torch.Tensor | None]) -> None:
    """Put back what :func:`generator_states` returned for the same objects."""
    for obj, state in zip(objects, states, strict=True):
        generator = getattr(obj, "generator", None)
        if state is not None and isinstance(generator, torch.Generator):
            generator.set_state(state)
