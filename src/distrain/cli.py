"""The ``distrain`` command line: argument parsing and printing only, no training logic."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrain.config import (
    AUTO,
    SECTIONS,
    TASK_DEFAULTS,
    TrainConfig,
    base_type,
    choices_of,
    flag,
    leaf_fields,
)
from distrain.errors import CheckpointError, ConfigError, DataError, DistrainError, Interrupted
from distrain.launch.preload import start_early as start_starter
from distrain.runtime.forkserver import start_early
from distrain.runtime.process import EXIT_BAD_INPUT, freeze_at_exit


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the flag, with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"distrain: {message} (see '{self.prog} --help')\n")


def add_config_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                     sections: tuple[str, ...] = tuple(SECTIONS)) -> None:
    """One flag per TrainConfig leaf field of ``sections`` (but those in ``exclude``), grouped by
    section; unset flags stay absent."""
    groups = {name: parser.add_argument_group(f"{name} settings") for name in sections}
    defaults = TrainConfig()
    for section, field, annotation in leaf_fields():
        if field.name in exclude or section not in sections:
            continue
        kind = base_type(annotation)
        meta = field.metadata
        default = getattr(getattr(defaults, section), field.name)
        help_text = meta.get("help", "")
        choices = choices_of(field)
        if choices:
            help_text += f" [{'|'.join(choices)}]"
        by_task = "".join(f"; {task}: {values[field.name]}" for task, values in TASK_DEFAULTS.items()
                          if field.name in values)
        help_text += f" (default: {default}{by_task})"
        kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS, "help": help_text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _or_auto(kind) if field.metadata.get("auto") else kind
            kwargs["metavar"] = field.name.split("_")[-1].upper()
        groups[section].add_argument(flag(field.name), **kwargs)


def _or_auto(kind: type) -> Callable[[str], Any]:
    """An argparse type: ``auto``, or a value of ``kind``."""
    def parse(text: str) -> Any:
        if text == AUTO:
            return AUTO
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} or {AUTO}, got {text!r}") from None

    return parse


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then ``--config FILE``, then flags given on the command line; validated."""
    cfg = TrainConfig.from_file(args.config) if args.config else TrainConfig()
    for _, field, _ in leaf_fields():
        if hasattr(args, field.name):
            cfg.set(field.name, getattr(args, field.name))
    from distrain.assemble import check_in_effect

    cfg.validate()
    check_in_effect(cfg)
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    from distrain.launch import in_torchrun, launch_local, run_torchrun_worker

    cfg = config_from_args(args)
    if in_torchrun():
        summary = run_torchrun_worker(cfg)
    else:
        summary = launch_local(cfg)
    if summary is not None and summary.get("already_finished"):
        from distrain.train.resume import finished_message, time_budget

        print(f"distrain: {finished_message(summary, cfg.run.epochs, time_budget(cfg))}")
    elif summary is not None:
        print(format_summary(summary))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from distrain.launch.script import Nodes, Target, launch_script

    if args.module is None and not args.target:
        raise ConfigError("SCRIPT", "name the training script to run (or -m MODULE)")
    target = (Target(module=args.module, args=list(args.target)) if args.module is not None
              else Target(script=args.target[0], args=list(args.target[1:])))
    settings = {f.name: getattr(args, f.name) for _, f, _ in leaf_fields()
                if hasattr(args, f.name) and f.name not in ("servers", "min_workers", "max_restarts")}  # below
    settings["timeout"] = args.timeout
    if args.min_workers is not None:
        settings["min_workers"] = args.min_workers
    if args.servers:  # the last --servers ranks serve: wrap() makes them parameter servers
        settings.update(algorithm="ps", servers=args.servers)
    nodes = Nodes(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr, join=args.join)
    return launch_script(target, args.workers, settings, master_port=args.master_port, timeout=args.timeout,
                         servers=args.servers, max_restarts=args.max_restarts, nodes=nodes, preload=not args.no_preload)


# Settings that `distrain compare` varies (as lists) or sets per run, instead of single flags.
COMPARE_OWN = ("algorithm", "compress", "network", "run_dir", "name")


