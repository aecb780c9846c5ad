"""DiLoCo on a language model, over a LAN and over slow edge links, against DDP, all-reduce and torchft.

Runs the shared settings of the ``lm-lan``, ``lm-edge`` and ``lm-edge-slow`` scenarios
(``benchmarks/scenarios/lm-*.toml``: 4 workers, the ~1M-parameter GPT ``micro`` on the Python
standard library's text, inner Adam), for 256 steps each (``SETTINGS``), with these
configurations, through ``distrain compare``'s machinery (each configuration ``--repeats`` times,
repeat k with seed + k):

- ``ddp`` (torch DDP, the baseline) and ``allreduce`` (distrain's gradient all-reduce);
- ``diloco`` at H = 16, H = 64 and H = auto (``--sync-every auto``);
- at H = 64: ``streaming`` (4 fragments, each exchange overlapping 4 inner steps), ``int8``,
  ``int4`` pseudo-gradients, and SparseLoCo's arrangement (``sparseloco:0.02:decay=0.95``: the
  top 2% of each 4,096-value chunk at 2 bits with a decaying error-feedback residual, outer SGD
  with lr 1 and no momentum);
- torchft's ``DiLoCo`` and ``LocalSGD`` at H = 64 (``distrain[peers]``; skipped with the reason
  when torchft is absent), with the same model, shards, inner and outer optimizers.

Every DiLoCo configuration (torchft's too) takes the scenarios' outer step, plain averaging (outer
SGD at lr 1, no momentum): the scenario files give the hand runs that chose it over the outer
Nesterov step, whose momentum overshoots over a run of a few outer steps.

On lm-edge (``EDGE``), DDP runs with ``--stop-at-target`` (at 2.4 s of all-reduce a step it would
take 11 minutes a run, and only its time to target and step time count there), and all-reduce is
left out (DDP's bytes; its figure is lm-lan's); the same on ``lm-edge-slow``, lm-edge's job on links
of 10 Mbit/s and 20 ms (at 20 Mbit/s DDP's step is 9.6 times the compute: no method reaches the
target 10 times sooner than DDP there). ``lm-edge-drop`` is lm-edge with a bandwidth trace
(``benchmarks/traces/drop-10x.csv``) that drops every link 10 times mid-run, from 20 to 2 Mbit/s,
and runs diloco at H = 16, 64 and auto only.

Figures, per scenario (medians over repeats of per-repeat ratios, with min and max; a repeat that
never reaches the target gives no ratio and no median):

- every configuration's time to the scenario's ``target_loss``, final validation loss at equal
  tokens, bytes sent per worker per inner step, and peak link use (the most bytes any worker sent
  in one second, in Mbit/s and as a share of the emulated link);
- ``ddp_over_best_diloco``: DDP's time to target over the best distrain DiLoCo setting's (the
  setting with the lowest median time to target); target >= 10 on lm-edge and lm-edge-slow;
- ``compute_bound``: DDP's step time over the inner step's compute time (the best setting's
  ``compute_s`` per step), the speed-up a DiLoCo that never waited could reach, and
  ``share_of_compute_bound`` = ddp_over_best_diloco / compute_bound; target >= 0.8 on both;
- ``torchft_over_distrain``: torchft DiLoCo's time to target over distrain DiLoCo's at H = 64
  (plain, and the best setting at H = 64), and the difference of their final losses in percent;
  targets >= 1.2 and within 1% on both;
- ``bytes_per_step_int8_over_ddp``: target <= 1/200;
- ``diloco_loss_over_allreduce``: final validation loss of diloco H = 64 over all-reduce's at
  equal tokens; target <= 1.02 on lm-lan;
- ``auto_over_best_fixed``: auto's time to target over the best of H = 16 and H = 64; target
  <= 1.10 on lm-lan and the edge scenarios, < 1 on lm-edge-drop (auto beats every fixed H).

Timing figures need a quiet machine: run nothing else beside it. Every run's directory stays under
``benchmarks/results/diloco-<scenario>/`` for ``distrain report`` (not committed); the comparison
(``comparison.json``/``.csv``, loss-against-time and loss-against-bytes plots) is written there and
the figures to ``benchmarks/results/diloco.json`` (one entry per scenario run, merged into what the
file holds).

    python benchmarks/bench_diloco.py                                  # both scenarios, 3 repeats
    python benchmarks/bench_diloco.py --scenario lm-lan
    python benchmarks/bench_diloco.py --scenario lm-edge-slow         # the edge job on 10 Mbit/s links
    python benchmarks/bench_diloco.py --scenario lm-edge-drop         # auto when the link falls mid-run
    python benchmarks/bench_diloco.py --scenario lm-lan --repeats 1 --epochs 0.01 --only ddp,diloco-h16   # a quick look
    python benchmarks/bench_diloco.py --scenario lm-lan --only ddp     # measure DDP again, keep the other rows
    python benchmarks/bench_diloco.py --scenario lm-edge-drop --figures-only   # figures and plots again, from its runs

With ``--only``, the configurations it names are run again and replace their rows in the
scenario's comparison; the others keep the rows (and run directories) of the run before, and the
results say which (``kept_from_earlier_run``, with that run's provenance).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from provenance import check_repeats, provenance, ratio_spread, spread, write_result

from distrain.compare import Grid, comparison_plots, load_scenario, run_comparison
from distrain.config import TrainConfig
from distrain.emulation import NetworkSettings
from distrain.report import add_speedups, format_table, write_csv
from distrain.report.runs import load_run
from distrain.train.metrics import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCENARIOS = {"lm-lan": ROOT / "benchmarks" / "scenarios" / "lm-lan.toml",
             "lm-edge": ROOT / "benchmarks" / "scenarios" / "lm-edge.toml",
             "lm-edge-slow": ROOT / "benchmarks" / "scenarios" / "lm-edge-slow.toml",
             "lm-edge-drop": ROOT / "benchmarks" / "scenarios" / "lm-edge.toml"}
#: The edge scenarios: DDP stops at its target there and all-reduce is left out (:data:`EDGE`).
#: lm-edge-slow is lm-edge at 10 Mbit/s and 20 ms, the slow end of the edge links the targets are
#: set for: at lm-edge's 20 Mbit/s DDP's step is about 9.6 times the compute, below the target of
#: 10 for DDP over the best DiLoCo, which no method can then reach.
EDGE_SCENARIOS = ("lm-edge", "lm-edge-slow")
#: lm-edge-drop: lm-edge whose links fall 10 times, from 20 to 2 Mbit/s, DROP_AT_S seconds into the
#: run (the trace file), with DiLoCo at H = 16, 64 and auto only: where auto should beat every
#: fixed H, since a period fit for the link before the drop is 10 times too short after it.
DROP = {"bandwidth_trace": "benchmarks/traces/drop-10x.csv"}
DROP_CONFIGS = ["diloco-h16", "diloco-h64", "diloco-auto"]
H = 64
#: The run over the scenarios' own settings, for every configuration: 256 steps of 64 windows
#: (1,414 steps make an epoch of the text; steps are ceil(epochs x 1,414)), a multiple of H, so
#: that torchft, which syncs only at a period's end, has every step in its final model; an
#: evaluation every 16 steps on 256 validation windows spread over the validation text (time to
#: target is judged on them), the final one on all of it.
SETTINGS = {"epochs": 0.1808, "eval_every": 16 / 1414, "eval_samples": 256}
STEPS = 256
#: The configurations, in run order (fixed here before any run): label and settings over the scenario's.
CONFIGS: list[dict[str, Any]] = [
    {"label": "ddp", "baseline": "ddp"},
    {"label": "allreduce", "algorithm": "allreduce"},
    {"label": "diloco-h16", "algorithm": "diloco", "sync_every": 16},
    {"label": "diloco-h64", "algorithm": "diloco", "sync_every": H},
    {"label": "diloco-auto", "algorithm": "diloco", "sync_every": "auto"},
    {"label": "diloco-h64-streaming", "algorithm": "diloco", "sync_every": H, "fragments": 4, "overlap_steps": 4},
    {"label": "diloco-h64-int8", "algorithm": "diloco", "sync_every": H, "compress": "int8"},
    {"label": "diloco-h64-int4", "algorithm": "diloco", "sync_every": H, "compress": "int4"},
    {"label": "diloco-h64-sparseloco", "algorithm": "diloco", "sync_every": H, "compress": "sparseloco:0.02:decay=0.95",
     "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0},
    {"label": "torchft-diloco-h64", "baseline": "torchft-diloco", "sync_every": H},
    {"label": "torchft-localsgd-h64", "baseline": "torchft-localsgd", "sync_every": H},
]
#: lm-edge: DDP stops at its target (2.4 s of all-reduce a step would take it 11 minutes a run to
#: finish, and only its time to target is used there); all-reduce is left out (DDP's bytes, no
#: figure of its own there).
EDGE = {"ddp": {"stop_at_target": True}, "allreduce": None}
DILOCO = [c["label"] for c in CONFIGS if c.get("algorithm") == "diloco"]
AT_H = [c["label"] for c in CONFIGS if c.get("algorithm") == "diloco" and c.get("sync_every") == H]
EDGE_TARGETS = {"ddp_over_best_diloco": (">=", 10.0), "share_of_compute_bound": (">=", 0.8),
                "torchft_over_distrain_time": (">=", 1.2), "torchft_loss_difference_pct": ("<=", 1.0),
                "bytes_per_step_int8_over_ddp": ("<=", 1 / 200), "auto_over_best_fixed": ("<=", 1.10)}
TARGETS = {
    "lm-edge": EDGE_TARGETS,
    "lm-edge-slow": EDGE_TARGETS,
    "lm-lan": {"diloco_loss_over_allreduce": ("<=", 1.02), "auto_over_best_fixed": ("<=", 1.10)},
    "lm-edge-drop": {"auto_over_best_fixed": ("<", 1.0)},
}
WINDOW_S = 1.0  # peak link use: the most bytes sent in any window this long


def scenario_configs(name: str) -> list[dict[str, Any]]:
    """The configurations run on scenario ``name`` (the edge ones: with :data:`EDGE`'s changes;
    lm-edge-drop: :data:`DROP_CONFIGS`)."""
    if name == "lm-edge-drop":
        return [c for c in CONFIGS if c["label"] in DROP_CONFIGS]
    if name not in EDGE_SCENARIOS:
        return list(CONFIGS)
    return [{**c, **(EDGE.get(c["label"]) or {})} for c in CONFIGS if c["label"] not in EDGE or EDGE[c["label"]] is not None]


def peak_send_rate(run_dir: Path) -> float | None:
    """The most bytes per second any worker sent over a window of WINDOW_S (cumulative
    ``bytes_sent`` of its metrics lines against their time)."""
    run = load_run(run_dir)
    best = None
    for rank in run.metrics:
        points = run.series("bytes_sent", rank)
        j = 0
        for i, (t0, b0) in enumerate(points):
            j = max(j, i)
            while j < len(points) and points[j][0] < t0 + WINDOW_S:
                j += 1
            if j == len(points):
                break
            t1, b1 = points[j]
            rate = (b1 - b0) / (t1 - t0)
            best = rate if best is None else max(best, rate)
    return best


def per_run(row: dict[str, Any], out: Path) -> list[dict[str, Any] | None]:
    """Each repeat's figures (None where the run failed), in repeat order."""
    runs = []
    for record in row.get("runs", []):
        if record.get("status") != "ok":
            runs.append(None)
            continue
        summary = json.loads((out / record["run_dir"] / "summary.json").read_text())
        steps = summary["steps"]
        sent = statistics.fmean(summary["bytes_sent_per_worker"])
        compute = summary.get("compute_s_per_worker") or []
        runs.append({
            "time_to_target_s": summary.get("time_to_target_s"), "final_val_loss": summary.get("final_val_loss"),
            "final_val_bpb": summary.get("final_val_bpb"), "wall_time_s": summary["wall_time_s"], "steps": steps,
            "step_s": summary["wall_time_s"] / steps, "bytes_per_step": sent / steps,
            "compute_per_step_s": statistics.fmean(compute) / steps if compute else None,
            "peak_send_bytes_per_s": peak_send_rate(out / record["run_dir"]),
        })
    return runs


