"""The comparison table: one row per configuration, numbers aggregated over its repeats.

Per run, the numbers are copied from its ``summary.json`` (nothing is recomputed); per
configuration they are the mean, min and max over the repeats that finished. Speed-up over the
baseline configuration is given two ways, both "higher is better":

- ``speedup_time_to_target``: baseline's mean time to the target accuracy / this one's (only
  when both reached the target in every repeat);
- ``speedup_samples_per_s``: this configuration's mean samples/s / the baseline's.

Example::

    rows = [config_row("allreduce", [run_record(summary)])]
    add_speedups(rows, baseline="allreduce")
    print(format_table(rows))
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

#: Per-run numbers copied from summary.json, and how they are aggregated.
RUN_KEYS = ("final_test_accuracy", "final_val_bpb", "time_to_target_s", "wall_time_s", "samples_per_s")
CSV_COLUMNS = (
    "label", "kind", "algorithm", "compress", "network", "status", "repeats_ok", "repeats",
    "final_test_accuracy_mean", "final_test_accuracy_min", "final_test_accuracy_max",
    "final_val_bpb_mean", "final_val_bpb_min", "final_val_bpb_max",
    "time_to_target_s_mean", "time_to_target_s_min", "time_to_target_s_max", "target_reached",
    "wall_time_s_mean", "samples_per_s_mean", "samples_per_s_min", "samples_per_s_max",
    "bytes_sent_per_worker_mean", "bytes_received_per_worker_mean",
    "speedup_time_to_target", "speedup_samples_per_s", "reason",
)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def stats(values: list[Any]) -> dict[str, float | None]:
    """Mean, min and max of the finite numbers in ``values`` (all None when there are none)."""
    nums = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not nums:
        return {"mean": None, "min": None, "max": None}
    return {"mean": _mean(nums), "min": min(nums), "max": max(nums)}


def run_record(summary: dict[str, Any], run_dir: str | Path | None = None) -> dict[str, Any]:
    """One finished run's numbers, exactly as its summary.json has them."""
    sent = summary.get("bytes_sent_per_worker") or []
    received = summary.get("bytes_received_per_worker") or []
    record: dict[str, Any] = {"run_dir": str(run_dir or summary.get("run_dir", "")), "status": "ok"}
    record.update({k: summary.get(k) for k in RUN_KEYS})
    record.update({
        "bytes_sent_per_worker": sent, "bytes_received_per_worker": received,
        "bytes_sent_per_worker_mean": _mean(sent) if sent else None,
        "bytes_received_per_worker_mean": _mean(received) if received else None,
        "samples_per_s_per_worker": summary.get("samples_per_s_per_worker"),
        "steps": summary.get("steps"), "workers": summary.get("workers"),
    })
    return record


def config_row(label: str, runs: list[dict[str, Any]], **settings: Any) -> dict[str, Any]:
    """A configuration's row from its runs' records (failed runs count as repeats, not in numbers)."""
    ok = [r for r in runs if r.get("status") == "ok"]
    row: dict[str, Any] = {"label": label, **settings, "runs": runs, "repeats": len(runs), "repeats_ok": len(ok)}
    row.setdefault("status", "ok" if ok and len(ok) == len(runs) else "failed" if not ok else "partial")
    for key in RUN_KEYS:
        row[key] = stats([r.get(key) for r in ok])
    for key in ("bytes_sent_per_worker", "bytes_received_per_worker"):  # stats of each run's mean over workers
        row[key] = stats([r.get(f"{key}_mean") for r in ok])
    row["target_reached"] = sum(1 for r in ok if r.get("time_to_target_s") is not None)
    return row


def add_speedups(rows: list[dict[str, Any]], baseline: str) -> None:
    """Fill each row's speed-ups over the row labelled ``baseline`` (None where undefined)."""
    base = next((r for r in rows if r["label"] == baseline), None)
    for row in rows:
        row["speedup_time_to_target"] = row["speedup_samples_per_s"] = None
        if base is None or row.get("repeats_ok", 0) == 0 or base.get("repeats_ok", 0) == 0:
            continue
        b_tta, tta = base["time_to_target_s"]["mean"], row["time_to_target_s"]["mean"]
        every = row["target_reached"] == row["repeats_ok"] and base["target_reached"] == base["repeats_ok"]
        if every and b_tta and tta:
            row["speedup_time_to_target"] = b_tta / tta
        b_sps, sps = base["samples_per_s"]["mean"], row["samples_per_s"]["mean"]
        if b_sps and sps:
            row["speedup_samples_per_s"] = sps / b_sps


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _range(s: dict[str, float | None], spec: str, scale: float = 1.0) -> str:
    if s["mean"] is None:
        return "-"
    text = format(s["mean"] * scale, spec)
    if s["min"] != s["max"]:
        text += f" [{format(s['min'] * scale, spec)}-{format(s['max'] * scale, spec)}]"
    return text


def format_table(rows: list[dict[str, Any]], baseline: str | None = None, target: float | None = None,
                 target_loss: float | None = None) -> str:
    """The comparison as a text table (means; [min-max] over repeats when they differ). Language
    models (runs with ``final_val_bpb`` and no accuracy) show validation bits per byte instead of
    accuracy, and the time to ``target_loss``."""
    lm = any(r.get("final_val_bpb", {}).get("mean") is not None for r in rows) and all(
        r.get("final_test_accuracy", {}).get("mean") is None for r in rows)
    if lm:
        tta_name = f"time to loss {target_loss:g}" if target_loss is not None else "time to target"
    else:
        tta_name = f"time to {target:.0%}" if target else "time to target"
    header = ["configuration", "status", "val bpb" if lm else "final acc (%)", tta_name, "samples/s",
              "MB sent/worker", "speed-up (tta)", "speed-up (samples/s)"]
    body = []
    for r in rows:
        if r["status"] == "skipped":
            body.append([r["label"], "skipped", "-", "-", "-", "-", "-", "-"])
            continue
        tta = r["time_to_target_s"]
        tta_text = "not reached" if tta["mean"] is None else _range(tta, ".1f") + " s"
        if tta["mean"] is not None and r["target_reached"] < r["repeats_ok"]:
            tta_text += f" ({r['target_reached']}/{r['repeats_ok']})"
        status = r["status"] if r["repeats"] <= 1 else f"{r['status']} {r['repeats_ok']}/{r['repeats']}"
        body.append([
            r["label"] + (" (baseline)" if r["label"] == baseline else ""), status,
            _range(r["final_val_bpb"], ".3f") if lm else _range(r["final_test_accuracy"], ".1f", 100.0), tta_text,
            _range(r["samples_per_s"], ".0f"), _range(r["bytes_sent_per_worker"], ".2f", 1e-6),
            _fmt(r.get("speedup_time_to_target"), ".2f") + ("x" if r.get("speedup_time_to_target") else ""),
            _fmt(r.get("speedup_samples_per_s"), ".2f") + ("x" if r.get("speedup_samples_per_s") else ""),
        ])
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
             for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  {r['label']}: {r['reason']}" for r in rows if r.get("reason")]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


def csv_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row flattened to the CSV columns."""
    flat: dict[str, Any] = {}
    for col in CSV_COLUMNS:
        base, _, part = col.rpartition("_")
        if part in ("mean", "min", "max") and isinstance(row.get(base), dict):
            flat[col] = row[base][part]
        else:
            flat[col] = row.get(col)
    return flat


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """One line per configuration, the columns of :data:`CSV_COLUMNS`."""
    path = Path(path)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in csv_row(row).items()})
    return path
