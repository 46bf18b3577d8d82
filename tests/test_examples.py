"""The examples, run as a user runs them: real processes, no mocks."""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_mgpu.configs import config_path
from tests.helpers.models import load_rank_dumps
from tests.helpers.processes import LAUNCHER_VARIABLES, REPO, run_script

EXAMPLES = Path(REPO) / "examples"
pytestmark = pytest.mark.distributed


# what the examples may print when the output is not a terminal: tqdm's bar alone wrote 15 KB for the run below
MAX_OUTPUT_BYTES = 8000
CLI_SUMMARY = "lightning_mgpu CLI example: summary"


def summary_rows(output: str, title: str = "lightning_mgpu main example: summary") -> dict[str, str]:
    """An example's summary, as {row name: value}."""
    block = output.split(title, 1)[1]
    return {m.group(1): m.group(2) for m in re.finditer(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", block, re.MULTILINE)}


def epoch_lines(output: str) -> list[str]:
    """The epochs of the one-line-per-epoch display (examples/progress.py), in order."""
    return re.findall(r"^epoch (\d+): step \d+, ", output, re.MULTILINE)


@pytest.fixture(scope="module")
def main_example(tmp_path_factory) -> tuple[str, Path]:
    """``python examples/train.py`` for 2 short epochs, its output captured (not a terminal): (output, out dir)."""
    out = tmp_path_factory.mktemp("main_example")
    result = run_script(EXAMPLES / "train.py", "--max-epochs=2", "--samples=2048", f"--out={out}", timeout=170, cwd=out)
    assert result["rc"] == 0, result["output"][-3000:]
    return result["output"], out


def test_main_example_shows_every_callback_at_work_on_two_cpu_processes(main_example):
    output, out = main_example
    rows = summary_rows(output)
    assert rows["strategy"].startswith("MultiGPUStrategy -> ddp")
    assert rows["processes"] == "2"
    assert rows["skipped steps"] == "1 (NaNSkip)"  # the NaN loss injected on rank 1 at step 5
    assert rows["OOM recoveries"] == "1; micro-batch size 32 of 64 (OOMBackoff)"  # rank 1's limit of 48 samples
    assert re.fullmatch(r"host RSS \d+ MiB \(max over 2 ranks\)", rows["peak memory"]), rows["peak memory"]
    timeline, plot = map(Path, rows["memory timeline"].split(", "))  # the test extra installs matplotlib
    assert timeline.suffix == ".csv" and plot.suffix == ".png"
    assert timeline.is_file() and plot.is_file() and plot.is_relative_to(out)
    assert float(rows["validation"].split("val_acc ")[1].split(",")[0]) > 0.5
    assert re.fullmatch(r"\d+\.\d s", rows["time"]), rows["time"]
    # BatchNorm is synchronised: OOMBackoff replays a failed rank's part of the step and backs every rank off alike
    assert "sync_batchnorm='auto' synchronises BatchNorm statistics across 2 processes" in output


def test_main_example_says_that_its_faults_are_injected_on_purpose(main_example):
    output, _ = main_example
    nan_line = "injecting a NaN loss on rank 1 at step 5, on purpose: NaNSkip should skip this step on every rank"
    oom_line = (
        "injecting an out-of-memory error on rank 1 at step 10 (a batch of 64 samples, the rank holds 48), "
        "on purpose: OOMBackoff should re-run the batch as micro-batches"
    )
    # once: the NaN step's non-finite gradients are told from OOMBackoff's failure flag, so it is not run again
    assert output.count(nan_line) == 1 and output.count(oom_line) == 1, output[-3000:]
    assert output.index(nan_line) < output.index(oom_line) < output.index("lightning_mgpu main example: summary")
    assert summary_rows(output)["injected faults"] == (
        "on purpose, on rank 1: a NaN loss at step 5 and an OOM from step 10 (batches over 48); "
        "--no-faults removes them"
    )


def test_main_example_prints_one_line_per_epoch_when_its_output_is_not_a_terminal(main_example):
    output, _ = main_example
    assert epoch_lines(output) == ["0", "1"], output[-3000:]
    # 1843 training samples, 64 per batch on each of 2 ranks: 15 optimizer steps per epoch
    epoch_1 = re.search(r"^epoch 1: step 30, (.+) \(\d+\.\d s\)$", output, re.MULTILINE)
    assert epoch_1, output[-3000:]
    fields = dict(field.split(" ", 1) for field in epoch_1.group(1).split(", "))
    assert fields.keys() >= {"train_loss", "val_acc", "grad_norm", "peak_mem_mb"}, epoch_1.group(0)
    assert (fields["skipped"], fields["micro_bs"]) == ("1", "32"), epoch_1.group(0)  # the progress bar's fields
    assert "it/s]" not in output  # no tqdm bar
    assert len(output.encode()) < MAX_OUTPUT_BYTES, f"{len(output.encode())} bytes:\n{output[-3000:]}"


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
    assert rows["injected faults"] == "none (--no-faults)"
    assert "injecting" not in result["output"]


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
    # the summary names what this config left out
    rows = summary_rows(result["output"], CLI_SUMMARY)
    assert rows["strategy"].startswith("MultiGPUStrategy -> ddp") and rows["processes"] == "2"
    assert rows["skipped steps"] == "NaNSkip not in the callbacks"
    assert rows["OOM recoveries"] == "OOMBackoff not in the callbacks"


def test_cli_example_with_the_cpu_config_ends_with_a_summary_and_prints_one_line_per_epoch(tmp_path):
    result = run_script(
        EXAMPLES / "cli.py",
        "fit",
        "--config",
        config_path("cpu"),
        "--config",
        EXAMPLES / "configs" / "blobs.yaml",
        "--trainer.max_epochs=2",
        "--data.init_args.num_samples=2048",
        "--trainer.log_every_n_steps=10",  # 30 steps: the config keeps Lightning's 50, the monitor would log none
        f"--trainer.default_root_dir={tmp_path}",
        timeout=170,
        cwd=tmp_path,
    )
    output = result["output"]
    assert result["rc"] == 0, output[-3000:]
    rows = summary_rows(output, CLI_SUMMARY)
    assert rows["strategy"].startswith("MultiGPUStrategy -> ddp (2 cpu devices") and rows["processes"] == "2"
    assert rows["skipped steps"] == "0 (NaNSkip)"
    assert rows["OOM recoveries"] == "0; micro-batch size 64 of 64 (OOMBackoff)"  # global_batch_size 128 over 2
    assert re.fullmatch(r"host RSS \d+ MiB \(max over 2 ranks\)", rows["peak memory"]), rows["peak memory"]
    assert float(rows["validation"].split("val_acc ")[1].split(",")[0]) > 0.5
    assert re.fullmatch(r"\d+\.\d s", rows["time"]), rows["time"]
    assert epoch_lines(output) == ["0", "1"], output[-3000:]
    assert "it/s]" not in output
    assert len(output.encode()) < MAX_OUTPUT_BYTES, f"{len(output.encode())} bytes:\n{output[-3000:]}"


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
