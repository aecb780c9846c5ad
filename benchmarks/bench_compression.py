"""Gradient compression: codec speed and error, then accuracy and bytes of real training runs.

Part 1, codecs: every compressor on one tensor of ``--numel`` float32 values (a gradient-like
Gaussian): median compress + decompress time, payload bytes (and the fraction of dense), and the
relative error ||decompress(compress(x)) - x|| / ||x||.

Part 2, training: each job (``--jobs``) is run dense and with each variant (``--variants``),
through ``launch_local`` exactly as ``distrain train`` runs it, and reports final test accuracy,
its gap to dense in points, bytes sent per worker per step (Transport counters: summary.json
``bytes_sent_per_worker`` / steps), that as a fraction of dense, wall time and time to target.
Each run is repeated ``--repeats`` times (3 by default); a row holds the medians, and
``repeats`` the median, minimum and maximum of accuracy, wall time and time to target.

    python benchmarks/bench_compression.py                          # codecs + all jobs
    python benchmarks/bench_compression.py --jobs mlp1m --variants group_topk
    python benchmarks/bench_compression.py --skip-train --numel 4000000
    python benchmarks/bench_compression.py --network edge           # once the preset exists

``--network`` is passed to every run's config (``--network`` of ``distrain train``), so the same
comparison runs over an emulated network; a DDP baseline would be one more entry of VARIANTS.
Writes ``benchmarks/results/compression.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from provenance import check_repeats, spread, write_result

from distrain.compress import CompressInfo, build_compressor, payload_nbytes
from distrain.config import TrainConfig
from distrain.launch import launch_local

RESULTS = Path(__file__).parent / "results"

CODECS = ["none", "fp16", "bf16", "qsgd:8bit", "qsgd:4bit", "randomk:0.01", "topk:0.01", "group_topk:0.01"]

JOBS: dict[str, dict[str, Any]] = {
    "mnist1d": {},  # the default job: 4 workers, cnn1d, 15 epochs
    "digits": {"dataset": "digits", "model": "cnn2d", "epochs": 20},  # 4 workers
    "mlp1m": {"workers": 4, "model": "mlp", "model_width": 974, "epochs": 1},  # 999,334 parameters
}

# The recipes for 1% on small models: momentum correction (default on), dense 1-D tensors
# (always), and one dense epoch (warmup1), or 2 dense epochs then the ratio falling from 1 to
# 0.01 over 3 epochs (warmup).
WARMUP = {"density_warmup_epochs": 2.0, "density_decay_epochs": 3.0}
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {"compress": "none"},
    "group_topk": {"compress": "group_topk:0.01"},
    "group_topk+warmup1": {"compress": "group_topk:0.01", "density_warmup_epochs": 1.0, "density_decay_epochs": 0.0},
    "group_topk+warmup": {"compress": "group_topk:0.01", **WARMUP},
    "group_topk+nomc": {"compress": "group_topk:0.01", "momentum_correction": "off"},
    "group_topk+ring": {"compress": "group_topk:0.01", "sparse_collective": "ring"},
    "topk": {"compress": "topk:0.01"},
    "randomk": {"compress": "randomk:0.01"},
    "qsgd4": {"compress": "qsgd:4bit"},
    "fp16": {"compress": "fp16"},
}
DEFAULT_VARIANTS = {"mnist1d": "group_topk,group_topk+warmup1,group_topk+warmup",
                    "digits": "group_topk,group_topk+warmup1,group_topk+warmup",
                    "mlp1m": "group_topk,group_topk+ring"}


def bench_codecs(numel: int, repeats: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for spec in CODECS:
        compressor = build_compressor(spec, error_feedback=False)
        times = []
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            payload, ctx = compressor.compress(x, CompressInfo(step=step))
            y = compressor.decompress(payload, ctx)
            times.append(time.perf_counter() - t0)
        nbytes = payload_nbytes(payload)
        rows.append({"codec": spec, "ms": 1e3 * statistics.median(times[1:]), "bytes": nbytes,
                     "fraction_of_dense": nbytes / (4 * numel),
                     "relative_error": float((y - x).norm() / x.norm())})
    return rows


def run_job(job: str, variant: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Median of ``--repeats`` runs of one job and variant (accuracy, bytes, times)."""
    runs = [run_once(job, variant, args, tmp / f"{job}-{variant}-{repeat}") for repeat in range(args.repeats)]
    row = {k: v for k, v in runs[0].items() if k not in ("final_test_accuracy", "wall_time_s", "time_to_target_s")}
    row["repeats"] = {key: spread([r[key] for r in runs]) for key in ("final_test_accuracy", "wall_time_s", "time_to_target_s",
                                                                   "bytes_per_worker_per_step")}
    row.update({key: stat["median"] for key, stat in row["repeats"].items()})
    return row


