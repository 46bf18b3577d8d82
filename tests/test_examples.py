"""The examples, run as a user runs them: real processes, no mocks."""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.models import load_rank_dumps
from tests.helpers.processes import LAUNCHER_VARIABLES, REPO, run_script

EXAMPLES = Path(REPO) / "examples"
pytestmark = pytest.mark.distributed


def summary_rows(output: str) -> dict[str, str]:
    """The main example's summary, as {row name: value}."""
    block = output.split("lightning_mgpu main example: summary", 1)[1]
    return {m.group(1): m.group(2) for m in re.finditer(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", block, re.MULTILINE)}


def test_main_example_shows_every_callback_at_work_on_two_cpu_processes(tmp_path):
    result = run_script(
        EXAMPLES / "train.py", "--max-epochs=1", "--samples=2048", f"--out={tmp_path}", timeout=170, cwd=tmp_path
    )
    assert result["rc"] == 0, result["output"][-3000:]
    rows = summary_rows(result["output"])
    assert rows["strategy"].startswith("MultiGPUStrategy -> ddp")
    assert rows["processes"] == "2"
    assert rows["skipped steps"] == "1 (NaNSkip)"  # the NaN loss injected on rank 1 at step 5
    assert rows["OOM recoveries"] == "1; micro-batch size 32 of 64 (OOMBackoff)"  # rank 1's limit of 48 samples
    assert re.fullmatch(r"host RSS \d+ MiB \(max over 2 ranks\)", rows["peak memory"]), rows["peak memory"]
    timeline, plot = map(Path, rows["memory timeline"].split(", "))  # the test extra installs matplotlib
    assert timeline.suffix == ".csv" and plot.suffix == ".png"
    assert timeline.is_file() and plot.is_file() and plot.is_relative_to(tmp_path)
    assert float(rows["validation"].split("val_acc ")[1].split(",")[0]) > 0.5
    # BatchNorm stays per process: OOMBackoff can run more micro-batches on one rank than on another
    assert "sync_batchnorm='auto' leaves BatchNorm per process: OOMBackoff" in result["output"]


def test_main_example_without_faults_skips_nothing_and_never_backs_off(tmp_path):
    result = run_script(
        EXAMPLES / "train.py",
        "--max-epochs=1",
        "--samples=1024",
        "--no-faults",
        f"--out={tmp_path}",
        timeout=170,
        cwd=tmp_path,
    )
    assert result["rc"] == 0, result["output"][-3000:]
    rows = summary_rows(result["output"])
    assert rows["skipped steps"] == "0 (NaNSkip)"
    assert rows["OOM recoveries"] == "0; micro-batch size 64 of 64 (OOMBackoff)"


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
  class_path: blobs.BlobClassifier
  init_args:
    hidden: ${{data.init_args.batch_size}}
data:
  class_path: blobs.SyntheticBlobs
  init_args:
    batch_size: 16
"""
    )
    result = run_script(EXAMPLES / "cli.py", "fit", "--config", config, timeout=150, cwd=tmp_path)
    assert result["rc"] == 0, result["output"][-3000:]

    dumps = load_rank_dumps(tmp_path)
    assert [d["global_step"] for d in dumps] == [2, 2]
    assert all(d["strategy"] == "MultiGPUStrategy" and d["choice"].mode == "ddp" for d in dumps)
    assert "DistributedBatchNorm" in dumps[0]["layer_classes_during_fit"]
    assert dumps[0]["params"]["net.0.weight"].shape[0] == 16  # hidden came from ${data.init_args.batch_size}
    for name, value in dumps[0]["params"].items():
        assert torch.equal(value, dumps[1]["params"][name]), name


def test_torchmetrics_example_synced_accuracy_equals_one_process_over_the_whole_validation_set(tmp_path):
    result = run_script(EXAMPLES / "synced_metrics.py", "--max-epochs=1", timeout=150, cwd=tmp_path)
    assert result["rc"] == 0, result["output"][-3000:]
    synced = float(re.search(r"val/accuracy synced over 2 ranks: ([\d.]+)", result["output"]).group(1))
    reference = re.search(r"val/accuracy in one process over all (\d+) samples: ([\d.]+)", result["output"])
    assert reference.group(1) == "410"  # each rank validated 205 of them
    assert synced == pytest.approx(float(reference.group(2)), abs=1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_recipe_runs_two_nodes_over_loopback_with_identical_parameters_on_all_four_processes(tmp_path):
    """examples/multinode/torchrun.sh, once per "node" (2 nodes x 2 processes = 4 gloo processes on this machine)."""
    import os

    dump = f'{{"class_path": "tests.helpers.models.RankStateDump", "init_args": {{"directory": "{tmp_path}"}}}}'
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(
        PYTHONPATH=REPO,
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        NNODES="2",
        NPROC_PER_NODE="2",
        CONFIG="cpu",
    )
    nodes = [
        subprocess.Popen(
            [
                "bash",
                str(EXAMPLES / "multinode" / "torchrun.sh"),
                "--trainer.max_steps=3",
                f"--trainer.default_root_dir={tmp_path}",
                f"--trainer.callbacks+={dump}",
            ],
            env={**env, "NODE_RANK": str(node)},
            cwd=tmp_path,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=170)[0].decode(errors="replace"))
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]

    dumps = load_rank_dumps(tmp_path, world_size=4)
    assert [d["rank"] for d in dumps] == [0, 1, 2, 3]
    assert all(d["world_size"] == 4 and d["global_step"] == 3 for d in dumps)
    assert all(d["choice"].mode == "ddp" and "num_nodes=2" in d["choice"].reason for d in dumps)
    for other in dumps[1:]:
        for name, value in dumps[0]["params"].items():
            assert torch.equal(value, other["params"][name]), (other["rank"], name)
