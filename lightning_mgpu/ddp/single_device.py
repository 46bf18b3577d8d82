"""Lightning's single-device strategy, carrying the reason ``MultiGPUStrategy`` chose it, with exact resume."""

from typing import Any

from lightning.pytorch.strategies import SingleDeviceStrategy as LightningSingleDeviceStrategy
from typing_extensions import override

from lightning_mgpu.core.step_service import OwnStepService
from lightning_mgpu.core.strategy_choice import StrategyChoice
from lightning_mgpu.long_runs.exact_resume import ExactResume, OneProcessCheckpoints


class SingleDeviceStrategy(OwnStepService, OneProcessCheckpoints, LightningSingleDeviceStrategy):
    """Train on one device, as Lightning's ``SingleDeviceStrategy``; ``choice`` says why it was chosen.

    As the pack's DDP strategies, it resumes a mid-epoch checkpoint exactly (the training loader's remaining batches
    in their order, the random streams as at the save; :mod:`lightning_mgpu.long_runs.exact_resume`) and writes
    checkpoints atomically (:func:`~lightning_mgpu.long_runs.atomic_save.save_atomically`).

    Args:
        *args: as Lightning's ``SingleDeviceStrategy``.
        **kwargs: as Lightning's ``SingleDeviceStrategy``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=1, strategy="mgpu")  # becomes a SingleDeviceStrategy
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choice: StrategyChoice | None = None
        self._exact_resume = ExactResume(type(self).__name__)

    @override
    def teardown(self) -> None:
        self.end_step_service()
        self._exact_resume.teardown()
        super().teardown()
