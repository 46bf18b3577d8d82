"""``python -m lightning_mgpu plan`` and ``export``: a model's memory plan, and a sharded checkpoint made one file."""

import pytest

from lightning_mgpu.__main__ import main

MODEL = "tests.helpers.tiny_transformer:TinyTransformer"


def test_plan_prints_the_table_and_chooses_what_fits(capsys):
    assert main(["plan", "--model", MODEL, "--init-args", '{"dim": 256}', "--devices", "2", "--budget-mb", "30"]) == 0
    out = capsys.readouterr().out
    assert "memory plan for 2 process(es): budget 30.0 MB per device (memory_budget_mb)" in out
    # 4 blocks of 2 x 256 x 1024 weights: 8.1 MB of fp32 parameters, AdamW's state twice that
    assert "ddp                         8.1      8.1     16.2" in out
    assert out.rstrip().endswith("chosen: fsdp_full")


def test_plan_exits_1_when_nothing_fits(capsys):
    assert main(["plan", "--model", MODEL, "--devices", "2", "--budget-mb", "0.01"]) == 1
    assert "chosen: nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "tests.helpers.nothing:Model"], "cannot import 'Model' from 'tests.helpers.nothing'"),
        (["--model", MODEL, "--init-args", "[1]"], "--init-args must be a JSON object"),
        (["--model", "torch.nn:Linear", "--init-args", '{"in_features": 2, "out_features": 2}'], "train_dataloader"),
    ],
)
def test_plan_errors_name_the_problem(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_export_of_something_that_is_no_checkpoint_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path), str(tmp_path / "out.pt")])
    assert "neither a checkpoint file nor a torch distributed checkpoint folder" in capsys.readouterr().err
