"""The flag-carrying DDP hooks: DDP's own gradients, the ranks' numbers summed, and no collective more."""

import contextlib
import copy
import math
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from lightning_mgpu.ddp.comm_hooks import register_comm_hook
from lightning_mgpu.ddp.step_flag import FLAGGED_HOOK_NAMES, StepFlag, register_flagged_hook
from lightning_mgpu.memory.oom import is_out_of_memory
from tests.helpers.oom_models import _OOMInBackward, raise_oom
from tests.helpers.processes import run_processes

WORLD_SIZE = 2
STEPS = 7
TINY_BUCKETS_MB = 0.0001  # a bucket per parameter after the rebuild (one before it)
# (step, rank, slot, value): what each rank contributes, and when
RAISED = [(0, 1, 1, 1), (3, 1, 0, 1), (4, 0, 1, 2), (4, 1, 1, 1), (6, 0, 0, 1)]
# set during the backward, once the later layers' buckets have gone and before the first layer's gradient exists
RAISED_MID_BACKWARD = (5, 1, 0, 3)


def _model(as_view: bool) -> DistributedDataParallel:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    return DistributedDataParallel(module, bucket_cap_mb=TINY_BUCKETS_MB, gradient_as_bucket_view=as_view)


def _step(model: DistributedDataParallel, rank: int, step: int, flag: StepFlag | None = None) -> None:
    generator = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 24, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    for param in model.parameters():
        param.grad = None
    at, who, slot, value = RAISED_MID_BACKWARD
    handle = None
    if flag is not None and (step, rank) == (at, who):

        def raise_flag(module: nn.Module, inputs: Any, output: Tensor) -> None:
            output.register_hook(lambda grad: flag.set(slot, value))

        handle = model.module[0].register_forward_hook(raise_flag)
    try:
        loss = nn.functional.cross_entropy(model(x), y)
        if flag is not None and not flag.divide:  # the caller averages: the loss's gradient is scaled
            loss.register_hook(lambda grad: grad * flag.loss_scale)
        loss.backward()
    finally:
        if handle is not None:
            handle.remove()


def _grads(model: DistributedDataParallel) -> list[Tensor]:
    return [param.grad.clone() for param in model.parameters()]


