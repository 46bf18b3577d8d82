import pytest

from lightning_mgpu.core.strategy_choice import LaunchContext, choose_strategy, force_mode


@pytest.mark.parametrize(
    ("context", "mode"),
    [
        # launched from outside: DDP joins the processes, whatever the device count
        (LaunchContext("cuda", 1, external_launcher="TorchElasticEnvironment", external_world_size=4), "ddp"),
        (LaunchContext("cpu", 1, external_launcher="SLURMEnvironment", external_world_size=2), "ddp"),
        (LaunchContext("cuda", 2, external_launcher="LightningEnvironment"), "ddp"),
        (LaunchContext("cuda", 1, external_launcher="TorchElasticEnvironment", external_world_size=1), "single"),
        # several nodes
        (LaunchContext("cuda", 1, num_nodes=2), "ddp"),
        (LaunchContext("cpu", 4, num_nodes=3, interactive=True, cuda_initialized=True), "ddp"),
        # one device
        (LaunchContext("cuda", 1), "single"),
        (LaunchContext("cpu", 1, interactive=True), "single"),
        (LaunchContext("cuda", 1, interactive=True, cuda_initialized=True), "single"),
        # several devices from a script
        (LaunchContext("cuda", 4), "ddp"),
        (LaunchContext("cuda", 2, cuda_initialized=True), "ddp"),
        (LaunchContext("cpu", 2), "ddp"),
        # several devices, interactive
        (LaunchContext("cuda", 2, interactive=True), "ddp_fork"),
        (LaunchContext("cuda", 2, interactive=True, cuda_initialized=True), "dp"),
        (LaunchContext("cuda", 8, interactive=True, fork_available=False), "dp"),
        (LaunchContext("cpu", 2, interactive=True), "ddp_fork"),
        (LaunchContext("cpu", 2, interactive=True, fork_available=False), "ddp_spawn"),
        (LaunchContext("cpu", 2, interactive=True, cuda_initialized=True), "ddp_fork"),
    ],
)
def test_decision_table(context, mode):
    choice = choose_strategy(context)
    assert choice.mode == mode
    assert choice.reason  # every choice explains itself


def test_reasons_name_what_decided():
    assert "torchrun" not in choose_strategy(LaunchContext("cuda", 2)).reason
    assert (
        "TorchElasticEnvironment"
        in choose_strategy(
            LaunchContext("cuda", 1, external_launcher="TorchElasticEnvironment", external_world_size=2)
        ).reason
    )
    notebook = LaunchContext("cuda", 2, interactive=True, cuda_initialized=True)
    assert "already initialised" in choose_strategy(notebook).reason
    assert "num_nodes=2" in choose_strategy(LaunchContext("cuda", 1, num_nodes=2)).reason


def test_forced_modes_are_validated():
    assert force_mode("ddp", LaunchContext("cpu", 2)).mode == "ddp"
    assert force_mode("dp", LaunchContext("cuda", 1)).mode == "dp"
    with pytest.raises(ValueError, match=r"mode='dp'.*'cpu'"):
        force_mode("dp", LaunchContext("cpu", 2))
    with pytest.raises(ValueError, match=r"mode='single'.*2 device"):
        force_mode("single", LaunchContext("cpu", 2))
    with pytest.raises(ValueError, match="fork"):
        force_mode("ddp_fork", LaunchContext("cpu", 2, fork_available=False))
