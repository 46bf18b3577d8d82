"""The pack's one hook on Lightning's dispatch of a step: routes one trainer's evaluation steps, and is undone."""

from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer import call as trainer_call
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu.core import compat


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.steps: list[int] = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.steps.append(len(x))
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def val_dataloader(self):
        data = TensorDataset(torch.randn(12, 4), torch.randn(12, 1))
        return DataLoader(data, batch_size=4)


class _RouteInHalves(Callback):
    """Routes the validation steps and runs each batch as two halves, through Lightning's dispatch."""

    def __init__(self) -> None:
        self.undo = None
        self.routed: list[tuple[str, str | None]] = []

    def on_validation_start(self, trainer, pl_module):
        self.undo = compat.route_eval_steps(trainer, self.run_step)
        self.routes_during_the_loop = compat.eval_step_routes()

    def run_step(self, hook_name, step, batch, *args, **kwargs):
        self.routed.append((hook_name, self.module._current_fx_name))
        x, y = batch
        step((x[:2], y[:2]), *args, **kwargs)
        return step((x[2:], y[2:]), *args, **kwargs)

    def on_validation_end(self, trainer, pl_module):
        self.undo()


def test_a_trainers_evaluation_steps_are_routed_and_lightning_gets_its_dispatch_back():
    lightnings_own = trainer_call._call_strategy_hook
    model, routing = _Regression(), _RouteInHalves()
    routing.module = model
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[routing],
    )  # fmt: skip
    trainer.validate(model, verbose=False)
    assert routing.routed == [("validation_step", "validation_step")] * 3
    assert model.steps == [2, 2] * 3
    assert routing.routes_during_the_loop == 1
    assert trainer_call._call_strategy_hook is lightnings_own
    assert compat.eval_step_routes() == 0


def test_routes_undone_out_of_order_leave_lightnings_dispatch_alone(monkeypatch):
    calls = []

    def lightning_dispatch(trainer, hook_name, *args, **kwargs):
        calls.append(("lightning", trainer.name, hook_name))
        return hook_name

    monkeypatch.setattr(trainer_call, "_call_strategy_hook", lightning_dispatch)
    first, second = (SimpleNamespace(name=n, lightning_module=SimpleNamespace(_current_fx_name=None)) for n in "ab")

    def routed(hook_name, step, *args, **kwargs):
        calls.append(("routed", hook_name))
        return step(*args, **kwargs)

    undo_first = compat.route_eval_steps(first, routed)
    undo_second = compat.route_eval_steps(second, routed)
    undo_first()  # not outermost: it stays inside the second, passing every call through
    assert compat.eval_step_routes() == 2
    trainer_call._call_strategy_hook(first, "validation_step", 1)
    trainer_call._call_strategy_hook(second, "test_step", 1)
    trainer_call._call_strategy_hook(second, "training_step", 1)
    assert calls == [
        ("lightning", "a", "validation_step"),
        ("routed", "test_step"),
        ("lightning", "b", "test_step"),
        ("lightning", "b", "training_step"),
    ]
    assert second.lightning_module._current_fx_name is None  # put back after the routed step
    undo_second()  # outermost: both go
    assert trainer_call._call_strategy_hook is lightning_dispatch
    assert compat.eval_step_routes() == 0
