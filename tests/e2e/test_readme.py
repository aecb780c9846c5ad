"""README.md as a user reads it: its commands run as written and its figures are the committed ones.

Runnable blocks are marked by an HTML comment on the line before the fence:

    <!-- runnable -->              runs in CI (`make test`)
    <!-- runnable: slow -->        runs in `make test-all` only
    <!-- runnable: slow netns -->  as slow, and needs network namespaces (root, iproute2)

A ```bash block runs command by command (``\\`` continues a line, ``#`` starts a comment) in a
fresh directory; a ```python block marked runnable runs there as a script. That directory links
``benchmarks/`` and ``examples/`` of this checkout and holds every ```python block whose first line is
``# NAME.py``, saved as NAME.py, so that commands naming them run. ``distrain``, ``torchrun`` and
``python`` are this interpreter's. ``~`` is a home directory holding the data a user is assumed
to have: ``~/mnist``, a small set of MNIST-format IDX files.

What is changed, and why: every ``distrain train`` and ``distrain compare`` gets
``--epochs 1 --num-samples 2000 --no-progress`` appended (flags given later win), so that a
command finishes in seconds. This checks that the commands run (their flags, data, models and
output), not the accuracy they would reach in full; the figures are checked separately, against
the results files each paragraph cites.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from distrain.errors import ConfigError
from distrain.launch.common import free_port
from distrain.launch.netns import netns_unavailable

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
QUICK = ["--epochs", "1", "--num-samples", "2000", "--no-progress"]
COMMAND_TIMEOUT = 300
MARKER = re.compile(r"^<!--\s*runnable(?::\s*([\w\s]*?))?\s*-->\s*$")


@dataclass
class Block:
    """A fenced code block of the README: where it starts, its language, marker words and text."""

    line: int
    lang: str
    marks: frozenset[str] | None  # None: not runnable
    text: str

    @property
    def file_name(self) -> str | None:
        first = self.text.splitlines()[0] if self.text else ""
        match = re.fullmatch(r"#\s*([\w-]+\.py)", first.strip())
        return match.group(1) if match else None


def blocks(text: str) -> list[Block]:
    """Every fenced block, with the runnable marker of the line before it, if any."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.match(lines[start - 1]) if start > 0 else None
        marks = frozenset((marker.group(1) or "").split()) if marker else None
        found.append(Block(start + 1, fence.group(1), marks, "\n".join(lines[start + 1:end])))
        i = end + 1
    return found


def commands(text: str) -> list[list[str]]:
    """The commands of a shell block, as argument lists (comments and continuations resolved)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [args for line in joined.splitlines() if (args := shlex.split(line, comments=True))]


def as_run(args: list[str], home: Path) -> list[str]:
    """A README command as this test runs it: this interpreter, ``~`` expanded, short runs."""
    head = {"distrain": [sys.executable, "-m", "distrain"], "torchrun": [sys.executable, "-m", "torch.distributed.run"],
            "python": [sys.executable]}
    out = head.get(args[0], [args[0]]) + [str(home) + a[1:] if a.startswith("~/") else a for a in args[1:]]
    i = out.index("distrain") if "distrain" in out else -1
    if i >= 0 and out[i - 1] == "-m" and out[i + 1:i + 2] in (["train"], ["compare"]) and "--help" not in out:
        out += QUICK
    return out


def write_idx(path: Path, array: np.ndarray) -> None:
    """One IDX file of unsigned bytes, as MNIST ships them."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def user_home(home: Path) -> None:
    """The data the README assumes a user has: ``~/mnist`` (random images, learnable labels)."""
    rng = np.random.default_rng(0)
    mnist = home / "mnist"
    mnist.mkdir(parents=True)
    for prefix, n in (("train", 1200), ("t10k", 200)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 50, (n, 28, 28))
        images[np.arange(n), labels, :] = 255  # the label is the bright row
        write_idx(mnist / f"{prefix}-images-idx3-ubyte", images)
        write_idx(mnist / f"{prefix}-labels-idx1-ubyte", labels)


def runnable(selected: str) -> list[pytest.param]:
    """One parameter per runnable block: ``fast`` (CI) or ``slow`` ones."""
    params = []
    for block in blocks(README.read_text()):
        if block.marks is None:
            continue
        slow = "slow" in block.marks
        if slow != (selected == "slow"):
            continue
        marks = [pytest.mark.slow] if slow else []
        if "netns" in block.marks:
            reason = netns_unavailable()
            marks.append(pytest.mark.skipif(reason is not None, reason=f"network namespaces not permitted: {reason}"))
        params.append(pytest.param(block, id=f"README.md:{block.line}", marks=marks))
    return params


