"""The step service: one verdict and one set of norms per optimizer step, the piece share, and who holds the service."""

import gc

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy as LightningSingleDeviceStrategy

from lightning_mgpu.core.step_service import HoldsStepService, StepService, step_service


def _optimizer_with_grads(*grads: list[float]) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    params = [torch.nn.Parameter(torch.zeros(len(g))) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = torch.tensor(grad)
    return torch.optim.SGD(params, lr=0.1), params


def test_the_verdict_is_taken_once_per_step_and_again_after_new_gradients():
    service = StepService()
    optimizer, params = _optimizer_with_grads([1.0, float("nan")])
    calls = []

    def decide(opt, ps, step):
        calls.append(step)
        return torch.tensor(any(not torch.isfinite(p.grad).all() for p in ps))

    assert service.step_is_bad(optimizer, params, 0) is None  # nobody decides yet
    service.decide_steps(optimizer, decide)
    first = service.step_is_bad(optimizer, params, 3)
    assert bool(first) and service.step_is_bad(optimizer, params, 3) is first and calls == [3]
    service.step_is_bad(optimizer, params, 4)  # another step, another decision
    service.new_gradients()
    service.step_is_bad(optimizer, params, 4)
    assert calls == [3, 4, 4]
    service.stop_deciding(optimizer, lambda *a: torch.tensor(False))  # not the registered one: kept
    assert service.step_is_bad(optimizer, params, 4) is not None
    service.stop_deciding(optimizer, decide)
    assert service.step_is_bad(optimizer, params, 5) is None


def test_gradient_norms_are_computed_once_per_step_for_the_same_parameters():
    service = StepService()
    optimizer, params = _optimizer_with_grads([3.0, 4.0], [1.0])
    norms = service.gradient_norms(optimizer, params, 7)
    assert norms.tolist() == [5.0, 1.0] and norms.dtype == torch.float32
    params[0].grad.mul_(2.0)  # scaled in between, as clipping does: the step's norms stay the ones first read
    assert service.gradient_norms(optimizer, params, 7) is norms
    assert service.gradient_norms(optimizer, params[:1], 7).tolist() == [10.0]  # other parameters: computed anew
    service.new_gradients()
    assert service.gradient_norms(optimizer, params, 7).tolist() == [10.0, 1.0]


def test_the_piece_share_is_one_outside_pieces_and_nests():
    service = StepService()
    assert service.piece_share == 1.0
    with service.in_piece(0.25):
        assert service.piece_share == 0.25
        with service.in_piece(0.5):
            assert service.piece_share == 0.5
        assert service.piece_share == 0.25
    with pytest.raises(RuntimeError), service.in_piece(0.75):
        raise RuntimeError("an OOM in the piece's backward")
    assert service.piece_share == 1.0


def test_flag_requests_are_released_once_dropped():
    released = []

    class Flag:
        process_group = None

        def release(self):
            released.append(self)

    service = StepService(reads_requests=True)
    flag = Flag()
    service.carry_flag(flag)
    service.flag_carried = True  # the strategy's note at its wrap
    service.carry_flag(flag)  # asked again: not carried until the next wrap
    assert service.flag is flag and not service.flag_carried
    service.drop_flag()
    service.drop_flag()
    assert released == [flag] and service.flag is None


def test_the_optimizers_of_a_finished_fit_are_not_kept_alive():
    service = StepService()
    optimizer, params = _optimizer_with_grads([1.0])
    service.decide_steps(optimizer, lambda o, p, s: torch.tensor(False))
    service.step_is_bad(optimizer, params, 0)
    service.gradient_norms(optimizer, params, 0)
    del optimizer, params
    gc.collect()
    assert len(service._deciders) == len(service._verdicts) == len(service._norms) == 0


def test_a_pack_strategy_serves_its_own_and_any_other_strategy_gets_one_of_its_own():
    class Holding(HoldsStepService, LightningSingleDeviceStrategy):
        def __init__(self):
            super().__init__(device=torch.device("cpu"))
            self.service = StepService(reads_requests=True)

        @property
        def step_service(self):
            return self.service

    holding = pl.Trainer(strategy=Holding(), logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert step_service(holding) is holding.strategy.service
    one = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    other = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert step_service(one) is step_service(one) and step_service(one) is not step_service(other)
    assert not step_service(one).reads_requests  # Lightning's strategies read no reduction request
