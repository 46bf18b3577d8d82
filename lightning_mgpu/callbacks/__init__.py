"""Callbacks, one per module, re-exported here."""

from lightning_mgpu.callbacks.gradient_clipping import GradientClipping

__all__ = ["GradientClipping"]
