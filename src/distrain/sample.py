"""``distrain sample RUN_DIR``: text from a language-model run's trained (consensus) model.

Reads the run's ``config.json`` (model size, width, depth, context, tokenizer) and its
``model.pt``, and continues ``--prompt`` by ``--tokens`` tokens sampled at ``--temperature`` (0:
the most likely token each time), printing the prompt and the continuation. A run with
``--tokenizer bpe:N`` encodes and decodes with the BPE it trained on (found in the data cache by
its corpus and ``N``).

    distrain sample runs/lm --prompt "def " --tokens 200 --temperature 0.8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distrain.errors import ConfigError


def sample_text(run_dir: str | Path, prompt: str = "\n", tokens: int = 200, temperature: float = 0.8,
                seed: int = 0) -> str:
    """The prompt and ``tokens`` sampled tokens after it, decoded as UTF-8 (bad bytes replaced)."""
    import torch

    from distrain.models import build_model

    run = Path(run_dir)
    if not (run / "config.json").is_file() or not (run / "model.pt").is_file():
        raise ConfigError("RUN_DIR", f"{str(run)!r} holds no finished run (config.json and model.pt)")
    config = json.loads((run / "config.json").read_text())
    m, d = config["model"], config["data"]
    if m["model"] != "gpt":
        raise ConfigError("RUN_DIR", f"the run trained {m['model']!r}; sample needs a language model (--model gpt)")
    if tokens < 0 or not 0 <= temperature < 100:
        raise ConfigError("--tokens/--temperature", f"need tokens >= 0 and 0 <= temperature < 100, got {tokens}, {temperature}")
    from distrain.data.text import load_tokenizer

    bpe = load_tokenizer(d.get("data_path"), d.get("tokenizer", "bytes"))
    vocab = 256 if bpe is None else bpe.vocab
    model = build_model("gpt", (int(d["context"]),), vocab, width=m.get("model_width"), depth=m.get("model_depth"),
                        size=m.get("model_size", "nano"))
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    model.eval()
    encode, decode = (list, bytes) if bpe is None else (lambda b: bpe.encode(b).tolist(), bpe.decode)
    start = encode(prompt.encode()) or encode(b"\n")
    idx = torch.tensor([start], dtype=torch.int64)
    out = model.generate(idx, tokens, temperature=temperature, generator=torch.Generator().manual_seed(seed))
    return decode(out[0].tolist()).decode("utf-8", errors="replace")


def add_sample_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="print text from a language-model run's trained model",
                       description="Continue --prompt with the trained (consensus) model of a --model gpt run.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run's directory")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a new line)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to sample (bytes, or the run's BPE tokens; default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: the most likely token each time (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_sample)


def cmd_sample(args: argparse.Namespace) -> int:
    print(sample_text(args.run_dir, args.prompt, args.tokens, args.temperature, args.seed))
    return 0
