"""Numbers every rank agrees on each step, carried by the gradient all-reduce DDP runs anyway.

A rank that must tell the others something about the step under way (it ran out of memory, say) would need a
collective of its own, and reading its result on the host is a synchronisation per step. Here the message rides in
the step's last gradient bucket instead: the hook reduces that bucket with a few more elements, the ranks'
contributions, so the sums arrive on the device, on every rank, with the gradients, at the cost of no extra
collective and no host read. (Carried in place, as one bit, a step whose bit element is not finite costs one
all-reduce of one element when read on the host: see :meth:`StepFlag.raised_on_host`.)

A rank whose forward or backward raised (an out-of-memory error) would leave the others waiting in the step's
all-reduces. :meth:`StepFlag.finish_failed_step` lets it take part with zeros instead: the buckets it had already
handed over are not sent again, the rest go out as zeros, and its contribution (slot 0 by default) tells every rank
that the step failed somewhere, in the same reduction.

The hooks are the pack's plain gradient averaging: what DDP's built-in reduction and torch's ``fp16_compress_hook``
/ the pack's ``bf16`` hook compute, the buckets in the same order, one all-reduce each; only the last bucket's message
is longer. With two ranks the gradients are the same bit for bit. With more, a longer message can move the edges of
the chunks a ring all-reduce sums in (gloo's, NCCL's choice of algorithm), so a few elements of the last bucket are
summed in another order: equal within rounding. The last bucket is the one DDP hands over last in every backward
pass, the bucket holding the first layers' gradients, so a rank can still set its contribution during the backward.

Example::

    flag = StepFlag(slots=2, process_group=ddp_model.process_group)
    register_flagged_hook(ddp_model, flag, "mean")
    flag.set(0, 1)  # this rank's contribution to the next step's slot 0
    loss.backward()  # flag.reduced: the sums over ranks, on the device
"""

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu.core import compat
from lightning_mgpu.core.validation import check_bool, check_choice, check_int

