"""The ``distrain`` command line: argument parsing and printing only, no training logic."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from distrain.config import SECTIONS, TrainConfig, base_type, flag, leaf_fields
from distrain.errors import CheckpointError, ConfigError, DataError, DistrainError

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the flag, with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"distrain: {message} (see '{self.prog} --help')\n")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig leaf field, grouped by section; unset flags stay absent."""
    groups = {name: parser.add_argument_group(f"{name} settings") for name in SECTIONS}
    defaults = TrainConfig()
    for section, field, annotation in leaf_fields():
        kind = base_type(annotation)
        meta = field.metadata
        default = getattr(getattr(defaults, section), field.name)
        help_text = meta.get("help", "")
        if meta.get("choices"):
            help_text += f" [{'|'.join(meta['choices'])}]"
        help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": help_text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            kwargs["metavar"] = field.name.split("_")[-1].upper()
        groups[section].add_argument(flag(field.name), **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then ``--config FILE``, then flags given on the command line; validated."""
    cfg = TrainConfig.from_file(args.config) if args.config else TrainConfig()
    for _, field, _ in leaf_fields():
        if hasattr(args, field.name):
            cfg.set(field.name, getattr(args, field.name))
    return cfg.validate()


def cmd_train(args: argparse.Namespace) -> int:
    from distrain.launch import in_torchrun, launch_local, run_torchrun_worker

    cfg = config_from_args(args)
    if in_torchrun():
        summary = run_torchrun_worker(cfg)
    else:
        summary = launch_local(cfg)
    if summary is not None:
        print(format_summary(summary))
    return 0


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def format_summary(s: dict[str, Any]) -> str:
    """The final table of a run, for the terminal."""
    ttt = s.get("time_to_target_s")
    target = f"{s['target_accuracy']:.0%}"
    lines = [
        f"distrain {s['algorithm']}: {s['workers']} workers, {s['dataset']}/{s['model']}, {s['epochs']:g} epochs, global batch {s['global_batch']}",
        "",
        f"  {'final test accuracy':<22}{s['final_test_accuracy']:.4f}",
        f"  {'time to ' + target:<22}{'not reached' if ttt is None else f'{ttt:.1f} s'}",
        f"  {'wall time (training)':<22}{s['wall_time_s']:.1f} s",
        f"  {'samples/s':<22}{s['samples_per_s']:.0f}",
        "",
        f"  {'worker':<8}{'samples/s':>12}{'sent':>14}{'received':>14}{'compute':>10}{'comm':>10}",
    ]
    for r in range(s["workers"]):
        sps = s["samples_per_s_per_worker"][r]
        lines.append(f"  {r:<8}{sps or 0:>12.0f}{_mb(s['bytes_sent_per_worker'][r]):>14}"
                     f"{_mb(s['bytes_received_per_worker'][r]):>14}{s['compute_s_per_worker'][r]:>9.1f}s{s['comm_s_per_worker'][r]:>9.1f}s")
    lines += ["", f"run directory: {s['run_dir']}"]
    return "\n".join(lines)


def build_parser() -> Parser:
    parser = Parser(prog="distrain", description="Communication-efficient distributed training over slow, uneven or shared networks.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = sub.add_parser("train", help="train a model with N workers (spawned locally, or as one torchrun worker)",
                           description="Train a model. Run locally (spawns --workers processes on 127.0.0.1) or under "
                           "torchrun: torchrun --nproc-per-node N -m distrain train [flags].")
    train.add_argument("--config", default=None, metavar="FILE", help="JSON, TOML or YAML file of settings; flags override it")
    add_config_flags(train)
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="distrain: %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, DataError, CheckpointError) as exc:
        print(f"distrain: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DistrainError as exc:
        print(f"distrain: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("distrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
