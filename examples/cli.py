"""The pack from a LightningCLI YAML config: ``python examples/cli.py fit --config ...``.

A shipped config (``python -m lightning_mgpu config`` lists them) brings the strategy, every callback and the
per-device batch size derived from ``global_batch_size``; a second config brings the model and data:

    python examples/cli.py fit --config "$(python -m lightning_mgpu config cpu)" --config examples/configs/blobs.yaml
    python examples/cli.py fit --config "$(python -m lightning_mgpu config cpu)" --config examples/configs/blobs.yaml \\
        --trainer.devices=1 --global_batch_size=64      # the batch size follows: 64 per device
    python examples/cli.py fit ... --print_config        # the merged config, interpolations resolved

Any LightningModule and LightningDataModule can be named by ``class_path`` in place of the examples' ones.
"""

import os

import torch

from lightning_mgpu.cli import MGPULightningCLI

# one thread per process: several CPU processes on a few cores must not fight over them
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(args: list[str] | None = None) -> MGPULightningCLI:
    torch.set_num_threads(1)  # torch is imported already: the environment variable reaches the launched ranks only
    return MGPULightningCLI(save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
