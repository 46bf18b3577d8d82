"""After ``fit`` returns, ``save_checkpoint``, ``validate`` and ``test`` on the same Trainer, under each way the pack
starts processes, against stock Lightning in the same case (tests/helpers/after_fit.py, run as a script)."""

from pathlib import Path

import pytest
import torch

from tests.helpers.after_fit import Regression
from tests.helpers.processes import REPO, run_script

pytestmark = pytest.mark.distributed

SCRIPT = Path(REPO) / "tests" / "helpers" / "after_fit.py"


def after_fit(out: Path, strategy: str) -> dict:
    result = run_script(SCRIPT, "--out", out, "--strategy", strategy, timeout=150)
    assert not result["hung"] and result["rc"] == 0, result["output"][-3000:]
    return torch.load(out / "record.pt", weights_only=False)


@pytest.mark.parametrize(
    ("ours", "stock"),
    [("mgpu_ddp", "ddp"), ("mgpu_ddp_spawn", "ddp_spawn"), ("mgpu_ddp_fork", "ddp_fork")],
    ids=["popen", "spawn", "fork"],
)
def test_save_validate_and_test_after_fit_as_stock_lightning_does(tmp_path, ours, stock):
    pack, reference = after_fit(tmp_path / "pack", ours), after_fit(tmp_path / "stock", stock)
    assert reference["error"] is None, reference["error"]  # the case itself works on stock Lightning
    assert pack["error"] is None, pack["error"]
    assert pack["strategy"] == "MultiGPUStrategy" and reference["strategy"] == "DDPStrategy"
    saved, stock_saved = pack["checkpoint"], reference["checkpoint"]
    # the checkpoint holds the trained weights, as stock's does (both fits train alike)
    initial = dict(Regression().named_parameters())  # seeded: the weights both fits started from
    for name, param in pack["params"].items():
        assert not torch.equal(param, initial[name]), name  # trained, and (spawn, fork) brought back from rank 0
        assert torch.equal(saved["state_dict"][name], param), name
        torch.testing.assert_close(param, stock_saved["state_dict"][name], rtol=0, atol=1e-6)
    assert saved["global_step"] == stock_saved["global_step"]
    assert saved["loops"] == stock_saved["loops"]
    extra = set(saved) - set(stock_saved)
    assert set(stock_saved) <= set(saved)
    if ours == "mgpu_ddp":  # this process trained: the exact-resume state of its ranks goes in too
        assert extra == {"lightning_mgpu_exact_resume"}
    else:  # the main process trained in no worker: nothing of a fit's position to add
        assert extra == set()
    for stage in ("validate", "test"):
        (metrics,) = pack[stage]  # one loader
        assert metrics.keys() == {"val_loss" if stage == "validate" else "test_loss"}
        assert metrics == pytest.approx(reference[stage][0]), stage