FlaggedHookName = Literal["mean", "fp16", "bf16"]
FLAGGED_HOOK_NAMES: tuple[str, ...] = ("mean", "fp16", "bf16")
_WIRE_DTYPES: dict[str, torch.dtype | None] = {"mean": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# contributions travel in the bucket's dtype: integers up to 256 are exact in bfloat16, the narrowest (a sum over
# ranks above 256 may round there, but a sum of non-negative numbers that is not 0 never rounds to 0)
MAX_CONTRIBUTION = 256


class StepFlag:
    """Per-process state of a flag-carrying hook: this rank's contributions and the sums over ranks.

    Contributions set with :meth:`set` go out with the next bucket DDP marks as last, and are then reset to 0, so
    each counts for one synchronised backward pass. After that backward, :attr:`reduced` holds the sums over ranks of
    every slot: a device tensor of its own (the next step does not overwrite it), in the dtype the bucket travelled
    in, that nothing here reads on the host. :meth:`raised` says whether any rank contributed anything.

    **Gradients set aside** (:attr:`addends`, a dict from parameter to gradient): each bucket is sent with those
    parameters' entries added in (and taken out of the dict: what is left belongs to no bucket), so the reduction
    averages them with the backward's own gradients, and the tensors set aside stay as they were. An accumulation
    window's last batch can then start from empty gradients and still reduce the whole window's, overlapped with
    its backward as DDP's own accumulation would be; if the step fails, every rank has its earlier batches'
    gradients to go back to. Not while a failed step is finished (:meth:`finish_failed_step` sends zeros).

    **In place** (``in_place=True``, for the ``"mean"`` hook): the last bucket is reduced where it is, with no longer
    message and no copy. The ranks then agree on one bit instead of sums: a rank that contributes anything makes the
    first element of its last bucket infinite (its gradients are not meant to be used), so the reduced element is
    not finite on every rank; :attr:`reduced` is that element. A gradient that is not finite there by itself (a NaN
    loss, a float16 overflow) makes it so too: :meth:`raised` reads both as raised, and :meth:`raised_on_host` tells
    them apart with one more all-reduce of one element, on such steps only (every rank sees the same element, so
    every rank asks). ``divide=False`` leaves the averaging to the caller, who scales the
    loss's gradient by :attr:`loss_scale` (a tensor hook on the loss): the ``"mean"`` hook then sums, with no pass
    over the buckets of its own (the ``fp16``/``bf16`` hooks still divide after their cast, as torch's do, and
    :attr:`loss_scale` is then 1). On the CPU, where that pass and the copy are the hook's cost, these two halve it
    or better.

    Args:
        slots: how many numbers each rank contributes per step, at least 1.
        process_group: the group the gradients are averaged over; ``None`` for the default group.
        in_place: carry one bit in the ``"mean"`` hook's last bucket itself (the ``fp16``/``bf16`` hooks cast into a
            buffer of their own anyway, and carry the sums).
        divide: whether the ``"mean"`` hook divides by the world size; ``False`` when the caller scales the loss's
            gradient by :attr:`loss_scale`.

    Raises:
        TypeError: a ``slots`` that is not an int, an ``in_place`` or ``divide`` that is not a bool.
        ValueError: a ``slots`` below 1.
    """

    def __init__(self, slots: int = 2, process_group: Any = None, in_place: bool = False, divide: bool = True) -> None:
        owner = type(self).__name__
        check_int(owner, "slots", slots, minimum=1)
        check_bool(owner, "in_place", in_place)
        check_bool(owner, "divide", divide)
        self.slots = slots
        self.process_group = process_group
        self.in_place = in_place
        self.divide = divide
        self._local = [0] * slots
        self.reduced: Tensor | None = None
        self.reductions = 0  # backward passes whose last bucket carried the contributions
        self.issued = 0  # buckets of the pass under way handed to the all-reduce so far
        # a training forward of the DDP model has started and its backward has not sent the last bucket yet
        self.in_pass = False
        self._replay_from: int | None = None  # during a replay: buckets below this index went out already
        self._last_message: Tensor | None = None
        self._pass_hook: Any = None  # the forward pre-hook's handle
        self._carried_in_place = False  # whether the last reduction carried the bit in the bucket itself
        self._contributed = False  # whether this rank raised the bit in the last reduction
        self._confirmed: bool | None = None  # the ranks' answer, once asked, for a non-finite bit
        self.hook_name: str | None = None  # the flagged hook registered last
        # gradients of an accumulation window's earlier batches, set aside by parameter while its last batch runs:
        # the hook adds each into its bucket before the reduction (see :attr:`addends`)
        self.addends: dict[Tensor, Tensor] | None = None
        self._averaged_over: int | None = None  # of the process group, read once it is registered
        # the parameters in the model's buckets, and the module's others, as DDP chose them when it wrapped the model
        self._bucket_params: list[Tensor] | None = None
        self._bucket_param_ids: frozenset[int] | None = None
        self._unbucketed_params: list[Tensor] | None = None
        # where each bucket's memory starts, by bucket index, as of its last reduction
        self._bucket_memory: dict[int, int] = {}

    def _forward_started(self, module: Any, args: Any) -> None:
        """A forward pre-hook on the DDP model's module: a new pass, if gradients are on (validation's are not)."""
        if torch.is_grad_enabled():
            self.issued, self.in_pass = 0, True

    def set(self, slot: int, value: int) -> None:
        """Make ``value`` this rank's contribution to ``slot`` in the next reduction.

        Raises:
            TypeError: a slot or value that is not an int.
            ValueError: a slot out of range, or a value outside [0, 256] (exact in every bucket dtype).
        """
        owner = f"{type(self).__name__}.set"
        check_int(owner, "slot", slot, minimum=0, maximum=self.slots - 1)
        check_int(owner, "value", value, minimum=0, maximum=MAX_CONTRIBUTION)
        self._local[slot] = value

    @property
    def loss_scale(self) -> float:
        """What the caller scales the loss's gradient by: 1 / world size for the undivided ``"mean"`` hook, else 1."""
        if self.divide or self.hook_name != "mean":
            return 1.0
        if self._averaged_over is None:
            self._averaged_over = dist.get_world_size(self.process_group)
        return 1.0 / self._averaged_over

    def raised(self) -> Tensor | None:
        """A boolean device tensor: whether any rank contributed in the last reduction; ``None`` before the first.

        In place, a gradient that is not finite at the bit's element reads as raised too (:meth:`raised_on_host`
        tells the two apart).
        """
        reduced = self.reduced
        if reduced is None:
            return None
        if self._carried_in_place:
            return ~torch.isfinite(reduced[0])
        return (reduced != 0).any()

    def raised_on_host(self) -> bool:
        """Whether any rank contributed in the last reduction, read on the host (on a GPU, a wait for it).

        On the CPU the read is a memory load. In place, a bit element that is not finite may be a gradient's own
        NaN or infinity rather than a rank's flag: the ranks then say which with an all-reduce of one element (a NaN
        loss or an overflowing float16 step costs that, a step where the element is finite nothing). Call it on
        every rank of the group at the same point of the step: every rank reads the same element, so every rank
        takes part in that question.
        """
        reduced = self.reduced
        if reduced is None:
            return False
        if not self._carried_in_place:
            return any(reduced.tolist())
        if math.isfinite(reduced.item()):
            return False
        if self._confirmed is None:
            contributed = torch.tensor([1.0 if self._contributed else 0.0], device=reduced.device)
            dist.all_reduce(contributed, group=self.process_group)
            self._confirmed = contributed.item() > 0
        return self._confirmed

    def _note_wrap(self, model: DistributedDataParallel) -> None:
        """Note the parameters ``model``'s buckets hold: as the hook is registered, right after DDP wrapped it."""
        bucketed = bucket_params(model)
        self._bucket_params, self._bucket_param_ids = bucketed, frozenset(id(param) for param in bucketed)
        self._unbucketed_params = [p for p in model.module.parameters() if id(p) not in self._bucket_param_ids]
        self._bucket_memory = {}

    def reduces_every_trainable(self) -> bool:
        """Whether every parameter that requires a gradient now is in a bucket the hook reduces.

        Not while a parameter DDP ignores, or one frozen when the model was wrapped and unfrozen since, takes
        gradients: DDP leaves those to each rank, so a loss gradient scaled for the hook's sum (``divide=False``)
        would scale them too. A check of the parameters in no bucket only: nothing for a model trained whole.
        """
        outside = self._unbucketed_params
        return outside is not None and not any(param.requires_grad for param in outside)

    def out_of_buckets(self, grads: list[Tensor | None]) -> list[Tensor | None]:
        """``grads`` with copies of those that may live in a bucket's memory, which the next reduction writes over.

        With ``gradient_as_bucket_view=True``, DDP makes each gradient a view of its bucket after a synchronised
        backward (and when it wraps a model whose gradients exist), and a ``zero_grad(set_to_none=False)`` keeps it
        so: gradients set aside for an accumulation window's last batch (:attr:`addends`) must then be copied out
        first. Copied: a gradient in the memory of a bucket the hook has reduced, one in a larger allocation than
        itself (a view of some bucket), and, before the first reduction since registering (a model wrapped anew),
        every one. Meant for gradients set aside before any forward of the pass that reduces them: DDP's one-time
        bucket rebuild, in a forward, moves the gradients that exist then into new buckets.
        """
        memory = set(self._bucket_memory.values())
        if not memory:
            return [g.clone() if g is not None else None for g in grads]
        return [
            g.clone()
            if g is not None and (g.untyped_storage().data_ptr() in memory or g.untyped_storage().nbytes() > g.nbytes)
            else g
            for g in grads
        ]

    def bucketed_param_ids(self) -> frozenset[int] | None:
        """The ``id`` of every parameter in the model's buckets; ``None`` before the hook is registered."""
        return self._bucket_param_ids

    @property
    def pending(self) -> tuple[int, ...]:
        """This rank's contributions to the next reduction."""
        return tuple(self._local)

    def finish_failed_step(
        self,
        ddp: DistributedDataParallel,
        slot: int = 0,
        value: int = 1,
        synced: bool = True,
        replay: Callable[[], Tensor] | None = None,
    ) -> bool:
        """Take part in the step's gradient reduction with zeros, after this rank's forward or backward raised.

        Call it where the error was caught, on the failing rank only, once its frames are gone. The buckets this
        rank had already handed over are not sent again; the others are sent as zeros, and ``value`` goes to
        ``slot``. The other ranks' backward passes then complete, and every rank finds the failure in
        :attr:`reduced`. The gradients are not meant to be used: the step should be dropped everywhere. In place,
        where the others read the flag with :meth:`raised_on_host`, this rank reads it too (their read asks every
        rank, since the bit element is not finite).

        What it cannot finish, it says by returning ``False`` (nothing sent, nothing set): a failure before the
        DDP model's forward started (the other ranks' forward broadcasts buffers and, after the first step, DDP's
        rebuilt bucket order, which this rank would miss), or after its backward sent the last bucket (the other
        ranks have their gradients and may have stepped). Those need the caller's own way out, at a point where every
        rank meets. An error raised in here (a second out-of-memory error) leaves the others waiting, as before.

        Args:
            ddp: the model whose step failed, with a flagged hook whose state is this flag.
            slot: where this rank's failure is counted.
            value: what it adds there.
            synced: ``False`` for a pass under ``no_sync()`` (gradient accumulation): it sent nothing, so nothing is
                finished; the contribution goes out with the next synchronised pass.
            replay: runs the model's forward again (not through DDP's forward), on a sample or two, and returns a scalar
                to run the backward from; for a model whose layers run collectives of their own in the pass
                (synchronised BatchNorm), so that they are issued in the order the other ranks issue them. By
                default the backward runs from the parameters alone.

        Returns:
            Whether the failure is now known to the reduction: ``True`` when finished here, or when ``synced`` is
            false (it will be, with the next synchronised pass).
        """
        if not synced:
            self.set(slot, value)
            return True
        if not self.in_pass:
            return False
        self.set(slot, value)
        if not compat.ddp_buckets_rebuilt(ddp):
            # before the rebuild the reducer records the order gradients arrive in: a replay would record them twice
            compat.reset_ddp_reduction(ddp)
        self._replay_from = self.issued
        params = self._bucket_params if self._bucket_params is not None else bucket_params(ddp)
        compat.expect_ddp_backward(ddp)
        try:
            if replay is None:
                # a graph from the parameters alone: every one gets a zero gradient, so every bucket becomes ready
                torch.stack([param.sum() for param in params]).sum().mul(0.0).backward()
            else:
                replay().mul(0.0).backward()
        finally:
            self._replay_from = None
            self.in_pass = False
        return True

    def release(self) -> None:
        """Remove the forward pre-hook :func:`register_flagged_hook` put on the model's module (at the end of a fit)."""
        if self._pass_hook is not None:
            self._pass_hook.remove()
            self._pass_hook = None
        self.in_pass = False

    def _message(self, size: int, dtype: torch.dtype, like: Tensor) -> Tensor:
        """The buffer the last bucket is sent in, kept from step to step.

        DDP copies the result out before the next backward. A fresh buffer per step would be a fresh allocation,
        which on the CPU means page faults over the whole bucket: 0.5 ms a step for an 8 MB bucket, measured.
        """
        kept = self._last_message
        if kept is None or kept.numel() != size or kept.dtype != dtype or kept.device != like.device:
            kept = self._last_message = like.new_empty(size, dtype=dtype)
        return kept

    def _take(self) -> list[int]:
        local, self._local = self._local, [0] * self.slots
        return local


def flagged_hook(name: FlaggedHookName) -> Callable[[StepFlag, dist.GradBucket], torch.futures.Future[Tensor]]:
    """The DDP communication hook ``name`` that carries a :class:`StepFlag` in the last bucket.

    ``"mean"`` multiplies each bucket by the reciprocal of the world size and all-reduces the sum, as DDP's built-in
    reduction does; ``"fp16"`` and ``"bf16"`` first cast it to that dtype and divide, as torch's compress hooks do.
    The last bucket is reduced out of place, in a buffer ``slots`` elements longer.

    Args:
        name: one of :data:`FLAGGED_HOOK_NAMES`.

    Raises:
        ValueError: an unknown ``name``.
    """
    check_choice("flagged_hook", "name", name, FLAGGED_HOOK_NAMES)
    wire = _WIRE_DTYPES[name]

    def hook(flag: StepFlag, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        group = flag.process_group
        world_size = dist.get_world_size(group)
        buffer = bucket.buffer()
        last = bucket.is_last()
        index = bucket.index()
        flag._bucket_memory[index] = buffer.untyped_storage().data_ptr()
        if flag._replay_from is not None:
            if index < flag._replay_from:  # this rank sent it before its step failed
                done: torch.futures.Future[Tensor] = torch.futures.Future()
                done.set_result(buffer)
                return done
            buffer.zero_()
        elif flag.addends is not None:
            _add_set_aside(bucket, flag.addends)
        divide = flag.divide or wire is not None  # the compress hooks divide after the cast, as torch's do
        in_place = wire is None and (not last or flag.in_place)
        if in_place:
            sent = buffer.mul_(1.0 / world_size) if divide else buffer  # DDP multiplies by the reciprocal
            if last:
                flag._contributed = any(flag._take())
                if flag._contributed:
                    sent[:1].fill_(math.inf)  # not finite after the sum, on every rank
        else:
            size = buffer.numel()
            if last:
                sent = flag._message(size + flag.slots, wire or buffer.dtype, buffer)
            else:
                sent = buffer.new_empty(size, dtype=wire)
            if wire is not None:
                sent[:size].copy_(buffer).div_(world_size)  # cast first, then divide: torch's compress hooks
            elif divide:
                torch.mul(buffer, 1.0 / world_size, out=sent[:size])  # the same, into the longer buffer
            else:
                sent[:size].copy_(buffer)
            if last:
                _write_contributions(sent[size:], flag._take())
        future = dist.all_reduce(sent, group=group, async_op=True).get_future()
        # counted once handed over: an allocation above that failed sent nothing, and the replay sends this bucket
        flag.issued = index + 1
        flag.in_pass = not last

        def unpack(done: torch.futures.Future) -> Tensor:
            reduced = done.value()[0]
            if last:
                # its own: the bucket (or the message) is the next step's
                flag.reduced = reduced[:1].clone() if in_place else reduced[buffer.numel() :].clone()
                flag._carried_in_place, flag._confirmed = in_place, None
                flag.reductions += 1
            if wire is None:  # the bucket itself, reduced in place, or the longer message, which DDP copies in
                return reduced[: buffer.numel()]
            return buffer.copy_(reduced[: buffer.numel()])  # back to the gradients' dtype

        return future.then(unpack)

    return hook


def bucket_params(model: DistributedDataParallel, trainable_only: bool = True) -> list[Tensor]:
    """The parameters DDP puts in ``model``'s buckets, by its own rule.

    Those that require a gradient when it wraps the module (``trainable_only``), unless ignored under the name it
    checks, each once (a shared one under its first module's name).
    """
    ignored = model.parameters_to_ignore
    params: dict[int, Tensor] = {}
    for module_name, module in model.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if (param.requires_grad or not trainable_only) and f"{module_name}.{name}" not in ignored:
                params.setdefault(id(param), param)
    return list(params.values())


def _add_set_aside(bucket: dist.GradBucket, addends: dict[Tensor, Tensor]) -> None:
    """Add the gradients set aside for the bucket's parameters into its buffer, in one multi-tensor kernel.

    Each entry is taken out of ``addends``: what is left after the backward belongs to no bucket. ``bucket.gradients()``
    are contiguous views of the buffer, in the order of ``bucket.parameters()``; DDP lays out the gradient of a
    parameter that is dense but not contiguous (``channels_last``) in the parameter's own strides, so the view
    is taken with those (the strides DDP saw when it laid out its buckets: a parameter whose memory format changed
    after the model was wrapped would be added in the wrong order).
    """
    views, earlier = [], []
    for view, param in zip(bucket.gradients(), bucket.parameters(), strict=True):
        kept = addends.pop(param, None)
        if kept is None:
            continue
        if not param.is_contiguous() and _dense(param):
            view = view.as_strided(param.size(), param.stride())
        views.append(view)
        earlier.append(kept)
    if views:
        compat.foreach_add_(views, earlier)


def _dense(tensor: Tensor) -> bool:
    """Whether ``tensor``'s elements fill its memory without gaps or overlaps, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.size(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _write_contributions(slots: Tensor, values: list[int]) -> None:
    """Fill the slots with device fills only: a copy from host memory could wait on the device."""
    if not any(values):
        slots.zero_()
        return
    for index, value in enumerate(values):
        slots[index].fill_(value)


def register_flagged_hook(
    model: DistributedDataParallel,
    flag: StepFlag,
    name: FlaggedHookName = "mean",
    wrap: Callable[[Callable], Callable] | None = None,
) -> None:
    """Register :func:`flagged_hook` ``name`` on ``model``, with ``flag`` as its state.

    Also registers a forward pre-hook on ``model.module`` that tells the flag when a training pass starts, which
    :meth:`StepFlag.finish_failed_step` needs. A flag serves one model: registering it again (a model wrapped anew,
    as bucket tuning does) moves its pre-hook to the new model's module; :meth:`StepFlag.release` removes it.

    The flag notes which parameters the model's buckets hold by DDP's own rule (:func:`bucket_params`), from
    their ``requires_grad`` now: register right after wrapping, before anything freezes or unfreezes a layer.

    Args:
        model: the wrapped model; a hook can be registered once per model, before its first backward.
        flag: the state; its process group should be the model's.
        name: one of :data:`FLAGGED_HOOK_NAMES`.
        wrap: wraps the hook before it is registered (the performance monitor times buckets this way).

    Raises:
        ValueError: a model built with ``find_unused_parameters=True`` or ``static_graph=True``, whose reductions
            hold state a failed pass cannot be finished in; or with ``delay_all_reduce_named_params``, whose
            parameters DDP reduces by an all-reduce of its own that the flag does not ride in.
    """
    for option in ("find_unused_parameters", "static_graph"):
        if getattr(model, option, False):
            raise ValueError(
                f"register_flagged_hook: a DistributedDataParallel built with {option}=True is not supported (its "
                "reduction keeps state that a failed pass cannot be finished in); build it with the default False."
            )
    if compat.ddp_delayed_params(model):
        raise ValueError(
            "register_flagged_hook: a DistributedDataParallel built with delay_all_reduce_named_params is not"
            " supported (DDP reduces those parameters by an all-reduce of its own, which the flag does not ride in"
            " and a failed pass cannot finish); build it without."
        )
    hook = flagged_hook(name)
    model.register_comm_hook(flag, wrap(hook) if wrap else hook)
    flag.hook_name, flag._averaged_over = name, None  # the group may be another than at the last registration
    flag._note_wrap(model)
    flag.release()  # a model wrapped again (bucket tuning): one pre-hook, on the module in use
    flag._pass_hook = model.module.register_forward_pre_hook(flag._forward_started)