def _recording(hook: Any, seen: set[int]) -> Any:
    """``hook``, after noting the index of each bucket it is handed (and so testing ``wrap``)."""

    def recording(flag: StepFlag, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        seen.add(bucket.index())
        return hook(flag, bucket)

    return recording


# the hooks, and how the flag rides: as sums in a longer last message, or as one bit in the last bucket itself with
# the loss's gradient scaled instead of each bucket divided
FLAG_MODES = [(name, "sums") for name in FLAGGED_HOOK_NAMES] + [
    ("mean", "in place"),
    ("mean", "in place, divided"),  # a backward whose loss gradient nobody scaled: the hook divides
    ("fp16", "undivided"),
]


def _flag_cases(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, mode in FLAG_MODES:
        for as_view in (False, True):
            reference, ours = _model(as_view), _model(as_view)
            if name != "mean":  # the pack's compress hooks (torch's fp16 one; a bf16 one that works on gloo too)
                register_comm_hook(reference, name)
            in_place, divide = mode.startswith("in place"), mode in ("sums", "in place, divided")
            flag = StepFlag(slots=2, process_group=ours.process_group, in_place=in_place, divide=divide)
            buckets: set[int] = set()
            register_flagged_hook(ours, flag, name, wrap=lambda hook, seen=buckets: _recording(hook, seen))
            same, reduced, raised = [], [], []
            for step in range(STEPS):
                for at, who, slot, value in RAISED:
                    if at == step and who == rank:
                        flag.set(slot, value)
                _step(reference, rank, step)
                _step(ours, rank, step, flag)
                same.append(all(torch.equal(a, b) for a, b in zip(_grads(reference), _grads(ours), strict=True)))
                reduced.append(flag.reduced.tolist())
                raised.append(bool(flag.raised()))
                assert flag.raised_on_host() == raised[-1]
                assert flag.pending == (0, 0)  # taken by the last bucket
            results[f"{name}-{mode}-{as_view}"] = {
                "same": same,
                "reduced": reduced,
                "raised": raised,
                "reductions": flag.reductions,
                "buckets": buckets,
                "dtype": flag.reduced.dtype,
            }
    results["collectives"] = _collectives_per_step()
    return results


def _collectives_per_step() -> dict[str, dict[str, int]]:
    """The collectives of one steady step, as the profiler records them (DDP's built-in ones included)."""
    counts = {}
    for name in ("builtin", "mean"):
        model = _model(as_view=False)
        if name == "mean":
            register_flagged_hook(model, StepFlag(process_group=model.process_group), "mean")
        for step in range(3):  # past the bucket rebuild after the first backward
            _step(model, dist.get_rank(), step)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, dist.get_rank(), 3)
        counts[name] = dict(Counter(e.name for e in prof.events() if e.name.startswith("gloo:")))
    return counts


@pytest.fixture(scope="module")
def flag_cases() -> list[dict[str, Any]]:
    return run_processes(_flag_cases, WORLD_SIZE)


def _expected_sums() -> list[list[int]]:
    sums = [[0, 0] for _ in range(STEPS)]
    for step, _, slot, value in [*RAISED, RAISED_MID_BACKWARD]:
        sums[step][slot] += value
    return sums


@pytest.mark.distributed
@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize(("name", "mode"), FLAG_MODES)
def test_flagged_hook_gives_ddps_gradients_and_every_rank_the_sums(flag_cases, name, mode, as_view):
    for rank, results in enumerate(flag_cases):
        case = results[f"{name}-{mode}-{as_view}"]
        # bit for bit, the first step (before the rebuild) included; a loss gradient scaled by 1/2 is exact. In
        # place, a step where a rank raised the bit has an infinite gradient element: such a step is to be dropped
        in_place = mode.startswith("in place")
        expected_same = [not any(sums) for sums in _expected_sums()] if in_place else [True] * STEPS
        assert case["same"] == expected_same, rank
        assert len(case["buckets"]) >= 3  # several buckets: the flags ride in one of them only
        assert case["raised"] == [any(sums) for sums in _expected_sums()], rank
        assert case["reductions"] == STEPS
        assert case["dtype"] == {"mean": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
        if not in_place:
            assert case["reduced"] == _expected_sums(), rank
        else:  # one element of the last bucket: finite where nothing was raised
            assert [math.isfinite(value[0]) for value in case["reduced"]] == [not r for r in case["raised"]]


@pytest.mark.distributed
def test_flagged_hook_runs_no_collective_more_than_ddp(flag_cases):
    for results in flag_cases:
        builtin, ours = results["collectives"]["builtin"], results["collectives"]["mean"]
        assert builtin.get("gloo:all_reduce", 0) >= 3  # the profiler does see DDP's own reduction
        assert ours == builtin


@pytest.mark.parametrize(
    ("slot", "value", "error", "named"),
    [
        (2, 1, ValueError, "slot"),
        (-1, 1, ValueError, "slot"),
        (0, 257, ValueError, "value"),
        (0, 1.0, TypeError, "value"),
        (0, True, TypeError, "value"),
        ("0", 1, TypeError, "slot"),
    ],
)
def test_set_rejects_bad_slots_and_values(slot, value, error, named):
    flag = StepFlag(slots=2)
    with pytest.raises(error, match=named):
        flag.set(slot, value)
    assert flag.pending == (0, 0)


@pytest.mark.parametrize(("slots", "error"), [(0, ValueError), (1.5, TypeError), (None, TypeError)])
def test_step_flag_rejects_bad_slot_counts(slots, error):
    with pytest.raises(error, match="slots"):
        StepFlag(slots=slots)


WIDTH = 32


class _FailingNet(nn.Module):
    """Six layers; on request, an out-of-memory error in the forward (after layer 4) or in the backward (at layer 2,
    once the later layers' buckets have gone)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(6)])
        self.head = nn.Linear(WIDTH, 1)
        self.fail: str | None = None

    def forward(self, x: Tensor) -> Tensor:
        for index, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if index == 2 and self.fail == "backward":
                x = _OOMInBackward.apply(x)
            if index == 4 and self.fail == "forward":
                raise_oom()
        return self.head(x)


FAILURE_STEPS = 5


def _train_with_failure(
    rank: int,
    where: str | None,
    fail_at: int,
    as_view: bool = False,
    skip: int | None = None,
    failing: tuple[int, ...] = (1,),
    micro_batches: int = 1,
    in_place: bool = False,
    hook_fails: bool = False,
) -> dict:
    """SGD with momentum; the ``failing`` ranks fail at ``fail_at`` (``where``), or step ``skip`` is left out on
    every rank. With 2 micro-batches the first runs under ``no_sync()`` and is the one that fails."""
    net = _FailingNet()
    model = DistributedDataParallel(net, bucket_cap_mb=0.0001, gradient_as_bucket_view=as_view)
    flag = StepFlag(slots=2, process_group=model.process_group, in_place=in_place, divide=not in_place)
    armed = {"on": False}

    def failing_at_bucket_1(hook: Any) -> Any:
        # an allocation in the hook (a bucket-sized buffer) failing before its all-reduce went out
        def wrapped(state: StepFlag, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
            if armed["on"] and bucket.index() == 1:
                armed["on"] = False
                raise_oom()
            return hook(state, bucket)

        return wrapped

    register_flagged_hook(model, flag, "mean", wrap=failing_at_bucket_1 if hook_fails else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randn(16, WIDTH, generator=generator) for _ in range(FAILURE_STEPS)]
    dropped, issued_at_failure = [], None
    for step in range(FAILURE_STEPS):
        if step == skip:
            continue
        optimizer.zero_grad(set_to_none=True)
        pieces = batches[step][rank * 8 : (rank + 1) * 8].chunk(micro_batches)
        for index, x in enumerate(pieces):
            synced = index == len(pieces) - 1
            failing_now = rank in failing and step == fail_at and index == 0
            net.fail = where if failing_now and not hook_fails else None
            armed["on"] = failing_now and hook_fails
            try:
                with contextlib.nullcontext() if synced else model.no_sync():
                    loss = model(x).pow(2).mean()
                    if in_place:
                        loss.register_hook(lambda grad: grad * flag.loss_scale)
                    loss.backward()
            except Exception as err:
                if not is_out_of_memory(err):  # raised in the hook, it may reach here wrapped
                    raise
                issued_at_failure = flag.issued
                assert flag.finish_failed_step(model, synced=synced)
        if flag.raised():  # read on the host: on the CPU a memory load
            dropped.append(step)
            continue
        optimizer.step()
    return {
        "params": [param.detach().clone() for param in net.parameters()],
        "dropped": dropped,
        "issued_at_failure": issued_at_failure,
    }


def _failure_cases(rank: int, world_size: int) -> dict:
    results = {}
    for fail_at in (0, 2):  # before DDP's bucket rebuild, and after it
        results[("reference", fail_at)] = _train_with_failure(rank, None, -1, skip=fail_at)
        for where in ("forward", "backward"):
            for as_view in (False, True):
                results[(where, fail_at, as_view)] = _train_with_failure(rank, where, fail_at, as_view)
    for where in ("forward", "backward"):
        for fail_at in (0, 2):
            results[("in place", where, fail_at)] = _train_with_failure(rank, where, fail_at, in_place=True)
    results["hook fails"] = _train_with_failure(rank, None, 2, hook_fails=True)
    results["rank 0 fails"] = _train_with_failure(rank, "backward", 2, failing=(0,))
    results["both fail"] = _train_with_failure(rank, "backward", 2, failing=(0, 1))
    results["accumulation reference"] = _train_with_failure(rank, None, -1, skip=2, micro_batches=2)
    results["fails under no_sync"] = _train_with_failure(rank, "forward", 2, micro_batches=2)
    results["edges"] = _edge_cases(rank)
    results["non-finite"] = _non_finite_cases(rank)
    return results


# (what rank 1's loss is multiplied by, the ranks that raise the bit) per step
NON_FINITE_STEPS = [(1.0, ()), (math.nan, ()), (math.inf, ()), (math.nan, (0,)), (1.0, (1,)), (1.0, ())]


def _non_finite_cases(rank: int) -> list[tuple[bool, bool, int]]:
    """In place, per step: what raised() and raised_on_host() say, and how many collectives the host read ran."""
    model = _model(as_view=False)
    flag = StepFlag(slots=1, process_group=model.process_group, in_place=True, divide=False)
    register_flagged_hook(model, flag, "mean")
    found = []
    for step, (factor, raising) in enumerate(NON_FINITE_STEPS):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 24, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        model.zero_grad(set_to_none=True)
        if rank in raising:
            flag.set(0, 1)
        loss = nn.functional.cross_entropy(model(x), y) * (factor if rank == 1 else 1.0)
        loss.register_hook(lambda grad: grad * flag.loss_scale)
        loss.backward()
        on_device = bool(flag.raised())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            on_host = flag.raised_on_host()
            assert flag.raised_on_host() == on_host  # asked once per reduction
        found.append((on_device, on_host, sum(e.name.startswith("gloo:") for e in prof.events())))
    return found


def _edge_cases(rank: int) -> dict:
    """What finish_failed_step cannot finish says so, and sends and sets nothing; unsupported DDP options refuse."""
    found: dict[str, Any] = {}
    net = _FailingNet()
    model = DistributedDataParallel(net, bucket_cap_mb=0.0001)
    flag = StepFlag(slots=2, process_group=model.process_group)
    register_flagged_hook(model, flag, "mean")
    x = torch.randn(8, WIDTH)
    model(x).sum().backward()  # a whole step
    with torch.no_grad():
        model(x)  # a validation forward starts no pass
    found["before the forward"] = (rank == 1 and flag.finish_failed_step(model), flag.pending)
    # an error after the backward sent the last bucket: the input's own gradient comes after every parameter's
    failing_input = x.clone().requires_grad_()
    try:
        model(_OOMInBackward.apply(failing_input) if rank == 1 else failing_input).sum().backward()
    except torch.OutOfMemoryError:
        found["after the last bucket"] = (flag.finish_failed_step(model), flag.pending, flag.in_pass)
    for option in ("find_unused_parameters", "static_graph"):
        try:
            register_flagged_hook(DistributedDataParallel(_FailingNet(), **{option: True}), StepFlag())
        except ValueError as err:
            found[option] = str(err)
    net = _FailingNet()
    name, first = next(iter(net.named_parameters()))
    delayed = DistributedDataParallel(
        net, delay_all_reduce_named_params=[(name, first)], param_to_hook_all_reduce=first
    )
    try:
        register_flagged_hook(delayed, StepFlag())
    except ValueError as err:
        found["delay_all_reduce_named_params"] = str(err)
    return found


@pytest.fixture(scope="module")
def failure_cases() -> list[dict]:
    return run_processes(_failure_cases, WORLD_SIZE)


@pytest.mark.distributed
@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("fail_at", [0, 2])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_rank_that_fails_finishes_the_step_with_zeros_and_every_rank_drops_it(failure_cases, where, fail_at, as_view):
    # no hang; both ranks learn of the failure from the reduction itself and drop the step; later steps reduce as
    # if it had never been tried: the parameters equal, bit for bit, a run that skipped that batch on every rank
    for rank, results in enumerate(failure_cases):
        case, reference = results[(where, fail_at, as_view)], results[("reference", fail_at)]
        assert case["dropped"] == [fail_at], rank
        for ours, theirs in zip(case["params"], reference["params"], strict=True):
            assert torch.equal(ours, theirs), (rank, where, fail_at)
    issued = failure_cases[1][(where, fail_at, as_view)]["issued_at_failure"]
    # after the rebuild, a backward failure strikes once some buckets have gone; before it, DDP holds a model this
    # small in one bucket (the reducer's record of the gradients that arrived is what must be reset then)
    assert issued >= 1 if (where, fail_at) == ("backward", 2) else issued == 0


@pytest.mark.distributed
@pytest.mark.parametrize("fail_at", [0, 2])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failure_is_finished_with_the_bit_carried_in_place(failure_cases, where, fail_at):
    for rank, results in enumerate(failure_cases):
        case, reference = results[("in place", where, fail_at)], results[("reference", fail_at)]
        assert case["dropped"] == [fail_at], rank
        for ours, theirs in zip(case["params"], reference["params"], strict=True):
            assert torch.equal(ours, theirs), (rank, where, fail_at)


@pytest.mark.distributed
def test_a_failure_in_the_hook_before_its_all_reduce_is_replayed_from_that_bucket(failure_cases):
    # the bucket whose hook raised was never sent: it is not counted as issued, so the replay sends it (as zeros)
    assert failure_cases[1]["hook fails"]["issued_at_failure"] == 1
    for rank, results in enumerate(failure_cases):
        case, reference = results["hook fails"], results[("reference", 2)]
        assert case["dropped"] == [2], rank
        for ours, theirs in zip(case["params"], reference["params"], strict=True):
            assert torch.equal(ours, theirs), rank


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["rank 0 fails", "both fail"])
def test_any_rank_or_several_may_fail(failure_cases, case):
    for rank, results in enumerate(failure_cases):
        assert results[case]["dropped"] == [2], rank
        for ours, theirs in zip(results[case]["params"], results[("reference", 2)]["params"], strict=True):
            assert torch.equal(ours, theirs), (rank, case)


@pytest.mark.distributed
def test_a_failure_under_no_sync_goes_out_with_the_synchronised_pass(failure_cases):
    # gradient accumulation: the failing micro-batch sent nothing, so nothing is replayed; its flag rides with the
    # step's synchronised micro-batch, and every rank drops the whole step
    for rank, results in enumerate(failure_cases):
        case, reference = results["fails under no_sync"], results["accumulation reference"]
        assert case["dropped"] == [2], rank
        for ours, theirs in zip(case["params"], reference["params"], strict=True):
            assert torch.equal(ours, theirs), rank


@pytest.mark.distributed
def test_what_cannot_be_finished_says_so_and_unsupported_options_refuse(failure_cases):
    edges = failure_cases[1]["edges"]
    assert edges["before the forward"] == (False, (0, 0))
    assert edges["after the last bucket"] == (False, (0, 0), False)
    assert "after the last bucket" not in failure_cases[0]["edges"]  # rank 0 finished its step normally
    for results in failure_cases:
        for option in ("find_unused_parameters", "static_graph"):
            assert f"{option}=True is not supported" in results["edges"][option]
        assert "delay_all_reduce_named_params is not supported" in results["edges"]["delay_all_reduce_named_params"]


@pytest.mark.distributed
def test_a_gradient_that_is_not_finite_by_itself_is_told_from_the_bit_on_the_host(failure_cases):
    # a NaN or an infinity in the bit's element makes it not finite, as a raised bit does: raised() (on the device)
    # reads both as raised; raised_on_host() asks the ranks with one all-reduce of one element, on those steps only
    for results in failure_cases:
        on_device, on_host, collectives = zip(*results["non-finite"], strict=True)
        assert list(on_device) == [False, True, True, True, True, False]
        assert list(on_host) == [bool(raising) for _, raising in NON_FINITE_STEPS]
        assert list(collectives) == [0, 1, 1, 1, 1, 0]


def _three_ranks(rank: int, world_size: int) -> dict:
    found = {}
    for in_place in (False, True):
        reference, ours = _model(as_view=False), _model(as_view=False)
        flag = StepFlag(slots=2, process_group=ours.process_group, in_place=in_place, divide=not in_place)
        register_flagged_hook(ours, flag, "mean")
        grads, reduced = [], []
        for step in range(3):
            if not in_place:
                flag.set(0, rank + 1)
            _step(reference, rank, step)
            _step(ours, rank, step, flag)
            grads.append((_grads(reference), _grads(ours)))
            reduced.append(flag.reduced.tolist())
        found[in_place] = {"grads": grads, "reduced": reduced}
    return found


@pytest.mark.distributed
def test_with_three_ranks_the_gradients_equal_ddps_within_rounding():
    # a longer last message moves the edges of gloo's ring chunks: a few elements are summed in another order; in
    # place, the loss's gradient scaled by 1/3 rounds differently from each gradient multiplied by 1/3
    for results in run_processes(_three_ranks, 3):
        assert results[False]["reduced"] == [[6, 0]] * 3
        for in_place in (False, True):
            for reference, ours in results[in_place]["grads"]:
                for theirs, mine in zip(reference, ours, strict=True):
                    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def _set_aside_ranks(rank: int, world_size: int) -> list[dict]:
    """Windows of 2 batches: stock DDP accumulating in place, against the last batch started from empty gradients
    with the first batch's set aside and added in by the hook. A channels_last convolution (DDP lays its gradient
    out in the weight's own strides) and a layer unfrozen after DDP wrapped the model (in no bucket)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 5), nn.Tanh(), nn.Linear(5, 2))
    module = module.to(memory_format=torch.channels_last)
    module[4].requires_grad_(False)
    reference = DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=TINY_BUCKETS_MB)
    ours = DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=TINY_BUCKETS_MB)
    flag = StepFlag(slots=1, process_group=ours.process_group, in_place=True)
    register_flagged_hook(ours, flag, "mean")  # right after the wrap, as the strategy does
    for model in (reference, ours):
        model.module[4].requires_grad_(True)
    found = []
    for window in range(3):
        generator = torch.Generator().manual_seed(10 * window + rank)
        batches = [(torch.randn(4, 3, 6, 6, generator=generator), torch.randn(4, 2, generator=generator)) for _ in "ab"]
        for model in (reference, ours):
            for param in model.parameters():
                param.grad = None
            with model.no_sync():
                nn.functional.mse_loss(model(batches[0][0]), batches[0][1]).backward()
        params = list(ours.parameters())
        kept = [param.grad for param in params]
        for param in params:
            param.grad = None
        flag.addends = {param: grad for param, grad in zip(params, kept, strict=True)}
        nn.functional.mse_loss(reference(batches[1][0]), batches[1][1]).backward()
        nn.functional.mse_loss(ours(batches[1][0]), batches[1][1]).backward()
        left = [index for index, param in enumerate(params) if param in flag.addends]
        for param, grad in flag.addends.items():  # what the caller adds back itself (OOMBackoff's window path)
            param.grad.add_(grad)
        flag.addends = None
        found.append({"left": left, "reference": _grads(reference), "ours": _grads(ours), "kept": kept[0].stride()})
    # the unfrozen layer takes gradients outside the buckets: a loss gradient scaled for the hook's sum would scale it
    found.append({"scalable": flag.reduces_every_trainable()})
    ours.module[4].requires_grad_(False)
    found.append({"scalable": flag.reduces_every_trainable()})
    return found