def run_configs(scenario: str, overrides: dict[str, Any], configs: list[dict[str, Any]], repeats: int, out: Path,
                script: str) -> tuple[TrainConfig, dict[str, Any]]:
    """Run ``configs`` (each ``repeats`` times, the first one the baseline) on ``scenario``'s
    links and job with ``overrides`` over its settings, into ``out``, as ``script`` (its command
    line for the comparison's record): the base configuration and the comparison."""
    grid, train, _ = load_scenario(SCENARIOS[scenario].relative_to(ROOT))
    train.update(overrides)
    base = TrainConfig.from_dict({"progress": False, **train})
    grid = Grid(algorithms=[], compress=["none"], networks=grid.networks, baselines=[], configs=configs,
                repeats=repeats, out=out, baseline=configs[0]["label"], scenario=grid.scenario)
    comparison = run_comparison(grid, base, echo=lambda line: print(line, flush=True),
                                command=" ".join(["python", script, *sys.argv[1:]]))
    return base, comparison


def column(runs: list[dict[str, Any] | None], key: str) -> list[Any]:
    return [None if r is None else r.get(key) for r in runs]


def figures(scenario: str, comparison: dict[str, Any], out: Path, link_bits_per_s: float | None) -> dict[str, Any]:
    """Scenario ``scenario``'s figures from its comparison, judged by its targets (see the module's
    docstring; lm-edge-drop's file is lm-edge's, and its comparison is named so)."""
    runs = {row["label"]: per_run(row, out) for row in comparison["configs"] if row.get("status") != "skipped"}
    skipped = {row["label"]: row.get("reason") for row in comparison["configs"] if row.get("status") == "skipped"}
    configs = {}
    for label, rs in runs.items():
        peak = spread(column(rs, "peak_send_bytes_per_s"))
        configs[label] = {
            "repeats_ok": sum(r is not None for r in rs),
            **{key: spread(column(rs, key)) for key in ("steps", "time_to_target_s", "final_val_loss", "final_val_bpb",
                                                       "wall_time_s", "step_s", "bytes_per_step", "compute_per_step_s")},
            "peak_link_mbit_s": spread([None if v is None else 8 * v / 1e6 for v in peak["values"]]),
            "peak_link_share": (spread([None if v is None else 8 * v / link_bits_per_s for v in peak["values"]])
                                if link_bits_per_s else None),
        }
    result: dict[str, Any] = {"configs": configs, "skipped": skipped}

    def ratio(a: str, b: str, key: str) -> dict[str, Any] | None:
        return ratio_spread(column(runs[a], key), column(runs[b], key)) if a in runs and b in runs else None

    def fastest(labels: list[str]) -> str | None:
        reached = [(configs[c]["time_to_target_s"]["median"], c) for c in labels
                   if c in configs and configs[c]["time_to_target_s"]["median"] is not None]
        return min(reached)[1] if reached else None

    best = fastest(DILOCO)
    result["best_diloco"] = best
    if best is not None and "ddp" in runs:
        result["ddp_over_best_diloco"] = ratio("ddp", best, "time_to_target_s")
        bound = ratio_spread(column(runs["ddp"], "step_s"), column(runs[best], "compute_per_step_s"))
        result["compute_bound"] = bound
        share = [a / b if a is not None and b else None
                 for a, b in zip(result["ddp_over_best_diloco"]["values"], bound["values"], strict=True)]
        result["share_of_compute_bound"] = ratio_spread(share, [1.0] * len(share))
    best_at_h = fastest(AT_H)
    result["best_diloco_at_h64"] = best_at_h
    result["torchft_over_distrain_time"] = ratio("torchft-diloco-h64", "diloco-h64", "time_to_target_s")
    if best_at_h is not None:
        result["torchft_over_best_at_h64_time"] = ratio("torchft-diloco-h64", best_at_h, "time_to_target_s")
    loss = ratio("torchft-diloco-h64", "diloco-h64", "final_val_loss")
    if loss is not None:
        result["torchft_loss_difference_pct"] = spread([None if v is None else 100 * abs(v - 1) for v in loss["values"]])
    result["bytes_per_step_int8_over_ddp"] = ratio("diloco-h64-int8", "ddp", "bytes_per_step")
    result["diloco_loss_over_allreduce"] = ratio("diloco-h64", "allreduce", "final_val_loss")
    fixed = fastest(["diloco-h16", "diloco-h64"])
    result["best_fixed_h"] = fixed
    if fixed is not None:
        result["auto_over_best_fixed"] = ratio("diloco-auto", fixed, "time_to_target_s")
    result["targets"] = {}
    for name, (op, bound) in TARGETS.get(scenario, {}).items():
        value = result.get(name)
        median = value.get("median") if isinstance(value, dict) else None
        met = None if median is None else {">=": median >= bound, "<=": median <= bound, "<": median < bound}[op]
        result["targets"][name] = {"target": f"{op} {bound:g}", "median": median, "met": met}
    return result


