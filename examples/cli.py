"""The pack from a LightningCLI YAML config: ``python examples/cli.py fit --config ...``.

A shipped config (``python -m lightning_mgpu config`` lists them) brings the strategy, every callback and the
per-device batch size derived from ``global_batch_size``; a second config brings the model and data:

    python examples/cli.py fit --config "$(python -m lightning_mgpu config cpu)" --config examples/configs/blobs.yaml
    python examples/cli.py fit --config "$(python -m lightning_mgpu config cpu)" --config examples/configs/blobs.yaml \\
        --trainer.devices=1 --global_batch_size=64      # the batch size follows: 64 per device
    python examples/cli.py fit ... --print_config        # the merged config, interpolations resolved

Any LightningModule and LightningDataModule can be named by ``class_path`` in place of the examples' ones. At the end
of ``fit``, rank 0 prints a summary of what the pack did (the main example's, ``examples/summary.py``). When the
output is not a terminal, the progress is one line per epoch instead of tqdm's bar (``examples/progress.py``).
"""

import os
import time

import torch
from progress import progress_callbacks
from summary import fit_summary

from lightning_mgpu.cli import MGPULightningCLI

# one thread per process: several CPU processes on a few cores must not fight over them
os.environ.setdefault("OMP_NUM_THREADS", "1")


class ExampleCLI(MGPULightningCLI):
    """``MGPULightningCLI`` that prints the examples' summary on rank 0 at the end of ``fit``."""

    def before_fit(self) -> None:
        self._fit_started = time.perf_counter()

    def after_fit(self) -> None:
        seconds = time.perf_counter() - self._fit_started
        if self.trainer.is_global_zero:
            print("\n" + fit_summary(self.trainer, seconds, "lightning_mgpu CLI example: summary"), flush=True)


def main(args: list[str] | None = None) -> MGPULightningCLI:
    torch.set_num_threads(1)  # torch is imported already: the environment variable reaches the launched ranks only
    return ExampleCLI(
        save_config_kwargs={"overwrite": True}, trainer_defaults={"callbacks": progress_callbacks()}, args=args
    )


if __name__ == "__main__":
    main()
