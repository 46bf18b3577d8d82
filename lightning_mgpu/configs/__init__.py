"""LightningCLI YAML configs shipped with the package, for :class:`lightning_mgpu.cli.MGPULightningCLI`.

``python -m lightning_mgpu config`` lists them; ``python -m lightning_mgpu config NAME`` prints one's path.

Example::

    from lightning_mgpu.configs import config_path
    MGPULightningCLI(args=["fit", "--config", str(config_path("cpu")), "--config", "my_model.yaml"])
"""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
CONFIG_NAMES = ("base", "cpu", "single_gpu", "multi_gpu", "robust_long_run")


def config_path(name: str) -> Path:
    """The path of the shipped config ``name`` (one of :data:`CONFIG_NAMES`).

    Args:
        name: ``"base"``, ``"cpu"``, ``"single_gpu"``, ``"multi_gpu"`` or ``"robust_long_run"``.

    Raises:
        ValueError: for any other name.
    """
    if name not in CONFIG_NAMES:
        raise ValueError(f"config name must be one of {', '.join(map(repr, CONFIG_NAMES))}, got {name!r}")
    return CONFIG_DIR / f"{name}.yaml"


def config_summary(name: str) -> str:
    """The config's first comment line, without the leading ``# lightning_mgpu NAME config:``."""
    first_line = config_path(name).read_text().splitlines()[0]
    return first_line.split(":", 1)[1].strip() if ":" in first_line else first_line
