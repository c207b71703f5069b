"""python -m bpd_train.data.requests OUT_DIR [--held-out-percent 12] [--per-kind 400]: the general chat-request
corpus (train.jsonl, seen.jsonl, unseen.jsonl, manifest.json) from data/general-requests/topics.txt, this Python's
standard library and data/bible-en-fr."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bpd_train.data.requests.build import build_general, iter_jsonl

REPO = Path(__file__).resolve().parents[3]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--topics", type=Path, default=REPO / "data" / "general-requests" / "topics.txt")
    ap.add_argument("--bible", type=Path, default=REPO / "data" / "bible-en-fr")
    ap.add_argument("--held-out-percent", type=int, default=12)
    ap.add_argument("--per-kind", type=int, default=400)
    ap.add_argument("--eval-per-kind", type=int, default=24)
    a = ap.parse_args(argv)
    recs, manifest = build_general(
        a.topics, a.bible, held_out_percent=a.held_out_percent, per_kind=a.per_kind, eval_per_kind=a.eval_per_kind
    )
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in recs.items():
        (a.out_dir / f"{split}.jsonl").write_text("".join(iter_jsonl(rows)), encoding="utf-8")
    (a.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(manifest["counts"]))


if __name__ == "__main__":
    main()
