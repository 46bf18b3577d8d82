"""Exact mid-epoch resume and automatic restart: a killed 2-process fit resumed ends bit-identical to one never killed.

The fit (tests/helpers/resume_fit.py) has dropout, draws from torch, numpy and Python's ``random`` (seeded per rank),
shuffles its 40 samples with the DistributedSampler Lightning injects (10 batches a rank per epoch), and checkpoints
every 15 optimizer steps: step 15 lies in the middle of the second epoch.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from packaging.version import Version
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, TensorDataset

import lightning_mgpu  # noqa: F401  (registers strategy="mgpu")
from lightning_mgpu.long_runs.preemption import SIGTERM_EXIT_CODE
from lightning_mgpu.long_runs.slurm import slurm_job_id
from tests.helpers.processes import LAUNCHER_VARIABLES, REPO, find_free_port, run_script

SCRIPT = Path(REPO) / "tests" / "helpers" / "resume_fit.py"
# Lightning 2.5's ModelCheckpoint(save_last=True) also writes last.ckpt at the epoch's end (step 20 here), and 2.5's
# own resume from an epoch-end checkpoint changes the next epoch's order from its second batch on: stock Lightning
# 2.5.6 and the pack were measured identical there. The mid-epoch cases below are claimed on 2.6.
needs_lightning_2_6 = pytest.mark.skipif(
    Version(lightning.__version__) < Version("2.6"),
    reason="Lightning 2.5 resumes last.ckpt from the epoch's end, where its own order differs (stock measured alike)",
)
CHECKPOINT_STEP, KILL_STEP, MAX_STEPS = 15, 22, 30
JOB_ID = "4242"  # the faked SLURM job's
# SIGUSR1 during batch 23 (step 22 done): rank 1 publishes at batch 24 a stop at the first store read (every 4th batch)
# at least one batch later, batch 28, so both ranks train 27 steps
REQUEUE_STOP_STEP = 27


def fit(out: Path, *args: object, expect_ok: bool = True) -> dict:
    result = run_script(SCRIPT, "--out", out, *args, timeout=120)
    assert not result["hung"], result["output"][-3000:]
    if expect_ok:
        assert result["rc"] == 0, result["output"][-3000:]
    return result


def seen_by_step(out: Path, rank: int) -> dict[int, list[list[int]]]:
    """Each optimizer step's sample indices on ``rank``, in the order the attempts trained them."""
    steps: dict[int, list[list[int]]] = {}
    for line in (out / f"seen_rank{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], []).append(row["indices"])
    return steps


def as_trained(out: Path, rank: int) -> dict[int, list[int]]:
    """The batches that made the final model: the first attempt's up to the checkpoint, the resumed ones after."""
    return {
        step: (tries[0] if step <= CHECKPOINT_STEP else tries[-1]) for step, tries in seen_by_step(out, rank).items()
    }


def result(out: Path) -> dict:
    return torch.load(out / "result.pt", weights_only=False)


def assert_bit_identical(a: dict, b: dict) -> None:
    """Two runs ended with the same parameters on every rank and the same optimizer state on rank 0."""
    for rank_a, rank_b in zip(a["parameters"], b["parameters"], strict=True):
        for name in rank_a:
            assert torch.equal(rank_a[name], rank_b[name]), name
    assert_same_optimizer_state(a["optimizer"]["state"], b["optimizer"]["state"])


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a and a.keys() == b.keys()  # an empty state would compare nothing
    for index, state in a.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], b[index][key]), (index, key)


def assert_ranks_agree(record: dict) -> None:
    """Every rank of one run ended with rank 0's parameters and optimizer state (DDP keeps the replicas alike)."""
    (params0, params1), (state0, state1) = record["parameters"], record["optimizers"]
    assert params0.keys() == params1.keys()
    for name in params0:
        assert torch.equal(params0[name], params1[name]), name
    assert_same_optimizer_state(state0, state1)


def max_difference(a: dict, b: dict) -> float:
    return max((a["parameters"][0][n] - b["parameters"][0][n]).abs().max().item() for n in a["parameters"][0])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    fit(out)
    return out