def run_once(job: str, variant: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    # a variant without a warm-up of its own compresses from the first step
    no_warmup = {"density_warmup_epochs": 0.0, "density_decay_epochs": 0.0}
    settings = {**JOBS[job], **no_warmup, **VARIANTS[variant], "progress": False, "run_dir": str(run_dir)}
    if args.epochs is not None:
        settings["epochs"] = args.epochs
    if args.network:
        settings["network"] = args.network
    cfg = TrainConfig.from_dict(settings).validate()
    summary = launch_local(cfg)
    steps = summary["steps"]
    per_step = [b / steps for b in summary["bytes_sent_per_worker"]]
    return {"job": job, "variant": variant, "settings": {k: v for k, v in settings.items() if k != "run_dir"},
            "steps": steps, "final_test_accuracy": summary["final_test_accuracy"],
            "bytes_per_worker_per_step": statistics.mean(per_step), "max_bytes_per_worker_per_step": max(per_step),
            "wall_time_s": summary["wall_time_s"], "time_to_target_s": summary["time_to_target_s"],
            "target_accuracy": summary["target_accuracy"]}


def print_codecs(rows: list[dict[str, Any]], numel: int) -> None:
    print(f"codecs on {numel:,} float32 values (compress + decompress, one thread)")
    print(f"  {'codec':<18}{'ms':>9}{'bytes':>12}{'of dense':>10}{'rel. error':>12}")
    for r in rows:
        print(f"  {r['codec']:<18}{r['ms']:>9.2f}{r['bytes']:>12,}{r['fraction_of_dense']:>10.2%}{r['relative_error']:>12.4f}")


def print_runs(rows: list[dict[str, Any]]) -> None:
    print(f"  {'job':<9}{'variant':<22}{'accuracy':>9}{'gap':>7}{'bytes/step':>13}{'of dense':>10}{'wall':>8}")
    for r in rows:
        gap = f"{100 * r['gap_to_dense']:+.2f}" if r.get("gap_to_dense") is not None else ""
        frac = f"{r['bytes_fraction_of_dense']:.2%}" if r.get("bytes_fraction_of_dense") is not None else ""
        print(f"  {r['job']:<9}{r['variant']:<22}{r['final_test_accuracy']:>9.4f}{gap:>7}"
              f"{r['bytes_per_worker_per_step']:>13,.0f}{frac:>10}{r['wall_time_s']:>7.1f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="mnist1d,digits,mlp1m", help=f"comma-separated: {', '.join(JOBS)}")
    parser.add_argument("--variants", default=None, help=f"comma-separated, besides dense: {', '.join(VARIANTS)} "
                        "(default per job: " + "; ".join(f"{k}: {v}" for k, v in DEFAULT_VARIANTS.items()) + ")")
    parser.add_argument("--epochs", type=float, default=None, help="override every job's epochs")
    parser.add_argument("--network", default=None, help="emulated network preset for every run (e.g. edge)")
    parser.add_argument("--numel", type=int, default=1_000_000, help="codec benchmark tensor size")
    parser.add_argument("--repeats", type=int, default=3, help="training runs per job and variant")
    parser.add_argument("--codec-repeats", type=int, default=5, help="codec benchmark repeats")
    parser.add_argument("--skip-codecs", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "compression.json"))
    args = parser.parse_args()
    check_repeats(parser, args.repeats)

    out: dict[str, Any] = {"machine": {"platform": platform.platform(), "torch": torch.__version__},
                           "network": args.network or "none", "codecs": [], "runs": []}
    if not args.skip_codecs:
        out["codecs"] = bench_codecs(args.numel, args.codec_repeats)
        print_codecs(out["codecs"], args.numel)
    if not args.skip_train:
        with tempfile.TemporaryDirectory() as tmp:
            for job in [j for j in args.jobs.split(",") if j]:
                variants = ["dense", *(args.variants or DEFAULT_VARIANTS.get(job, "group_topk")).split(",")]
                rows = [run_job(job, v, args, Path(tmp)) for v in dict.fromkeys(variants)]
                dense = rows[0]
                for r in rows:
                    r["gap_to_dense"] = r["final_test_accuracy"] - dense["final_test_accuracy"]
                    r["bytes_fraction_of_dense"] = r["bytes_per_worker_per_step"] / dense["bytes_per_worker_per_step"]
                out["runs"] += rows
                print_runs(rows)
    print(f"wrote {write_result(args.out, out)}")


if __name__ == "__main__":
    main()
