"""The README's example and a LightningCLI YAML config, run as a user runs them: real processes, no mocks."""

from pathlib import Path

import pytest
import torch

from tests.helpers.models import load_rank_dumps
from tests.helpers.processes import run_script

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed


def run(args, tmp_path, timeout=150):
    return run_script(*args, timeout=timeout, cwd=tmp_path)


def test_main_example_trains_on_two_cpu_processes(tmp_path):
    result = run([str(REPO / "examples" / "train.py"), "fit", "--trainer.max_epochs=1"], tmp_path)
    assert result["rc"] == 0, result["output"][-3000:]
    assert "strategy: MultiGPUStrategy (ddp); processes: 2" in result["output"]
    assert "sync_batchnorm='auto' synchronises BatchNorm statistics across 2 processes" in result["output"]


def test_yaml_config_with_multigpu_strategy_options_trains_two_steps_on_two_processes(tmp_path):
    config = tmp_path / "mgpu_config.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 2
  strategy:
    class_path: lightning_mgpu.MultiGPUStrategy
    init_args:
      mode: auto
      sync_batchnorm: true
      bucket_cap_mb: 5
      gradient_as_bucket_view: true
      comm_hook: bf16
  callbacks:
    - class_path: tests.helpers.models.RankStateDump
      init_args:
        directory: {tmp_path}
model:
  hidden: ${{data.batch_size}}
data:
  batch_size: 16
"""
    )
    result = run([str(REPO / "examples" / "train.py"), "fit", "--config", str(config)], tmp_path)
    assert result["rc"] == 0, result["output"][-3000:]

    dumps = load_rank_dumps(tmp_path)
    assert [d["global_step"] for d in dumps] == [2, 2]
    assert all(d["strategy"] == "MultiGPUStrategy" and d["choice"].mode == "ddp" for d in dumps)
    assert "DistributedBatchNorm" in dumps[0]["layer_classes_during_fit"]
    assert dumps[0]["params"]["net.0.weight"].shape[0] == 16  # hidden came from ${data.batch_size}
    for name, value in dumps[0]["params"].items():
        assert torch.equal(value, dumps[1]["params"][name]), name
