"""Per-device training memory of each way to run a model, and the least-sharded way that fits a budget.

Inputs, per model replica, in bytes: parameters P, gradients G (parameters that train), optimizer state O, buffers B,
the parameters U of the largest sharding unit (a block, or the root: what no block holds, such as the embeddings and a
head tied to them, gathered for the whole step; the whole model when there are no blocks), and the activations
one micro-batch's forward keeps for the backward, A, or Ac with every block's activations recomputed (activation
checkpointing). With N processes, the estimate per device is:

====================  ============================================  =============================================
option                kept between steps and during the step         working memory (communication buffers)
====================  ============================================  =============================================
``ddp``               P + G + O + B + A                              G (DDP's gradient buckets)
``fsdp_hybrid``       P/g + G/g + O/g + B + A                        3U
``fsdp_grad_op``      P/N + P + G/N + O/N + B + A                    U (the unit being reduce-scattered)
``fsdp_full``         P/N + G/N + O/N + B + A                        3U (two gathered units and one's gradients)
``fsdp_full_ac``      P/N + G/N + O/N + B + Ac                       3U
``fsdp_full_ac_off``  B + Ac (shards, gradients, optimizer on host)  3U
====================  ============================================  =============================================

``fsdp_hybrid`` shards as ``fsdp_full`` within each node's ``g`` processes and replicates across nodes; it is offered
only on several nodes, with several processes each, and is tried first after DDP because its all-gathers stay
inside a node. ``fsdp_grad_op`` keeps each unit's gathered parameters from its forward to its backward (P in all);
``fsdp_full`` gathers a unit for its forward and again for its backward. The options are tried in that order, and
the first whose total is at most ``(1 - margin)`` of the budget is chosen. Allocator slack, the CUDA context and
temporary buffers inside operators are not counted: the margin is there for them.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

from lightning_mgpu.core.host_memory import host_available_mb

PlanOption = Literal["ddp", "fsdp_hybrid", "fsdp_grad_op", "fsdp_full", "fsdp_full_ac", "fsdp_full_ac_offload"]
PLAN_OPTIONS: tuple[PlanOption, ...] = get_args(PlanOption)
MIB = float(2**20)
# states kept per parameter element by torch.optim classes, in the parameter's dtype; others are assumed to keep 2
_STATES_PER_PARAM: dict[str, int] = {
    "Adam": 2,
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "Adagrad": 1,
    "Adadelta": 2,
    "ASGD": 1,
    "Rprop": 2,
}
_UNKNOWN_STATES = 2


@dataclass(frozen=True)
class ModelMemory:
    """What one replica of the model needs, in bytes (see the module docstring for the symbols)."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    largest_unit_bytes: int
    activation_bytes: int
    checkpointed_activation_bytes: int


@dataclass(frozen=True)
class PlanRow:
    """One option's estimate per device, in MiB."""

    option: PlanOption
    params_mb: float
    grads_mb: float
    optimizer_mb: float
    activations_mb: float
    working_mb: float
    total_mb: float
    fits: bool
    possible: bool = True  # False: CPU offload when computing on the host


@dataclass(frozen=True)
class MemoryPlan:
    """Every option's estimate against a budget, and the option chosen (``None`` when nothing fits)."""

    rows: tuple[PlanRow, ...]
    world_size: int
    budget_mb: float
    budget_source: str
    margin: float
    chosen: PlanOption | None

    def row(self, option: PlanOption) -> PlanRow:
        """The row of ``option``."""
        return next(row for row in self.rows if row.option == option)

    def table(self) -> str:
        """The plan as a small fixed-width table, with the budget above and the choice below."""
        usable = self.budget_mb * (1 - self.margin)
        lines = [
            f"memory plan for {self.world_size} process(es): budget {self.budget_mb:,.1f} MB per device "
            f"({self.budget_source}), {usable:,.1f} MB usable with a {self.margin:.0%} margin",
            f"{'option':<22}{'params':>9}{'grads':>9}{'optim':>9}{'activ':>9}{'working':>9}{'total MB':>10}  fits",
        ]
        for row in self.rows:
            lines.append(
                f"{row.option:<22}{row.params_mb:>9,.1f}{row.grads_mb:>9,.1f}{row.optimizer_mb:>9,.1f}"
                f"{row.activations_mb:>9,.1f}{row.working_mb:>9,.1f}{row.total_mb:>10,.1f}  {_fits(row)}"
            )
        lines.append(f"chosen: {self.chosen}" if self.chosen is not None else "chosen: nothing fits")
        return "\n".join(lines)


