"""Lightning's single-device strategy, carrying the reason ``MultiGPUStrategy`` chose it, with exact resume."""

import os
from typing import Any

from lightning.pytorch.strategies import SingleDeviceStrategy as LightningSingleDeviceStrategy
from typing_extensions import override

from lightning_mgpu.strategies.exact_resume import ExactResume, ExactResumeHooks
from lightning_mgpu.utilities.atomic_save import save_atomically
from lightning_mgpu.utilities.strategy_choice import StrategyChoice


class SingleDeviceStrategy(ExactResumeHooks, LightningSingleDeviceStrategy):
    """Train on one device, as Lightning's ``SingleDeviceStrategy``; ``choice`` says why it was chosen.

    As the pack's DDP strategies, it resumes a mid-epoch checkpoint exactly (the training loader's remaining batches
    in their order, the random streams as at the save; :mod:`lightning_mgpu.strategies.exact_resume`) and writes
    checkpoints atomically (:func:`~lightning_mgpu.utilities.atomic_save.save_atomically`).

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
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: "str | os.PathLike[str]", storage_options: Any | None = None
    ) -> None:
        self._add_resume_state(checkpoint)
        save_atomically(self.checkpoint_io, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._exact_resume.load(checkpoint, 0, 1)
        return checkpoint

    @override
    def teardown(self) -> None:
        self._exact_resume.teardown()
        super().teardown()