def run_block(block: Block, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    user_home(home)
    work.mkdir()
    for linked in ("benchmarks", "examples"):
        (work / linked).symlink_to(ROOT / linked)
    for other in blocks(README.read_text()):
        if other.lang == "python" and other.file_name:
            (work / other.file_name).write_text(other.text + "\n")
    env = {**os.environ, "HOME": str(home), "PET_MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    if block.lang == "python":
        script = work / (block.file_name or "readme_block.py")
        script.write_text(block.text + "\n")
        todo = [[sys.executable, script.name]]
    else:
        assert block.lang == "bash", f"README.md:{block.line}: runnable blocks are bash or python"
        todo = [as_run(args, home) for args in commands(block.text)]
    for args in todo:
        before = len(list(work.rglob("summary.json")))
        out = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        assert out.returncode == 0, f"README.md:{block.line}: {shlex.join(args)}\n{out.stderr[-3000:]}"
        if args[1:4] == ["-m", "distrain", "train"] and "--help" not in args:
            assert len(list(work.rglob("summary.json"))) == before + 1, "no run directory written"


@pytest.mark.parametrize("block", runnable("fast"))
@pytest.mark.timeout(COMMAND_TIMEOUT + 30)
def test_runnable_block(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)


@pytest.mark.parametrize("block", runnable("slow"))
@pytest.mark.timeout(4 * COMMAND_TIMEOUT)
def test_runnable_block_slow(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)


def test_every_command_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``distrain`` command in any shell block (runnable or not) has flags that exist and
    values that validate, from the checkout's root: renamed flags and units show up here first."""
    from distrain.cli import build_parser, config_from_args

    monkeypatch.chdir(ROOT)
    checked = 0
    for block in blocks(README.read_text()):
        if block.lang != "bash":
            continue
        for args in commands(block.text):
            if "distrain" not in args or "--help" in args:
                continue
            argv = args[args.index("distrain") + 1:]
            try:
                parsed = build_parser().parse_args(argv)
            except SystemExit as exc:
                raise AssertionError(f"README.md:{block.line}: {shlex.join(args)} does not parse") from exc
            if argv[0] == "train" and getattr(parsed, "config", None) is None:
                try:
                    config_from_args(parsed)
                except ConfigError as exc:
                    raise AssertionError(f"README.md:{block.line}: {shlex.join(args)}: {exc}") from None
            checked += 1
    assert checked >= 10


# --------------------------------------------------------------------------------------------
# Figures

# Accuracies as fractions with 3-4 decimals, and measured ratios ("1.51×"; settings such as "4×
# slower" have no decimals).
FIGURE = re.compile(r"(?<![\w.])(0\.\d{3,4})(?!\d)|(?<![\w.])(\d+\.\d+)×")
RESULTS = re.compile(r"(?:benchmarks/)?results/([\w-]+\.json)")


def numbers_of(value: object) -> list[float]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers_of(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers_of(v)]
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def paragraphs(text: str) -> list[tuple[int, str]]:
    """Prose paragraphs (and tables) with their first line; fenced blocks left out."""
    out, current, start, fenced = [], [], 0, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.strip():
            start = start or number
            current.append(line)
        elif current:
            out.append((start, "\n".join(current)))
            current, start = [], 0
    if current:
        out.append((start, "\n".join(current)))
    return out


def test_figures_come_from_the_cited_results() -> None:
    """Each accuracy (0.xxxx) or speed-up (N.N×) in the README's prose is, at its printed
    precision, a number of a results file its paragraph cites (benchmarks/results/*.json), or
    of benchmarks/BENCHMARKS.md where the paragraph cites that."""
    benchmarks_md = (ROOT / "benchmarks" / "BENCHMARKS.md").read_text()
    md_numbers = [float(n) for n in re.findall(r"\d+\.\d+", benchmarks_md)]
    problems, checked = [], 0
    for line, paragraph in paragraphs(README.read_text()):
        prose = re.sub(r"`[^`]*`", " ", paragraph)  # flags and specs are not figures
        figures = [a or b for a, b in FIGURE.findall(prose)]
        if not figures:
            continue
        sources: list[float] = []
        for name in set(RESULTS.findall(paragraph)):
            sources += numbers_of(json.loads((ROOT / "benchmarks" / "results" / name).read_text()))
        if "BENCHMARKS.md" in paragraph:
            sources += md_numbers
        if not sources:
            problems.append(f"README.md:{line}: figures {figures} cite no results file")
            continue
        for figure in figures:
            decimals = len(figure.partition(".")[2])
            if not any(abs(v - float(figure)) <= 0.5 * 10**-decimals + 1e-9 for v in sources):
                problems.append(f"README.md:{line}: {figure} is in none of the results it cites")
            checked += 1
    assert not problems, "\n".join(problems)
    assert checked >= 30