@pytest.mark.distributed
def test_set_aside_gradients_added_in_the_hook_give_ddps_accumulation_bit_for_bit():
    for results in run_processes(_set_aside_ranks, 2):
        assert [found["scalable"] for found in results[-2:]] == [False, True]
        for window in results[:-2]:
            assert window["kept"] == (27, 1, 9, 3)  # the convolution's gradient is channels_last
            assert window["left"] == [4, 5]  # the layer unfrozen after wrapping is in no bucket: left to the caller
            for theirs, mine in zip(window["reference"], window["ours"], strict=True):
                assert torch.equal(mine, theirs)


def _bucket_view_windows(rank: int, world_size: int) -> list[dict]:
    """Windows of 2 batches with gradient_as_bucket_view and gradients zeroed in place (``set_to_none=False``): stock
    DDP against OOMBackoff's window path, whose set-aside gradients pass through :meth:`StepFlag.out_of_buckets`.
    The gradients exist when the models are wrapped, so DDP makes them views of its buckets before the hook has
    reduced any (the first window). In the second, they are views of the buckets DDP's rebuild (in that window's
    first forward) let go of: copied, though nothing writes over them. The third's are views of the rebuilt ones."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    copies = [copy.deepcopy(module) for _ in "ab"]
    for param in (param for copied in copies for param in copied.parameters()):
        param.grad = torch.ones_like(param)
    models = [DistributedDataParallel(copied, gradient_as_bucket_view=True) for copied in copies]
    reference, ours = models
    flag = StepFlag(slots=1, process_group=ours.process_group, in_place=True)
    register_flagged_hook(ours, flag, "mean")
    found = []
    for window in range(3):
        generator = torch.Generator().manual_seed(10 * window + rank)
        batches = [(torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)) for _ in "ab"]
        for model in models:  # zero_grad(set_to_none=False)
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.zero_()
        with reference.no_sync():
            nn.functional.mse_loss(reference(batches[0][0]), batches[0][1]).backward()
        nn.functional.mse_loss(reference(batches[1][0]), batches[1][1]).backward()
        params = list(ours.parameters())
        kept = [param.grad for param in params]  # the window's first batch, set aside and added back
        for param in params:
            param.grad = None
        with ours.no_sync():
            nn.functional.mse_loss(ours(batches[0][0]), batches[0][1]).backward()
        for param, grad in zip(params, kept, strict=True):
            param.grad = param.grad if grad is None else grad.add_(param.grad)
        viewed = [param.grad.untyped_storage().nbytes() > param.grad.nbytes for param in params]
        kept = flag.out_of_buckets([param.grad for param in params])
        for param in params:
            param.grad = None
        flag.addends = {param: grad for param, grad in zip(params, kept, strict=True)}
        nn.functional.mse_loss(ours(batches[1][0]), batches[1][1]).backward()
        flag.addends = None
        found.append({"viewed": viewed, "reference": _grads(reference), "ours": _grads(ours)})
    return found


@pytest.mark.distributed
def test_set_aside_gradients_that_are_views_of_the_buckets_are_copied_out_first():
    for results in run_processes(_bucket_view_windows, 2):
        # the first batch's gradients were views of DDP's buckets, which the last backward writes into
        assert [all(window["viewed"]) for window in results] == [True, True, True]
        for window in results:
            for theirs, mine in zip(window["reference"], window["ours"], strict=True):
                assert torch.equal(mine, theirs)
