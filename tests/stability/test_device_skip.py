"""FusedRoute and MaskedStep on their own: the flags, the counters, a verdict left by a step that never ran."""

import torch

from lightning_mgpu.stability.device_skip import FusedRoute, MaskedStep, fused_kernel_can_skip, why_no_fused_route


def params_with_grads(value: float = 1.0) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2, 3))]
    for p in params:
        p.grad = torch.full_like(p, value)
    return params


def test_a_routed_adam_skips_through_found_inf_and_gives_the_users_settings_back():
    params = params_with_grads()
    optimizer = torch.optim.Adam(params, lr=0.1, foreach=True)
    assert why_no_fused_route(optimizer) is None
    route = FusedRoute(optimizer)
    for bad in (0.0, 1.0, 0.0):
        route.engage()
        optimizer.found_inf = torch.tensor(bad)
        before = [p.detach().clone() for p in params]
        optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True)) == bool(bad)
    assert (optimizer.param_groups[0]["foreach"], optimizer.param_groups[0]["fused"]) == (True, None)
    assert float(optimizer.state[params[0]]["step"]) == 2  # the skipped step did not count
    saved = optimizer.state_dict()
    assert saved["state"][0]["step"].device.type == "cpu"
    route.remove()
    assert optimizer.state[params[0]]["step"].device.type == "cpu"


def test_a_route_engaged_for_a_step_that_never_ran_is_released():
    optimizer = torch.optim.SGD(params_with_grads(), lr=0.1, momentum=0.9, foreach=True)
    route = FusedRoute(optimizer)
    route.engage()  # the step raised before its update: no post-hook
    assert optimizer.state_dict()["param_groups"][0]["fused"] is None  # a checkpoint taken now holds the user's
    route.release()
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    route.engage()
    route.release()
    assert [(g["foreach"], g["fused"]) for g in optimizer.param_groups] == [(True, None), (True, None)]


def test_sgd_groups_without_momentum_need_no_momentum_buffer():
    with_momentum, without = params_with_grads()
    optimizer = torch.optim.SGD(
        [{"params": [with_momentum], "momentum": 0.9}, {"params": [without], "momentum": 0.0}], lr=0.1
    )
    assert not fused_kernel_can_skip(optimizer, [with_momentum, without])  # no buffer before the first step
    optimizer.step()
    assert fused_kernel_can_skip(optimizer, [with_momentum, without])


def test_a_masked_step_is_undone_exactly_and_a_verdict_left_unused_is_forgotten():
    params = params_with_grads()
    optimizer = torch.optim.RMSprop(params, lr=0.1, momentum=0.5)
    optimizer.step()  # the state exists
    mask = MaskedStep(optimizer)
    assert mask.why_not(params, torch.device("cpu")) is None
    before = [p.detach().clone() for p in params]
    state_before = [t.clone() for t in optimizer.state[params[0]].values()]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    mask.arm(params, torch.tensor(True))
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state_before, optimizer.state[params[0]].values(), strict=True))
    # a bad verdict armed for a step that raised before running: forgotten, so the next good step is kept
    mask.arm(params, torch.tensor(True))
    mask.disarm()
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert not torch.equal(before[0], params[0])


def test_a_masked_step_reads_on_the_host_when_the_state_was_cleared():
    params = params_with_grads()
    optimizer = torch.optim.RMSprop(params, lr=0.1)
    optimizer.step()
    mask = MaskedStep(optimizer)
    assert mask.why_not(params, torch.device("cpu")) is None
    optimizer.state.clear()  # a reset or a reload during the fit: checked again every step
    assert mask.why_not(params, torch.device("cpu")) == "its state does not exist before its first step"
    optimizer.state[params[0]]["extra"] = 3
    assert "is a int, kept on the host" in mask.why_not(params[:1], torch.device("cpu"))