def report_targets(name: str, found: dict[str, Any]) -> None:
    for key, target in found["targets"].items():
        print(f"{name} {key}: median {target['median']} (target {target['target']}): "
              f"{'met' if target['met'] else 'NOT met' if target['met'] is not None else 'no figure'}", flush=True)


def kept_provenance(earlier: dict, kept: list[str]) -> dict:
    """Which run measured each row an ``--only`` rerun keeps: the earlier run's, or, for a row it
    had kept in turn, the run before it (``provenance_of``, by configuration)."""
    older = earlier.get("kept_from_earlier_run") or {}
    before = older.get("provenance_of") or dict.fromkeys(older.get("configs", []), older.get("provenance"))
    return {"configs": kept, "provenance": earlier.get("provenance"),
            "provenance_of": {c: before.get(c, earlier.get("provenance")) for c in kept}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append",
                        help="a scenario to run (repeatable; default: lm-lan, then lm-edge)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=float, default=None, help="override the scenarios' epochs (a quick look)")
    parser.add_argument("--only", default=None, help="comma-separated configuration labels (a quick look)")
    parser.add_argument("--figures-only", action="store_true",
                        help="compute the figures and draw the plots again from the runs already made (the "
                             "scenario's comparison.json and run directories), running nothing")
    parser.add_argument("--out", type=Path, default=RESULTS / "diloco.json",
                        help="the figures' file; the runs go beside it, into diloco-<scenario>/")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    os.chdir(ROOT)
    only = None if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()]
    labels = [c["label"] for c in CONFIGS]
    if only is not None and (not only or set(only) - set(labels)):
        parser.error(f"--only: choose among {', '.join(labels)}")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    earlier = results.pop("provenance", None)
    for entry in results.values():  # each scenario keeps the provenance of the run that measured it
        if isinstance(entry, dict) and earlier is not None:
            entry.setdefault("provenance", earlier)
    for name in args.scenario or ["lm-lan", "lm-edge"]:
        grid, train, _ = load_scenario(SCENARIOS[name].relative_to(ROOT))  # recorded as given: repository-relative
        train.update(SETTINGS)
        if name == "lm-edge-drop":
            train.update(DROP)  # a repository-relative path: the script runs from the repository's root
        if args.epochs is not None:
            train["epochs"] = args.epochs
        base = TrainConfig.from_dict({"progress": False, **train})
        out = args.out.parent / f"diloco-{name}"
        # the scenario's link: its network preset, under the bandwidth its settings give (lm-edge-slow)
        link = NetworkSettings.from_config(dataclasses.replace(base.network, network=grid.networks[0])).bandwidth
        if args.figures_only:  # the runs' entry keeps its provenance; the figures' commit is added
            if name not in results or not (out / "comparison.json").exists():
                parser.error(f"--figures-only: no earlier run of {name} in {args.out} and {out}")
            earlier_runs = json.loads((out / "comparison.json").read_text())
            found = figures(name, earlier_runs, out, link)
            comparison_plots(earlier_runs["configs"], out)  # drawn again, by this commit's plotting
            results[name] = {**results[name], **found, "figures_computed_by": provenance(sys.argv)}
            write_result(args.out, results, argv=sys.argv)
            report_targets(name, found)
            continue
        every = scenario_configs(name)
        these = [c for c in every if only is None or c["label"] in only]
        grid = Grid(algorithms=[], compress=["none"], networks=grid.networks, baselines=[], configs=these,
                    repeats=args.repeats, out=out, baseline=these[0]["label"], scenario=grid.scenario)
        print(f"=== {name}: {len(these)} configurations x {args.repeats} repeats -> {out}", flush=True)
        start = time.perf_counter()
        before = (json.loads((out / "comparison.json").read_text())
                  if only is not None and (out / "comparison.json").exists() else None)
        if before is not None:  # the plots are drawn again over every row's runs: refuse before running any
            missing = [r["run_dir"] for row in before["configs"] if row["label"] not in only for r in row["runs"]
                       if r.get("status") == "ok" and not (out / r["run_dir"] / "summary.json").exists()]
            if missing:
                parser.error(f"--only keeps the other rows of {out.name}/comparison.json and draws the plots over "
                             f"their runs, whose directories are not here ({len(missing)}, e.g. {missing[0]}; "
                             "results keep only the comparison): copy them in from the run that measured them, "
                             "or measure every configuration")
        if before is not None:  # until the merge below: an interrupted rerun leaves the rows it replaces here
            write_json_atomic(out / "comparison-before-only.json", before)
        comparison = run_comparison(grid, base, echo=lambda line: print(line, flush=True),
                                    command=" ".join(["python", "benchmarks/bench_diloco.py", *sys.argv[1:]]))
        kept: list[str] = []
        if before is not None:  # --only: the other configurations keep the rows (and runs) measured before
            fresh = {row["label"]: row for row in comparison["configs"]}
            kept = [row["label"] for row in before["configs"] if row["label"] not in fresh]
            comparison["configs"] = [fresh.pop(row["label"], row) for row in before["configs"]] + list(fresh.values())
            # every row's speed-ups over the baseline of the run before, not over the first label of --only
            comparison["baseline"] = before.get("baseline") or comparison["baseline"]
            add_speedups(comparison["configs"], comparison["baseline"])
            comparison["table"] = format_table(comparison["configs"], baseline=comparison["baseline"],
                                               target=base.run.target_accuracy, target_loss=base.run.target_loss)
            comparison["plots"] = [p.name for p in comparison_plots(comparison["configs"], out)]  # every row's runs
            write_json_atomic(out / "comparison.json", {k: v for k, v in comparison.items() if k not in ("table", "files")})
            write_csv(comparison["configs"], out / "comparison.csv")
            (out / "comparison-before-only.json").unlink()
        found = figures(name, comparison, out, link)
        if kept:
            found["kept_from_earlier_run"] = kept_provenance(results.get(name) or {}, kept)
        found.update({"provenance": provenance(sys.argv), "scenario_file": str(SCENARIOS[name].relative_to(ROOT)),
                      "repeats": args.repeats,
                      "epochs": base.run.epochs,
                      "configurations": [c for c in every if c["label"] in {r["label"] for r in comparison["configs"]}],
                      "network": grid.networks[0], "bandwidth_trace": train.get("bandwidth_trace"),
                      "link_bits_per_s": link, "elapsed_s": time.perf_counter() - start})
        results[name] = found
        write_result(args.out, results, argv=sys.argv)
        saved = {k: v for k, v in comparison.items() if k not in ("table", "files")}
        if kept:
            saved["kept_from_earlier_run"] = found["kept_from_earlier_run"]
        write_result(out / "comparison.json", saved, argv=sys.argv)  # with its provenance, paths relative
        print(comparison["table"], flush=True)
        report_targets(name, found)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
