"""``python -m lightning_mgpu``: the ``env``, ``check``, ``config``, ``plan`` and ``export`` commands.

``env`` reports what a multi-GPU run depends on, and ``check`` measures and verifies it on this machine.

``config`` imports neither torch nor Lightning (the package skips its strategy registration under ``python -m``, see
``lightning_mgpu/__init__.py``), so it answers at once; ``env`` imports what its report needs when it runs.
"""

import argparse
import sys
from collections.abc import Sequence

from lightning_mgpu.configs import CONFIG_NAMES, config_path, config_summary


def _devices(text: str) -> int | str:
    # counted by lightning_mgpu.core.devices, as the Trainer counts them: "0,1" and "auto" stay strings
    try:
        return int(text)
    except ValueError:
        return text


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line, and each command's own parser (for its errors)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_mgpu", description="lightning_mgpu tools")
    commands = parser.add_subparsers(dest="command", metavar="command")
    env = commands.add_parser(
        "env", help="report GPUs, backends, launch context and the strategy MultiGPUStrategy would choose"
    )
    # checked by environment_report, so that building this parser imports no torch
    env.add_argument("--accelerator", default="auto", help="the Trainer's accelerator: auto, cpu, cuda or gpu")
    env.add_argument("--devices", type=_devices, default="auto", help="the Trainer's devices: N, -1 or auto")
    env.add_argument("--nodes", type=int, default=1, help="the Trainer's num_nodes")
    check = commands.add_parser(
        "check",
        help="measure all-reduce, matmul and copy speed and verify sync-BN, NaNSkip and NVML on this machine; "
        "exits 1 on a failure",
    )
    check.add_argument("--processes", type=int, default=None, help="default: one per visible GPU, or 2 on CPU")
    check.add_argument("--max-mb", type=int, default=256, help="the largest all-reduce, in MB (from 4 KB up)")
    check.add_argument("--checks", nargs="+", default=None, help="a subset of the checks (default: all)")
    check.add_argument("--gpu-tests", action="store_true", help="also run the repo's CUDA tests (pytest -m cuda)")
    config = commands.add_parser("config", help="list the shipped LightningCLI configs, or print one's path")
    config.add_argument("name", nargs="?", choices=CONFIG_NAMES, help="print this config's path (for --config)")
    export = commands.add_parser(
        "export", help="turn a sharded (FSDP) or Lightning checkpoint into one file holding the model's state dict"
    )
    export.add_argument("checkpoint", help="a torch distributed checkpoint folder or a checkpoint file")
    export.add_argument("out", help="the file to write (torch.save of the state dict)")
    export.add_argument("--prefix", default="", help="keep only keys starting with this, without it (e.g. model.)")
    export.add_argument("--ema", action="store_true", help="write the EMA callback's averaged weights")
    plan = commands.add_parser("plan", help="the memory plan of a LightningModule: DDP or how much FSDP sharding fits")
    plan.add_argument("--model", required=True, help="the LightningModule's class, package.module:ClassName")
    plan.add_argument("--init-args", default=None, help="its constructor's arguments as a JSON object")
    plan.add_argument("--devices", type=int, default=1, help="processes that would train (the world size)")
    plan.add_argument("--budget-mb", type=float, default=None, help="memory per device; default: the device's")
    plan.add_argument("--shard-units", nargs="+", default=None, help="class names of the sharding units")
    return parser, {"env": env, "check": check, "config": config, "export": export, "plan": plan}


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.name is not None:
        print(config_path(args.name))
    else:
        for name in CONFIG_NAMES:
            print(f"{name:<16} {config_summary(name)}\n{'':<16} {config_path(name)}")
    return 0


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mgpu.commands.check import CHECKS, run_check

    unknown = sorted(set(args.checks or ()) - set(CHECKS))
    if unknown:
        parser.error(f"--checks: unknown {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if args.processes is not None and args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    if args.max_mb < 1:
        parser.error(f"--max-mb must be at least 1, got {args.max_mb}")
    return run_check(args.processes, args.max_mb, args.checks or CHECKS, args.gpu_tests)


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mgpu.commands.plan import model_plan, parse_init_args

    try:
        memory_plan = model_plan(
            args.model, parse_init_args(args.init_args), args.devices, args.budget_mb, args.shard_units
        )
    except ValueError as err:
        parser.error(str(err))
    print(memory_plan.table())
    return 0 if memory_plan.chosen is not None else 1


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mgpu.fsdp.sharded_checkpoint import export_state_dict

    try:
        state = export_state_dict(args.checkpoint, args.out, prefix=args.prefix, ema=args.ema)
    except (FileNotFoundError, KeyError) as err:
        parser.error(str(err))
    print(f"wrote {len(state)} tensors ({sum(t.numel() for t in state.values())} elements) to {args.out}")
    return 0


def _env(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_mgpu.commands.env import environment_report

    try:
        print(environment_report(accelerator=args.accelerator, devices=args.devices, num_nodes=args.nodes))
    except ValueError as err:
        parser.error(str(err))
    return 0


_COMMANDS = {"config": _config, "check": _check, "plan": _plan, "export": _export, "env": _env}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser, commands = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return _COMMANDS[args.command](args, commands[args.command])


if __name__ == "__main__":
    sys.exit(main())