@needs_lightning_2_6
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_killed_rank_resumes_bit_identical_and_stock_lightning_does_not(uninterrupted, tmp_path):
    reference = result(uninterrupted)
    assert reference["step"] == MAX_STEPS
    assert_ranks_agree(reference)

    killed = tmp_path / "mgpu"
    crashed = fit(killed, "--kill-rank", 1, "--kill-step", KILL_STEP, expect_ok=False)
    assert crashed["rc"] != 0
    assert sorted(os.listdir(killed / "ckpt")) == [f"epoch=1-step={CHECKPOINT_STEP}.ckpt", "last.ckpt"]
    assert max(seen_by_step(killed, 1)) == KILL_STEP  # rank 1 trained up to the kill
    fit(killed, "--resume")

    resumed = result(killed)
    assert resumed["step"] == MAX_STEPS
    assert_bit_identical(reference, resumed)
    for rank in (0, 1):
        assert as_trained(killed, rank) == as_trained(uninterrupted, rank)
        # the resumed attempt started at the step after the checkpoint; rank 0 had begun step 23 when rank 1 died
        retrained = [s for s, tries in seen_by_step(killed, rank).items() if len(tries) > 1]
        assert retrained == list(range(CHECKPOINT_STEP + 1, KILL_STEP + 1 + (rank == 0)))

    # stock Lightning in the same case: the interrupted epoch starts over from its first batch. Uninterrupted, stock
    # trains bit-identically to the pack (measured when this test was written; the suite no longer re-runs it)
    stock = tmp_path / "stock"
    fit(stock, "--strategy", "ddp", "--kill-rank", 1, "--kill-step", KILL_STEP, expect_ok=False)
    fit(stock, "--strategy", "ddp", "--resume")
    stock_seen, expected = as_trained(stock, 0), as_trained(uninterrupted, 0)
    # step 16 trains the epoch's first batch again (steps 11-15 trained batches 0-4 of the epoch)
    assert stock_seen[CHECKPOINT_STEP + 1] == expected[CHECKPOINT_STEP - 4]
    assert stock_seen != expected
    assert max_difference(reference, result(stock)) > 1e-3


def batches_in_order(out: Path, rank: int) -> list[tuple[int, list[int]]]:
    """Every training batch ``rank`` ran, over all attempts, in order: (optimizer step, sample indices)."""
    rows = [json.loads(line) for line in (out / f"seen_rank{rank}.jsonl").read_text().splitlines()]
    return [(row["step"], row["indices"]) for row in rows]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sigterm_checkpoint_under_accumulation_resumes_bit_identical_with_no_batch_trained_twice(tmp_path):
    # 3 batches an optimizer step: the agreed stop is moved to the end of the step in progress, so the checkpoint
    # holds no half-accumulated gradient (a stop one batch into a window resumed 0.006 away before that)
    reference, stopped_run = tmp_path / "reference", tmp_path / "stopped"
    fit(reference, "--accumulate", 3)
    # SIGTERM in batch 51 (step 20's first): the agreed batch, 56, falls one batch into step 22's window
    stopped = fit(stopped_run, "--accumulate", 3, "--kill-rank", 1, "--kill-step", 20, "--sigterm", expect_ok=False)
    assert stopped["rc"] == SIGTERM_EXIT_CODE  # not 0, as Lightning's own SIGTERMException would exit
    checkpoint = torch.load(stopped_run / "ckpt" / "on_exception.ckpt", weights_only=False)
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    assert progress % 3 == 0  # saved where an optimizer step ended
    fit(stopped_run, "--accumulate", 3, "--resume", "--sigterm")  # "last" picks on_exception.ckpt, the newest
    assert_bit_identical(result(reference), result(stopped_run))
    for rank in (0, 1):  # every batch once, in the uninterrupted order
        assert batches_in_order(stopped_run, rank) == batches_in_order(reference, rank)


