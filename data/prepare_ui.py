# Build the user-interface corpora (English -> German strings of three programs, from their Debian packages):
#   python data/prepare_ui.py                      (apt-get download of the pinned packages into a temp dir)
#   python data/prepare_ui.py --deb-dir DIR        (.deb files already downloaded)
#   python data/prepare_ui.py --check              (rebuild in a temp dir, compare bytes with the committed files)
"""English→German UI-string corpora from the gettext catalogs (.mo) that Debian packages ship.

Each program's German catalog pairs every English message with its German translation. The packages are read
with `dpkg-deb -x` and the catalogs with a bounds-checked .mo reader (the files are untrusted input: nothing is
executed or unpickled). Outputs `data/ui-en-de/<program>/{train,validation,test}.jsonl.gz` in the Hugging Face
translation schema, split by a hash of the English string (1,000 validation, 1,000 test), gzip with mtime=0, so
the same packages always give the same bytes. Provenance and licences: data/README.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import re
import struct
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "ui-en-de"
# program -> (Debian package, version, the German catalogs inside it)
PROGRAMS = {
    "gimp": (
        "gimp-data",
        "2.10.34-1+deb12u10",
        ("gimp20.mo", "gimp20-std-plug-ins.mo", "gimp20-script-fu.mo", "gimp20-python.mo"),
    ),
    "inkscape": ("inkscape", "1.2.2-2+deb12u1", ("inkscape.mo",)),
    "vlc": ("vlc-l10n", "3.0.24-0+deb12u1", ("vlc.mo",)),
}
HELD_OUT = 1000  # rows each for validation and test
MAX_WORDS = 40  # longer messages are help paragraphs, not UI strings


def read_mo(data: bytes) -> list[tuple[str, str]]:
    """(msgid, msgstr) pairs of a GNU .mo catalog: the header entry, plural forms beyond the first and empty
    translations left out; message contexts stripped. Raises ValueError on a malformed file."""
    if len(data) < 28:
        raise ValueError("not a .mo file: too short")
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if order is None:
        raise ValueError("not a .mo file: bad magic number")
    _, n, orig_at, trans_at = struct.unpack(order + "4I", data[4:20])

    def string(table: int, i: int) -> bytes:
        at = table + 8 * i
        if at + 8 > len(data):
            raise ValueError("malformed .mo file: string table out of range")
        length, offset = struct.unpack(order + "2I", data[at : at + 8])
        if offset + length > len(data):
            raise ValueError("malformed .mo file: string out of range")
        return data[offset : offset + length]

    pairs = []
    for i in range(n):
        msgid, msgstr = string(orig_at, i), string(trans_at, i)
        if not msgid or not msgstr:
            continue
        src = msgid.split(b"\x00")[0].split(b"\x04")[-1]  # singular form, context removed
        tgt = msgstr.split(b"\x00")[0]
        pairs.append((src.decode("utf-8", "replace"), tgt.decode("utf-8", "replace")))
    return pairs


_AMP = re.compile(r"&(?=[^\W_])(?![a-zA-Z]+;)")  # Qt accelerator "&File" (not an entity "&amp;")
_MNEMONIC = re.compile(r"(?<![\w_])_(?=[^\W_])|(?<=[^\W_])_(?=[^\W_])")


def clean(text: str) -> str:
    """One line of plain text: accelerator marks (`_File`, `&File`) removed where a string has exactly one,
    Unicode NFC, whitespace collapsed."""
    text = unicodedata.normalize("NFC", text).replace("\u00a0", " ")
    if text.count("_") == 1:
        text = _MNEMONIC.sub("", text)
    if text.count("&") == 1:
        text = _AMP.sub("", text)
    return re.sub(r"\s+", " ", text).strip()


def corpus(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Cleaned, deduplicated by English string (first translation in sorted order), without untranslated or
    over-long messages, sorted."""
    best: dict[str, str] = {}
    for src, tgt in sorted(pairs):
        src, tgt = clean(src), clean(tgt)
        if not src or not tgt or src == tgt or len(src.split()) > MAX_WORDS or not re.search(r"[A-Za-z]", src):
            continue
        best.setdefault(src, tgt)
    return sorted(best.items())


def split(rows: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """validation / test = the HELD_OUT rows each whose English strings hash lowest; train the rest."""
    ranked = sorted(rows, key=lambda r: hashlib.sha256(r[0].encode()).hexdigest())
    held = {"validation": ranked[:HELD_OUT], "test": ranked[HELD_OUT : 2 * HELD_OUT]}
    taken = {r[0] for part in held.values() for r in part}
    return {"train": [r for r in rows if r[0] not in taken], **{k: sorted(v) for k, v in held.items()}}


def write_jsonl_gz(path: Path, rows: list[tuple[str, str]], program: str) -> None:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:
        for i, (en, de) in enumerate(rows):
            line = {"id": f"{program}.{i}", "translation": {"en": en, "de": de}}
            gz.write((json.dumps(line, ensure_ascii=False) + "\n").encode())
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)


def catalogs(deb: Path, names: tuple[str, ...], work: Path) -> list[tuple[str, str]]:
    out = work / deb.stem
    subprocess.run(["dpkg-deb", "-x", str(deb), str(out)], check=True)
    pairs: list[tuple[str, str]] = []
    for name in names:
        found = sorted(out.rglob(f"locale/de/LC_MESSAGES/{name}"))
        if not found:
            raise SystemExit(f"{deb.name} has no locale/de/LC_MESSAGES/{name}: is it the pinned version?")
        pairs += read_mo(found[0].read_bytes())
    return pairs


def build(deb_dir: Path | None, out_dir: Path) -> dict[str, dict[str, int]]:
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if deb_dir is None:
            deb_dir = work / "debs"
            deb_dir.mkdir()
            specs = [f"{pkg}={ver}" for pkg, ver, _ in PROGRAMS.values()]
            subprocess.run(["apt-get", "download", *specs], cwd=deb_dir, check=True)
        for program, (pkg, ver, names) in PROGRAMS.items():
            debs = sorted(deb_dir.glob(f"{pkg}_*.deb"))
            if not debs:
                raise SystemExit(f"no {pkg}_*.deb in {deb_dir}: download it with `apt-get download {pkg}={ver}`")
            parts = split(corpus(catalogs(debs[0], names, work)))
            (out_dir / program).mkdir(parents=True, exist_ok=True)
            for name, rows in parts.items():
                write_jsonl_gz(out_dir / program / f"{name}.jsonl.gz", rows, program)
            counts[program] = {name: len(rows) for name, rows in parts.items()}
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deb-dir", type=Path, default=None, help="folder with the pinned .deb files")
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with the committed files")
    args = ap.parse_args()
    if not args.check:
        print(json.dumps(build(args.deb_dir, OUT_DIR), indent=1))
        return
    with tempfile.TemporaryDirectory() as tmp:
        build(args.deb_dir, Path(tmp))
        diff = [
            str(p.relative_to(tmp))
            for p in sorted(Path(tmp).rglob("*.gz"))
            if p.read_bytes() != (OUT_DIR / p.relative_to(tmp)).read_bytes()
        ]
    if diff:
        sys.exit(f"rebuilt files differ from the committed ones: {', '.join(diff)}")
    print("identical")


if __name__ == "__main__":
    main()
