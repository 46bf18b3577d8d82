"""Lightning's single-device strategy, carrying the reason ``MultiGPUStrategy`` chose it."""

from typing import Any

from lightning.pytorch.strategies import SingleDeviceStrategy as LightningSingleDeviceStrategy

from lightning_mgpu.utilities.strategy_choice import StrategyChoice


class SingleDeviceStrategy(LightningSingleDeviceStrategy):
    """Train on one device, as Lightning's ``SingleDeviceStrategy``; ``choice`` says why it was chosen.

    Args:
        *args: as Lightning's ``SingleDeviceStrategy``.
        **kwargs: as Lightning's ``SingleDeviceStrategy``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=1, strategy="mgpu")  # becomes a SingleDeviceStrategy
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choice: StrategyChoice | None = None