def cmd_compare(args: argparse.Namespace) -> int:
    from distrain.compare import (
        Grid,
        command_line,
        default_out,
        load_scenario,
        run_comparison,
        split_list,
    )

    # Shared settings: defaults (no progress bars), then the scenario's [train], --config FILE, flags.
    grid, settings, name = load_scenario(args.scenario) if args.scenario else (Grid(), {}, "compare")
    if args.config:
        from distrain.config import read_config_file

        settings = {**flat_settings(settings), **flat_settings(read_config_file(args.config))}
    cfg = TrainConfig.from_dict({"progress": False, **flat_settings(settings)})
    for _, field, _ in leaf_fields():
        if hasattr(args, field.name) and field.name not in COMPARE_OWN:
            cfg.set(field.name, getattr(args, field.name))
    for dest, attr, flag_name in (("algorithms", "algorithms", "--algorithms"), ("compressors", "compress", "--compress"),
                                  ("networks", "networks", "--network"), ("baselines", "baselines", "--baselines")):
        if getattr(args, dest) is not None:
            setattr(grid, attr, split_list(getattr(args, dest), flag_name))
    if args.algorithms is not None:
        grid.skip_unknown = False  # names typed on the command line must exist
    grid.repeats = args.repeats if args.repeats is not None else grid.repeats
    grid.baseline = args.baseline or grid.baseline
    grid.keep_checkpoints = args.keep_checkpoints
    grid.out = args.out or default_out(name)
    claim_compare_out(Path(grid.out), cfg)
    comparison = run_comparison(grid, cfg, echo=lambda line: print(line, flush=True), command=command_line())
    print()
    print(comparison["table"])
    print()
    for path in comparison["files"]:
        print(f"wrote {path}")
    return 0 if any(row["repeats_ok"] for row in comparison["configs"]) else 1  # 1: nothing ran


def claim_compare_out(out: Path, cfg: TrainConfig) -> None:
    """Refuse, before any run, an ``--out`` that holds an earlier comparison unless ``--overwrite``
    (each of its runs would be deleted as the new grid reached it), and ``--resume``: every run
    of a comparison starts afresh, so a resumed one would be deleted and trained again."""
    if cfg.run.resume.strip().lower() not in ("", "none"):
        raise ConfigError("--resume", f"distrain compare starts every run afresh; drop --resume {cfg.run.resume} (a "
                          "comparison cannot be continued: run the configurations still missing into another --out)")
    if (out / "comparison.json").exists() and not cfg.run.overwrite:
        raise ConfigError("--out", f"{str(out)!r} holds an earlier comparison (comparison.json), whose runs would be "
                          "deleted; pick another --out, or replace it with --overwrite")