@needs_lightning_2_6
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun_restarts_a_killed_rank_and_the_run_completes_bit_identical(uninterrupted, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    # the README's recipe: torch 2.13's agent store otherwise hands a restarted gloo group the last attempt's keys
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        str(SCRIPT), "--out", str(tmp_path), "--resume", "--kill-once", "--kill-rank", "1",
        "--kill-step", str(KILL_STEP),
    ]  # fmt: skip
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "exitcode: -9" in output  # the first attempt lost rank 1 to SIGKILL, and torchrun restarted both
    assert_bit_identical(result(uninterrupted), result(tmp_path))
    for rank in (0, 1):
        assert as_trained(tmp_path, rank) == as_trained(uninterrupted, rank)


@needs_lightning_2_6
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_fsdp_killed_rank_resumes_bit_identical_from_its_sharded_checkpoint(tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    fit(reference, "--strategy", "fsdp")
    crashed = fit(killed, "--strategy", "fsdp", "--kill-rank", 1, "--kill-step", KILL_STEP, expect_ok=False)
    assert crashed["rc"] != 0
    assert (killed / "ckpt" / "last.ckpt" / "meta.pt").is_file()  # a folder of shards; the resume state is in here
    fit(killed, "--strategy", "fsdp", "--resume")
    assert_bit_identical(result(reference), result(killed))
    for rank in (0, 1):
        assert as_trained(killed, rank) == as_trained(reference, rank)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
@pytest.mark.timeout(200)
def test_a_sharded_fit_leaves_no_gloo_thread_to_the_interpreters_teardown(tmp_path):
    # DTensor's caches keep the device mesh, and the mesh its process groups, past destroy_process_group: their gloo
    # threads then met the interpreter's teardown, where one of them now and then aborted the process (exit -6 after
    # the fit; the resume test above, once in two CI runs). Measured before the fix: 4 run loops and 2 TCP loops left
    fit(tmp_path, "--strategy", "fsdp", "--max-steps", 2, "--every", 100, "--record-exit-threads")
    records = sorted(tmp_path.glob("exit_threads_*.json"))
    assert len(records) == 2  # both ranks' processes
    for record in records:
        names = json.loads(record.read_text())
        assert not [name for name in names if "gloo" in name], (record.name, names)


# ---------------------------------------------------------------------------------------------- SLURM's requeue
# No SLURM here: the tests start both ranks themselves with the variables ``srun`` sets (Lightning's SLURMEnvironment
# then launches nothing) and put a fake ``scontrol`` on PATH that records its arguments. Rank 1 alone gets SIGUSR1
# (SLURM's requeue signal) at step 22, as when SLURM's ``--signal`` reaches the ranks at different moments.
def slurm_fit(
    out: Path, bin_dir: Path, *args: object, restarts: int = 0, timeout: float = 120, grace: float | None = None
) -> list[dict]:
    """Start the 2 ranks as ``srun --ntasks-per-node 2`` would; returns each rank's status and output.

    Ranks still running after ``timeout`` seconds, or ``grace`` seconds after rank 1 trained step ``KILL_STEP`` (the
    signal comes with its next batch), are killed and returned with ``hung`` set.
    """
    port = find_free_port()
    processes = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
        env.update(
            PYTHONPATH=REPO, OMP_NUM_THREADS="1", PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
            SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="resume_fit", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
            SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
            SLURM_NODELIST="localhost", SLURM_RESTART_COUNT=str(restarts), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )  # fmt: skip
        command = [sys.executable, str(SCRIPT), "--out", str(out), *map(str, args)]
        processes.append(
            subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    deadline, outcomes = time.monotonic() + timeout, []
    if grace is not None:
        seen, marker = out / "seen_rank1.jsonl", f'"step": {KILL_STEP},'
        while time.monotonic() < deadline and marker not in (seen.read_text() if seen.exists() else ""):
            time.sleep(0.2)
        deadline = min(deadline, time.monotonic() + grace)
    for process in processes:
        try:
            output, _ = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            hung = True
        outcomes.append({"rc": process.returncode, "hung": hung, "output": output.decode(errors="replace")})
    return outcomes


@pytest.fixture
def fake_scontrol(tmp_path) -> tuple[Path, Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls.txt"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    return bin_dir, calls


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_requeue_signal_saves_at_one_agreed_batch_requeues_and_the_requeued_job_resumes_bit_identical(
    uninterrupted, fake_scontrol, tmp_path
):
    bin_dir, calls = fake_scontrol
    out = tmp_path / "run"
    stopped = slurm_fit(out, bin_dir, "--kill-rank", 1, "--kill-step", KILL_STEP, "--requeue-signal")
    for rank, outcome in enumerate(stopped):
        assert not outcome["hung"] and outcome["rc"] == SIGTERM_EXIT_CODE, (rank, outcome["output"][-3000:])
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"]  # rank 0 requeued, once
    assert (out / "hpc_ckpt_1.ckpt").exists()
    checkpoint = torch.load(out / "hpc_ckpt_1.ckpt", weights_only=False)
    assert checkpoint["global_step"] == REQUEUE_STOP_STEP  # saved at the agreed batch boundary, not mid-step
    for rank in (0, 1):
        assert max(seen_by_step(out, rank)) == REQUEUE_STOP_STEP  # both ranks stopped there

    # the requeued job: SLURM runs the same script, Lightning's fit(ckpt_path=None) loads hpc_ckpt_1.ckpt
    resumed = slurm_fit(out, bin_dir, restarts=1)
    for rank, outcome in enumerate(resumed):
        assert not outcome["hung"] and outcome["rc"] == 0, (rank, outcome["output"][-3000:])
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"]
    assert_bit_identical(result(uninterrupted), result(out))
    for rank in (0, 1):
        steps = seen_by_step(out, rank)
        assert all(len(tries) == 1 for tries in steps.values())  # no step trained twice, none left out
        assert {step: tries[0] for step, tries in steps.items()} == {
            step: tries[0] for step, tries in seen_by_step(uninterrupted, rank).items()
        }

    # stock Lightning in the same case: rank 1's handler saves from inside its step (only rank 0 writes and requeues);
    # its save's collectives meet rank 0's training collectives. Measured: both ranks wait there, for the process
    # group's timeout (30 minutes by default); killed here 8 s after the signal
    stock = tmp_path / "stock"
    outcomes = slurm_fit(
        stock, bin_dir, "--strategy", "ddp", "--kill-rank", 1, "--kill-step", KILL_STEP, "--requeue-signal", grace=8
    )
    assert max(seen_by_step(stock, 1)) == KILL_STEP  # rank 1 got the signal (and trained no further)
    assert all(outcome["hung"] or outcome["rc"] != 0 for outcome in outcomes)  # it never completes
    assert not list(stock.glob("hpc_ckpt_*.ckpt"))  # nothing saved
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"]  # and not requeued


def test_the_job_id_is_the_array_task_inside_a_job_array(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert slurm_job_id() == "77"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm_job_id() == "70_3"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70; rm -rf /")
    assert slurm_job_id() is None


class DropoutRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen.append(index.tolist())
        return torch.nn.functional.mse_loss(self.net(x + torch.randn_like(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def one_device_trainer(root: Path, max_steps: int, every: int, strategy: str = "mgpu") -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def one_process_fit(root: Path, max_steps: int, ckpt_path: str | None = None, **loader_options) -> DropoutRegression:
    torch.manual_seed(0)
    model = DropoutRegression()
    data = TensorDataset(torch.arange(30), torch.randn(30, 4), torch.randn(30, 1))
    loader = DataLoader(data, batch_size=4, shuffle=True, **loader_options)
    trainer = one_device_trainer(root, max_steps, every=7)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    assert type(loader.batch_sampler) is BatchSampler  # the pack resumed a copy: the user's loader is untouched
    return model


@pytest.mark.timeout(120)
def test_one_process_resumes_a_random_sampler_mid_epoch_bit_identical(tmp_path):
    reference = one_process_fit(tmp_path / "reference", max_steps=20)
    interrupted = one_process_fit(tmp_path / "interrupted", max_steps=11)  # checkpoints at step 7: epoch 0, batch 7
    torch.manual_seed(123)  # a new process's other streams
    resumed = one_process_fit(tmp_path / "resumed", 20, str(tmp_path / "interrupted" / "epoch=0-step=7.ckpt"))
    assert interrupted.seen[:7] + resumed.seen == reference.seen
    for name, parameter in reference.named_parameters():
        assert torch.equal(parameter, dict(resumed.named_parameters())[name]), name
    # the interrupted epoch's last batch (7 full batches and one of 2 samples) is not trained twice
    assert [len(batch) for batch in resumed.seen[:1]] == [2]


@pytest.mark.timeout(120)
def test_an_iterable_dataset_resumed_mid_epoch_says_once_why_it_starts_over(tmp_path):
    class Stream(IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(0)
            for i in range(30):
                yield torch.tensor(i), torch.randn(4, generator=generator), torch.randn(1, generator=generator)

    def fit(max_steps, ckpt_path=None):
        trainer = one_device_trainer(tmp_path, max_steps, every=3)
        trainer.fit(DropoutRegression(), DataLoader(Stream(), batch_size=4), ckpt_path=ckpt_path)

    fit(4)
    with pytest.warns(UserWarning) as record:
        fit(8, str(tmp_path / "epoch=0-step=3.ckpt"))
    ours = [str(w.message) for w in record if "cannot be resumed there" in str(w.message)]
    assert len(ours) == 1
    assert "taken 3 batches into epoch 0" in ours[0] and "IterableDataset (Stream)" in ours[0]
    assert "The epoch starts over from its first batch" in ours[0]


@pytest.mark.timeout(120)
def test_several_training_loaders_resumed_mid_epoch_say_why_they_start_over(tmp_path):
    class TwoLoaders(DropoutRegression):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch["a"], batch_idx) + super().training_step(batch["b"], batch_idx)

    def fit(max_steps, ckpt_path=None):
        torch.manual_seed(0)
        data = TensorDataset(torch.arange(30), torch.randn(30, 4), torch.randn(30, 1))
        loaders = {"a": DataLoader(data, batch_size=4, shuffle=True), "b": DataLoader(data, batch_size=6)}
        trainer = one_device_trainer(tmp_path, max_steps, every=3)
        trainer.fit(TwoLoaders(), loaders, ckpt_path=ckpt_path)

    fit(4)
    with pytest.warns(UserWarning, match="the fit has several training loaders") as record:
        fit(8, str(tmp_path / "epoch=0-step=3.ckpt"))
    assert len([w for w in record if "several training loaders" in str(w.message)]) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["mgpu", "auto"])
def test_a_stateful_dataloader_is_resumed_by_lightning_and_the_random_streams_by_the_pack(tmp_path, strategy):
    # torchdata's StatefulDataLoader: Lightning saves and restores its position; the pack adds the random streams
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

    def fit(root, max_steps, ckpt_path=None):
        torch.manual_seed(0)
        model = DropoutRegression()
        data = TensorDataset(torch.arange(30), torch.randn(30, 4), torch.randn(30, 1))
        loader = stateful_dataloader.StatefulDataLoader(data, batch_size=4, shuffle=True)
        trainer = one_device_trainer(root, max_steps, every=3, strategy=strategy)
        torch.manual_seed(123 if ckpt_path else 0)  # a resumed process's streams start elsewhere
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return model

    reference = fit(tmp_path / "reference", 12)
    interrupted = fit(tmp_path / "interrupted", 5)
    resumed = fit(tmp_path / "resumed", 12, str(tmp_path / "interrupted" / "epoch=0-step=3.ckpt"))
    assert interrupted.seen[:3] + resumed.seen == reference.seen  # Lightning resumed the loader, both ways
    same = all(torch.equal(a, b) for a, b in zip(reference.parameters(), resumed.parameters(), strict=True))
    assert same is (strategy == "mgpu")  # stock Lightning restores no random stream: the dropout masks differ
