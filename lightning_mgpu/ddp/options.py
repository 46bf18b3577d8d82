"""The options of DDP, declared once for ``DDPStrategy`` and ``MultiGPUStrategy`` (see ``core/options.py``)."""

from collections.abc import Mapping
from typing import Any, Literal, TypeAlias, get_args

from lightning_mgpu.core.options import DDP, MGPU, NO_DEFAULT, Check, Option, boolean, choice, integer
from lightning_mgpu.core.validation import check_positive
from lightning_mgpu.ddp.comm_hooks import COMM_HOOK_NAMES, CommHookName
from lightning_mgpu.ddp.ddp_bucket_tuning import MIN_BUCKET_TUNING_STEPS

StartMethod: TypeAlias = Literal["popen", "spawn", "fork", "forkserver"]
BucketCapSetting: TypeAlias = float | Literal["auto"] | None
CommHookSetting: TypeAlias = CommHookName | Literal["auto"] | None
TunableCommHook: TypeAlias = Literal["fp16", "bf16"]

TUNABLE_COMM_HOOKS: tuple[str, ...] = ("fp16", "bf16")

__all__ = [
    "DDP_OPTIONS",
    "TUNABLE_COMM_HOOKS",
    "BucketCapSetting",
    "CommHookSetting",
    "StartMethod",
    "TunableCommHook",
    "tunable_hooks",
]


def tunable_hooks(comm_hook: Any, candidates: list[str] | None) -> tuple[str, ...]:
    """The hooks ``comm_hook="auto"`` times: ``candidates`` once each, both by default; none without ``"auto"``."""
    if comm_hook != "auto":
        return ()
    return TUNABLE_COMM_HOOKS if candidates is None else tuple(dict.fromkeys(candidates))


def _check_bucket_cap(owner: str, name: str, value: Any, values: Mapping[str, Any]) -> None:
    if value is not None and value != "auto":
        hint = "use None for torch's default (25) or 'auto' to time sizes on the first steps"
        check_positive(owner, name, value, unit="MB", hint=hint)
    listed = values.get("bucket_cap_mb_list")
    if listed and value is not None:  # torch reads an empty list as none
        # torch builds every bucket from the list and ignores bucket_cap_mb: a size, or timed sizes, would not apply
        raise ValueError(
            f"{owner}: bucket_cap_mb={value!r} and bucket_cap_mb_list={listed!r} both set the bucket sizes, and "
            "DistributedDataParallel ignores bucket_cap_mb when given a list. Pass bucket_cap_mb=None to keep the "
            "list's sizes, or leave bucket_cap_mb_list out" + (" to let 'auto' time sizes" if value == "auto" else "")
        )


def _check_hook_candidates(owner: str, name: str, candidates: Any, values: Mapping[str, Any]) -> None:
    allowed = ", ".join(map(repr, TUNABLE_COMM_HOOKS))
    comm_hook = values["comm_hook"]
    if comm_hook != "auto":
        if candidates is not None:
            raise ValueError(
                f"{owner}: {name}={candidates!r} only applies with comm_hook='auto', got comm_hook={comm_hook!r}"
            )
        return
    if values.get("ddp_comm_hook") is not None:
        raise ValueError(f"{owner}: comm_hook='auto' chooses the hook itself; drop ddp_comm_hook or name a comm_hook")
    if candidates is None:
        return
    if isinstance(candidates, str) or not isinstance(candidates, (list, tuple)) or not candidates:
        raise TypeError(f"{owner}: {name} must be a non-empty list of hook names from {allowed}, got {candidates!r}")
    for hook in candidates:
        if hook in TUNABLE_COMM_HOOKS:
            continue
        message = f"{owner}: {name} may hold {allowed}, got {hook!r}"
        if hook == "powersgd":
            message += (
                " (its warm-up steps are exact all-reduces, so a short trial cannot time it); use comm_hook='powersgd'"
                " to choose it yourself"
            )
        raise ValueError(message)