def flat_settings(values: dict[str, Any]) -> dict[str, Any]:
    """``{section: {field: v}}`` and ``{field: v}`` alike -> ``{field: v}``, so files can be merged."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            out.update(value)
        else:
            out[key] = value
    return out


def cmd_report(args: argparse.Namespace) -> int:
    from distrain.report import report

    labels: dict[str, str] = {}
    for item in args.label or []:
        directory, sep, name = item.partition("=")
        if not sep or not directory or not name:
            raise ConfigError("--label", f"must look like RUN_DIR=NAME, got {item!r}")
        labels[directory] = name
    files, table = report(args.runs, out_dir=args.out, baseline=args.baseline, labels=labels)
    print(table)
    print()
    for path in files:
        print(f"wrote {path}")
    return 0


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def format_summary(s: dict[str, Any]) -> str:
    """The final table of a run, for the terminal."""
    ttt = s.get("time_to_target_s")
    accuracy, loss = s.get("final_test_accuracy"), s.get("final_test_loss")
    if s.get("target_loss") is not None:
        target = f"loss {s['target_loss']:g}"
    else:
        target = f"{s['target_accuracy']:.0%}" if accuracy is not None else "target"
    final = (f"  {'final test accuracy':<22}{accuracy:.4f}" if accuracy is not None
             else f"  {'final test loss':<22}{float('nan') if loss is None else loss:.4g}")
    if s.get("final_val_bpb") is not None:  # a language model: bits per byte, against a bigram model's
        bigram = s.get("bigram_val_bpb")
        final += f"\n  {'val bits per byte':<22}{s['final_val_bpb']:.3f}" + (
            f" (bigram model: {bigram:.3f})" if bigram is not None else "")
    lines = [
        f"distrain {s['algorithm']}: {s['workers']} workers, {s['dataset']}/{s['model']}"
        + (f" ({s['model_parameters']:,} parameters)" if s.get("model_parameters") else "")
        + f", {s['epochs']:g} epochs, global batch {s['global_batch']}",
        "",
        final,
        f"  {'time to ' + target:<22}{'not reached' if ttt is None else f'{ttt:.1f} s'}",
        f"  {'wall time (training)':<22}{s['wall_time_s']:.1f} s",
        f"  {'samples/s':<22}{s['samples_per_s'] or 0:.0f}",
        *([f"  {'tokens/s':<22}{s['tokens_per_s'] or 0:.0f}"] if "tokens_per_s" in s else []),
        "",
        f"  {'worker':<8}{'samples/s':>12}{'sent':>14}{'received':>14}{'compute':>10}{'comm wait':>11}",
    ]
    for r in range(s["workers"]):
        sps = s["samples_per_s_per_worker"][r]
        lines.append(f"  {r:<8}{sps or 0:>12.0f}{_mb(s['bytes_sent_per_worker'][r]):>14}"
                     f"{_mb(s['bytes_received_per_worker'][r]):>14}{s['compute_s_per_worker'][r]:>9.1f}s{s['exposed_comm_s_per_worker'][r]:>10.1f}s")
    lines += ["", f"run directory: {s['run_dir']}"]
    return "\n".join(lines)


def build_parser() -> Parser:
    from distrain import __version__

    parser = Parser(prog="distrain", description="Communication-efficient distributed training over slow, uneven or shared networks.")
    parser.add_argument("--version", action="version", version=f"distrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = sub.add_parser("train", help="train a model with N workers (spawned locally, or as one torchrun worker)",
                           description="Train a model. Run locally (spawns --workers processes on 127.0.0.1) or under "
                           "torchrun: torchrun --nproc-per-node N -m distrain train [flags].")
    train.add_argument("--config", default=None, metavar="FILE", help="JSON, TOML or YAML file of settings; flags override it")
    add_config_flags(train)
    train.set_defaults(func=cmd_train)
    compare = sub.add_parser("compare", help="run a grid of algorithms x compressors x networks (and PyTorch baselines) and compare",
                             description="Run every configuration of the grid on the same model, data and seed, one after "
                             "another, each in its own run directory under --out; then print a table and write "
                             "comparison.json, comparison.csv and plots. Every train flag is accepted and shared.")
    compare.add_argument("--algorithms", default=None, metavar="LIST", help="comma-separated algorithms (default: allreduce)")
    compare.add_argument("--compress", default=None, metavar="LIST", dest="compressors", help="comma-separated compressor specs tried with every algorithm (default: none)")
    compare.add_argument("--network", default=None, metavar="LIST", dest="networks", help="comma-separated network presets (default: none)")
    compare.add_argument("--baselines", default=None, metavar="LIST", help="PyTorch and torchft baselines, run once per network: ddp, "
                         "ddp-fp16, ddp-powersgd[:RANK], localsgd[:PERIOD], torchft-diloco[:H], torchft-localsgd[:H] "
                         "(H: --sync-every; the torchft ones need pip install 'distrain[peers]')")
    compare.add_argument("--repeats", type=int, default=None, metavar="R", help="runs per configuration; repeat k uses --seed + k (default: 1)")
    compare.add_argument("--baseline", default=None, metavar="NAME", help="configuration the speed-ups are measured against (default: the first)")
    compare.add_argument("--out", default=None, metavar="DIR", help="output directory (default: runs/<scenario or compare>-<time>)")
    compare.add_argument("--scenario", default=None, metavar="FILE", help="a scenario file (benchmarks/scenarios/*.toml); flags override it")
    compare.add_argument("--keep-checkpoints", action="store_true", help="keep each run's final checkpoint (removed by default)")
    compare.add_argument("--config", default=None, metavar="FILE", help="JSON, TOML or YAML file of shared settings; flags override it")
    add_config_flags(compare, exclude=COMPARE_OWN)
    compare.set_defaults(func=cmd_compare)
    launch = sub.add_parser("launch", help="run your own training script (which calls distrain.wrap) as N processes on "
                            "this machine, on an emulated network", description="Run SCRIPT (or -m MODULE) as --workers "
                            "processes on 127.0.0.1 with the environment torchrun sets; distrain.wrap() in the script "
                            "joins them and emulates the network given here. Output lines carry the rank; if one "
                            "process fails, all stop. On several machines, run it on each with --nnodes, --node-rank "
                            "and node 0's --master-addr and --master-port.")
    launch.add_argument("--workers", type=int, default=TrainConfig().cluster.workers, metavar="N",
                        help="processes to start (on each node with --nnodes) (default: %(default)s)")
    launch.add_argument("--servers", type=int, default=0, metavar="S",
                        help="also start S parameter servers (the last S ranks; the script's wrap() uses algorithm ps)")
    launch.add_argument("--master-port", type=int, default=0, metavar="PORT",
                        help="port of the rendezvous (0 = a free one; required with --nnodes 2 or more)")
    launch.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="machines in the job; run the same command on each with its --node-rank (default: 1)")
    launch.add_argument("--node-rank", type=int, default=0, metavar="R",
                        help="this machine's place in the job: its workers are ranks R * --workers onwards (default: 0)")
    launch.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                        help="node 0's address, where its launcher serves the rendezvous (default: 127.0.0.1)")
    launch.add_argument("--join", action="store_true",
                        help="elastic runs on several machines: start this node's workers again in the running "
                        "job (a node that was lost); they enter at a step's end with a live worker's state")
    launch.add_argument("--timeout", type=float, default=TrainConfig().cluster.timeout, metavar="S",
                        help="seconds any rendezvous or collective may take, and that the other ranks have to "
                        "finish once one has (default: %(default)s)")
    launch.add_argument("--min-workers", type=int, default=None, metavar="M",
                        help="elastic runs (allreduce, diloco, dpsgd, d2, ps (flat), adpsgd, prague): when a process "
                        "dies the others go on while at least M "
                        "workers remain (default: 1); M = N stops every process on any loss")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="elastic runs: start a worker that died again, up to R times in all; it joins the "
                        "others at a step's end with their parameters and optimizer state (default: 0)")
    launch.add_argument("--no-preload", action="store_true",
                        help="start each process as a fresh 'python SCRIPT', as torchrun does, instead of forking it "
                        "from one process that imported torch once (about 3 s of CPU less per process; the "
                        "default, except with --emulation netns)")
    launch.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module, as python -m does")
    add_config_flags(launch, sections=("network",))
    launch.add_argument("target", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]", help="the script and its arguments")
    launch.set_defaults(func=cmd_launch)
    rep = sub.add_parser("report", help="plot finished runs: accuracy, loss, bytes, throughput, compression ratio, consensus",
                         description="Write PNG plots (and print a table) for run directories, compare output "
                         "directories, or directories holding runs; repeats of one configuration (runs whose "
                         "settings differ only in the seed) are aggregated.")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or a compare --out directory)")
    rep.add_argument("--out", default=None, metavar="DIR", help="where to write the plots (default: a compare directory "
                     "itself, report/ inside a single run, else report/ next to the first run)")
    rep.add_argument("--baseline", default=None, metavar="NAME", help="configuration the speed-ups are measured against (default: the first)")
    rep.add_argument("--label", action="append", default=None, metavar="DIR=NAME", help="name the runs in or below DIR "
                     "(they form one group); repeatable. Otherwise runs are grouped by every setting but the seed")
    rep.set_defaults(func=cmd_report)
    from distrain.bench import add_bench_parser  # distrain bench link (emulation benchmarks)
    from distrain.sample import add_sample_parser  # distrain sample RUN_DIR (language models)

    add_bench_parser(sub)
    add_sample_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:  # at once: the parser's choices import torch
        from distrain import __version__

        print(f"distrain {__version__}")
        return 0
    try:
        freeze_at_exit()  # the launcher's exit skips the last garbage collection (about 0.8 s with torch)
        start_early(sys.argv[1:] if argv is None else argv)  # the workers' fork server imports beside this process
        start_starter(sys.argv[1:] if argv is None else argv)  # distrain launch's: the same, for the scripts
        parser = build_parser()
        args = parser.parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="distrain: %(levelname)s %(name)s: %(message)s")
        if getattr(args, "command", None) == "train":
            from distrain.launch import in_torchrun

            if in_torchrun():  # a torchrun worker: same teardown concern as our own spawned workers
                from distrain.launch.common import exit_now

                exit_now(_run(args))
    except KeyboardInterrupt:  # Ctrl-C before the command runs (its own handling is in _run)
        print("distrain: interrupted", file=sys.stderr)
        return 130
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except (ConfigError, DataError, CheckpointError) as exc:
        print(f"distrain: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DistrainError as exc:
        print(f"distrain: {exc}", file=sys.stderr)
        return 1
    except Interrupted as exc:
        print(f"distrain: {exc}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("distrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
