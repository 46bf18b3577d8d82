"""``bucket_cap_mb="auto"`` against a grid of fixed DDP bucket sizes, 2 CPU processes over gloo, in one run.

For each model, every configuration trains the same steps (500 by default) with ``MultiGPUStrategy(mode="ddp")``:
``auto`` (the tuning steps included in its time), torch's default (``None``: a 1 MiB first bucket, then 25 MiB) and
the fixed sizes 1, 5, 25, 50, 100 and 200 MB. Throughput counts every step after the first, so the tuning is paid
inside the measured run. Configurations alternate order between rounds; ratios compare runs of the same round.

    python benchmarks/bucket_tuning.py                       # both models, 2 rounds
    python benchmarks/bucket_tuning.py --models small --rounds 3 --steps 300

Models: ``small``, an MLP 1024-512-512-512-10 (1.05M parameters, 4 MB of gradients, batch 32 per process);
``large``, an MLP 4096-4096-2048-10 (25.2M parameters, 96 MB of gradients, batch 16 per process).
"""

import argparse
import itertools
import json
import os
import statistics
from pathlib import Path

from _common import add_json_out, batch_clock, classifier_module, describe_machine, ratio_row, run_worker, write_rows

MODELS = {
    # name: (layer widths, batch size per process)
    "small": ((1024, 512, 512, 512, 10), 32),
    "large": ((4096, 4096, 2048, 10), 16),
}
GRID_MB = (1, 5, 25, 50, 100, 200)
SETTINGS = ("auto", "default", *map(str, GRID_MB))
RESULT_PREFIX = "BENCHMARK_RESULT "
BASELINES = {  # what auto is compared with, for run_all.py's table
    None: "the fastest fixed size of the same round",
    "default": "bucket_cap_mb=None (torch's default)",
    "25": "bucket_cap_mb=25",
}


def worker(model_name: str, setting: str, steps: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mgpu import MultiGPUStrategy

    torch.set_num_threads(1)
    widths, batch_size = MODELS[model_name]

    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(widths):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    model = classifier_module(nn.Sequential(*layers[:-1]))
    g = torch.Generator().manual_seed(0)
    samples = steps * batch_size * 2
    data = TensorDataset(torch.randn(samples, widths[0], generator=g), torch.randint(0, 10, (samples,), generator=g))
    bucket = {"auto": "auto", "default": None}[setting] if setting in ("auto", "default") else float(setting)
    clock = batch_clock(1, steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MultiGPUStrategy(mode="ddp", bucket_cap_mb=bucket),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(model, DataLoader(data, batch_size=batch_size))
    if trainer.is_global_zero:
        tuning = trainer.strategy.bucket_tuning
        seconds = clock.stop - clock.start
        result = {
            "steps_per_s": (steps - 1) / seconds,
            "seconds": seconds,
            "parameters": sum(p.numel() for p in model.parameters()),
            "tuning": None if tuning is None else {**tuning.state_dict(), "reason": tuning.reason},
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def label(setting: str) -> str:
    return setting if setting in ("auto", "default") else f"{setting} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=500)
    add_json_out(parser)
    parser.add_argument(
        "--trials-out", type=Path, metavar="PATH", help="also write each round's tuning result (ms per trial) as JSON"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.steps)
        return

    print(f"machine: {describe_machine()}")
    print(f"2 processes over gloo, {args.steps} steps each, timed after step 1, {args.rounds} alternating rounds")
    rows, trials = [], []
    for model_name in args.models:
        widths, batch_size = MODELS[model_name]
        print(f"\nmodel {model_name}: MLP {'-'.join(map(str, widths))}, batch {batch_size}/process")
        per_round: list[dict[str, dict]] = []
        for round_index in range(args.rounds):
            order = SETTINGS if round_index % 2 == 0 else tuple(reversed(SETTINGS))
            results = {
                s: run_worker(__file__, [model_name, s, "--steps", str(args.steps)], RESULT_PREFIX) for s in order
            }
            per_round.append(results)
            fixed = {s: results[s]["steps_per_s"] for s in SETTINGS if s != "auto"}
            best = max(fixed, key=fixed.get)
            auto = results["auto"]
            tuning = auto["tuning"]
            print(
                f"round {round_index + 1} ({results['auto']['parameters'] / 1e6:.2f}M parameters): "
                + ", ".join(f"{label(s)} {results[s]['steps_per_s']:.2f}" for s in SETTINGS)
                + " steps/s"
            )
            chosen = "default" if tuning["bucket_cap_mb"] is None else f"{tuning['bucket_cap_mb']:g} MB"
            print(
                f"  auto chose {chosen} ({tuning['reason']}) in {tuning['tuning_steps']} steps, "
                f"{tuning['tuning_seconds']:.1f} s = {tuning['tuning_seconds'] / auto['seconds']:.1%} of the run; "
                f"auto / best fixed ({label(best)}) {auto['steps_per_s'] / fixed[best]:.3f}, "
                f"auto / default {auto['steps_per_s'] / fixed['default']:.3f}, "
                f"auto / 25 MB {auto['steps_per_s'] / fixed['25']:.3f}"
            )
        print(f"median over rounds, model {model_name} (ratios within each round):")
        for name, reference in (("best fixed", None), ("torch default", "default"), ("fixed 25 MB", "25")):
            ratios = []
            for results in per_round:
                fixed = {s: results[s]["steps_per_s"] for s in SETTINGS if s != "auto"}
                ratios.append(results["auto"]["steps_per_s"] / fixed[reference or max(fixed, key=fixed.get)])
            print(f"  auto / {name:<13} {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
            config, metric = f"auto, {model_name}", f"steps/s vs {name}"
            rows.append(ratio_row("bucket_tuning", config, metric, ratios, "higher", BASELINES[reference]))
        trials.append({"model": model_name, "rounds": [r["auto"]["tuning"] for r in per_round]})
        shares = [r["auto"]["tuning"]["tuning_seconds"] / r["auto"]["seconds"] for r in per_round]
        print(f"  tuning time / run time  {statistics.median(shares):.1%}")
    write_rows(args.json_out, rows)
    if args.trials_out is not None:
        args.trials_out.write_text(json.dumps(trials, indent=2) + "\n")


if __name__ == "__main__":
    main()