_BOTH = (DDP, MGPU)

DDP_OPTIONS: tuple[Option, ...] = (
    Option(
        "bucket_cap_mb",
        BucketCapSetting,
        None,
        "DDP's gradient bucket size in MB; `None` keeps torch's default (25), also with DDP's own "
        "`bucket_cap_mb_list` (a size per bucket, which DDP applies instead: any other value with a list is refused); "
        "`'auto'` times candidate sizes on the fit's first optimizer steps and keeps the fastest.",
        _BOTH,
        Check("number > 0, `None`, `'auto'`", _check_bucket_cap),
        defaults={MGPU: "auto"},
    ),
    Option(
        "bucket_tuning_steps",
        int,
        30,
        "at most this many optimizer steps are spent timing `'auto'` settings; fits with fewer than 10 times this "
        "keep torch's default untimed.",
        _BOTH,
        integer(MIN_BUCKET_TUNING_STEPS),
    ),
    Option(
        "gradient_as_bucket_view",
        bool,
        False,
        "let gradients be views into DDP's buckets (one copy fewer, less memory).",
        _BOTH,
        boolean(),
    ),
    Option(
        "static_graph",
        bool,
        False,
        "promise DDP the set of used parameters never changes between steps.",
        _BOTH,
        boolean(),
    ),
    Option(
        "find_unused_parameters",
        bool,
        False,
        "let DDP detect parameters that got no gradient in a step (costs a graph walk).",
        _BOTH,
        boolean(),
    ),
    Option(
        "broadcast_buffers",
        bool | None,
        None,
        "`False` stops DDP copying rank 0's buffers (BatchNorm running statistics...) to every rank, at the start and "
        "before each forward: for buffers kept per rank on purpose. `None` leaves torch's default (copied). torch 2.13 "
        "deprecates it (a `FutureWarning`) for `forward_sync_buffers` (a keyword argument here), which still copies "
        "them once at the start.",
        _BOTH,
        boolean(allow_none=True),
    ),
    Option(
        "comm_hook",
        CommHookSetting,
        None,
        "gradient compression, over gloo and NCCL alike: `'fp16'`, `'bf16'`, `'powersgd'` (with error feedback), or "
        "`'auto'`: time `comm_hook_candidates` against no hook and keep one only if it is faster.",
        _BOTH,
        choice((None, "auto", *COMM_HOOK_NAMES)),
    ),
    Option(
        "comm_hook_candidates",
        list[TunableCommHook] | None,
        None,
        "the hooks `comm_hook='auto'` may choose, from `'fp16'` and `'bf16'`; `None` allows both. Only with "
        "`comm_hook='auto'`.",
        _BOTH,
        Check("list of `'fp16'`, `'bf16'`; `None`", _check_hook_candidates),
    ),
    Option("powersgd_rank", int, 1, "rank of the PowerSGD low-rank approximation.", _BOTH, integer(1)),
    Option(
        "powersgd_warmup_steps",
        int,
        100,
        "optimizer steps of exact all-reduce before PowerSGD starts compressing.",
        _BOTH,
        integer(0),
    ),
    Option(
        "start_method",
        StartMethod,
        "popen",
        "how processes are started: `'popen'` (re-run the script), `'spawn'`, `'fork'` or `'forkserver'`.",
        (DDP,),
        choice(get_args(StartMethod)),
    ),
    Option(
        "**kwargs",
        Any,
        NO_DEFAULT,
        "any further keyword argument of `torch.nn.parallel.DistributedDataParallel`, or of Lightning's "
        "`DDPStrategy` (`ddp_comm_state`, `ddp_comm_hook`, `ddp_comm_wrapper`, `model_averaging_period`), checked at "
        "construction: a misspelt name raises a `TypeError` naming the closest valid one. From a LightningCLI YAML "
        "config they go under `dict_kwargs:` next to `init_args:`.",
        _BOTH,
    ),
)
