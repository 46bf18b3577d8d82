"""DDP's unused-parameter error under our strategy points at our own option, not at a stock strategy name."""

import pytest

from tests.long_runs.test_preemption import run_fit


@pytest.mark.distributed
def test_unused_parameter_error_names_our_option_on_every_rank(tmp_path):
    result = run_fit(tmp_path, "mgpu", "--steps", 4, "--unused-parameter", timeout=90)
    assert not result["hung"] and result["rc"] != 0, result["output"][-3000:]
    assert set(result["records"]) == {0, 1}, result["output"][-3000:]
    for record in result["records"].values():
        message = record["raised"]
        assert record["exception"] == "RuntimeError"
        assert "`MultiGPUStrategy(find_unused_parameters=True)`" in message
        assert "init_args: {find_unused_parameters: true}" in message
        assert "class_path: lightning_mgpu.MultiGPUStrategy" in message
        # Lightning's hint would swap the strategy for its own DDP and drop the pack
        assert "ddp_find_unused_parameters_true" not in message
        # DDP's own explanation (which parameters, how to find them) is kept
        assert "Expected to have finished reduction in the prior iteration" in message
        assert record["completed"] == 1  # the second step's forward is where DDP notices