def _fits(row: PlanRow) -> str:
    if not row.possible:
        return "n/a (host device)"
    return "yes" if row.fits else "no"


class MemoryPlanError(ValueError):
    """No way to run the model fits the memory budget."""


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | type, params: Sequence[torch.Tensor]) -> int:
    """The bytes of state ``optimizer`` keeps for ``params`` once it has stepped.

    Adam-like optimizers keep two tensors the size of each parameter; SGD one with momentum and none without;
    RMSprop one, plus one when ``centered`` and one with momentum. An unknown optimizer is assumed to keep two.

    Args:
        optimizer: an optimizer instance (its options are read) or class.
        params: the parameters it trains.

    Example::

        >>> optimizer_state_bytes(torch.optim.SGD, [torch.zeros(10)])
        40
    """
    instance = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    cls = type(optimizer) if instance is not None else optimizer
    options: dict[str, Any] = dict(instance.defaults) if instance is not None else {}
    name = next((base.__name__ for base in cls.__mro__ if base.__module__.startswith("torch.optim")), cls.__name__)
    if name == "SGD":
        states = 1 if options.get("momentum", 0) else 0
    elif name == "RMSprop":
        states = 1 + bool(options.get("centered")) + bool(options.get("momentum", 0))
    else:
        states = _STATES_PER_PARAM.get(name, _UNKNOWN_STATES)
    if name in ("Adam", "AdamW") and options.get("amsgrad"):
        states += 1
    return states * sum(param.numel() * param.element_size() for param in params)


def measure_activation_bytes(
    run_forward: Callable[[], Any], blocks: Sequence[nn.Module] = (), module: nn.Module | None = None
) -> tuple[int, int]:
    """The bytes a forward pass keeps for its backward, and an estimate of them with the blocks checkpointed.

    ``run_forward()`` runs once with autograd recording; every tensor it saves for the backward is counted once per
    storage (views share one), parameters excepted. No backward runs and no graph outlives the call.

    Args:
        run_forward: runs the forward (e.g. ``lambda: module.training_step(batch, 0)``).
        blocks: the units activation checkpointing would recompute.
        module: the model, whose parameters (and views of them, like a transposed weight) are not activations.

    Returns:
        ``(activations, checkpointed)``: the bytes saved, and the bytes saved outside the blocks plus each block's
        input (what checkpointing keeps) plus the largest block's own saved bytes (recomputed during the backward).
    """
    owners = [*blocks, *([module] if module is not None else [])]
    param_storages = {p.untyped_storage().data_ptr() for owner in owners for p in owner.parameters()}
    counted: set[int] = set()
    inside: list[int] = [0] * len(blocks)
    inputs: list[int] = [0] * len(blocks)
    active: list[int] = []
    outside = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        if isinstance(tensor, nn.Parameter) or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in counted or key in param_storages or key == 0:
            return tensor
        counted.add(key)
        if active:
            inside[active[-1]] += storage.nbytes()
        else:
            outside += storage.nbytes()
        return tensor

    def enter(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            inputs[index] += sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
            active.append(index)

        return hook

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        active.pop()

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(index)))
        handles.append(block.register_forward_hook(leave))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = run_forward()
        del result
    finally:
        for handle in handles:
            handle.remove()
    total = outside + sum(inside)
    checkpointed = outside + sum(inputs) + max(inside, default=0)
    return total, min(total, checkpointed)


def model_memory(
    module: nn.Module,
    optimizer_bytes: int,
    activation_bytes: int,
    checkpointed_activation_bytes: int,
    blocks: Sequence[nn.Module] = (),
) -> ModelMemory:
    """Count ``module``'s parameters (a tied one once), gradients and buffers, and put them with the measured numbers.

    The largest unit is the largest block or the root, whichever holds more: the root holds every parameter outside
    the blocks.
    """
    params = list(module.parameters())
    unit_sizes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root_bytes = sum(p.numel() * p.element_size() for p in params if id(p) not in in_blocks)
    return ModelMemory(
        param_bytes=param_bytes,
        grad_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        optimizer_bytes=optimizer_bytes,
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        largest_unit_bytes=max([*unit_sizes, root_bytes]),
        activation_bytes=activation_bytes,
        checkpointed_activation_bytes=checkpointed_activation_bytes,
    )


def _rows(
    memory: ModelMemory, world_size: int, node_size: int | None
) -> list[tuple[PlanOption, float, float, float, float, float]]:
    m, n = memory, max(1, world_size)
    p, g, o, b, u = m.param_bytes, m.grad_bytes, m.optimizer_bytes, m.buffer_bytes, m.largest_unit_bytes
    a, ac = m.activation_bytes, m.checkpointed_activation_bytes
    # (option, params and buffers, grads, optimizer, activations, working), in bytes
    hybrid = node_size is not None and 1 < node_size < n and n % node_size == 0
    return [
        ("ddp", p + b, g, o, a, g),
        *([("fsdp_hybrid", p / node_size + b, g / node_size, o / node_size, a, 3 * u)] if hybrid else []),
        ("fsdp_grad_op", p / n + p + b, g / n, o / n, a, u),
        ("fsdp_full", p / n + b, g / n, o / n, a, 3 * u),
        ("fsdp_full_ac", p / n + b, g / n, o / n, ac, 3 * u),
        ("fsdp_full_ac_offload", b, 0, 0, ac, 3 * u),
    ]


def plan_memory(
    memory: ModelMemory,
    world_size: int,
    budget_mb: float,
    budget_source: str = "memory_budget_mb",
    margin: float = 0.1,
    cpu_offload_possible: bool = True,
    node_size: int | None = None,
) -> MemoryPlan:
    """Estimate every option per device and choose the least sharded that fits ``budget_mb`` with ``margin``.

    Args:
        memory: the model's numbers.
        world_size: the processes that share the sharded state.
        budget_mb: memory per device, in MiB.
        budget_source: where the budget comes from, for the table.
        margin: the fraction of the budget kept free for what the estimate leaves out.
        cpu_offload_possible: whether offloading to host memory means anything (not when computing on the host).
        node_size: the processes of one node when there are several nodes: ``fsdp_hybrid`` is offered then.
    """
    usable = budget_mb * (1 - margin)
    rows = []
    for option, params, grads, optim, activations, working in _rows(memory, world_size, node_size):
        total = (params + grads + optim + activations + working) / MIB
        allowed = cpu_offload_possible or not option.endswith("offload")
        rows.append(
            PlanRow(
                option,
                params / MIB,
                grads / MIB,
                optim / MIB,
                activations / MIB,
                working / MIB,
                total,
                fits=allowed and total <= usable,
                possible=allowed,
            )
        )
    chosen = next((row.option for row in rows if row.fits), None)
    return MemoryPlan(tuple(rows), world_size, budget_mb, budget_source, margin, chosen)


def require_fit(plan: MemoryPlan) -> PlanOption:
    """The option ``plan`` chose.

    Raises:
        MemoryPlanError: nothing fits; the message gives the smallest need, the budget and what to change.
    """
    if plan.chosen is not None:
        return plan.chosen
    smallest = min((row for row in plan.rows if row.possible), key=lambda row: row.total_mb)
    raise MemoryPlanError(
        f"no way to train this model fits: the smallest need is {smallest.total_mb:,.0f} MB per device "
        f"({smallest.option}, {plan.world_size} processes), but the budget is {plan.budget_mb:,.0f} MB "
        f"({plan.budget_source}) and {plan.margin:.0%} of it is kept free. Use more devices (sharding divides "
        "parameters, gradients and optimizer state by their number), a smaller micro-batch, or a larger "
        f"memory_budget_mb.\n{plan.table()}"
    )


def device_budget_mb(device: torch.device, processes_on_host: int = 1) -> tuple[float, str] | None:
    """The memory a process may plan with on ``device``, in MiB, and where the number comes from; ``None`` if unknown.

    CUDA: the device's free memory now. CPU: the host's available memory shared by ``processes_on_host`` processes.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / MIB, f"free memory of {device}"
    if device.type == "cpu":
        available = host_available_mb()
        if available is None:
            return None
        share = max(1, processes_on_host)
        return available / share, f"available host memory / {share} process(es)"
    return None
