"""Distilled corpora on disk: teacher ids, the shard plan, manifest.json, verification, find and load.

Layout: ``${paths.artifacts}/<corpus>/distill/<teacher-id>/``
  manifest.json              settings (teacher sha256, tokenizer hash, beam, alpha, max_len, split), the
                             shard plan (row range, example count and id hash per shard), shard states,
                             ``complete`` and, once verified, the teacher's BLEU against the gold targets.
  shard-00000-of-00012.jsonl one JSON object per line, readable by ``datasets`` (``load_dataset("json")``):
      {"id": ..., "translation": {<src>: source, <tgt>: teacher translation (detokenized)},
       "teacher_ids": [...], "teacher_score": float|null, "gold": gold target}

Shards are the unit of work and of atomicity: each one is written to a temp file and renamed, so a shard
file that exists is whole; a crashed run leaves at most temp files, which the rerun removes and redoes.
The plan is fixed when the manifest is first written and is checked by every later run, so different
settings or a different selection of examples never mix into one folder.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from bpd_train.io import atomic_write_json, atomic_write_text, sha256_file, stale_temp_files
from bpd_train.max_len import max_len_json, parse_max_len
from bpd_train.scoring import corpus_scores

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
DISTILL_DIRNAME = "distill"
DEFAULT_COMMAND = "python distill.py"

# Manifest keys that must agree between every run and rank that writes into one folder.
SETTINGS_KEYS = ("teacher_sha256", "tokenizer_hash", "beam_size", "length_penalty", "max_len", "split",
                 "src_lang", "tgt_lang", "kind", "temperature", "seed", "decode_dtype")
PLAN_KEYS = ("num_examples", "shard_size", "num_shards", "ids_sha256", "limit")


class DistillError(ValueError):
    """A distilled corpus that is missing, incomplete, inconsistent, or made with other settings."""


# ----------------------------------------------------------------------------------------------- ids


def canonical_max_len(max_len: Any) -> int | list[float]:
    """A MaxLen of at least one token, as the manifest stores it (JSON-stable: tuples become lists)."""
    try:
        return max_len_json(parse_max_len(max_len, minimum=1))
    except ValueError as e:
        raise DistillError(str(e)) from None


@dataclass(frozen=True)
class TeacherSettings:
    """Everything that determines the teacher's output; hashed into the teacher id."""

    teacher_sha256: str
    tokenizer_hash: str
    beam_size: int
    length_penalty: float
    max_len: Any
    split: str
    src_lang: str
    tgt_lang: str
    # a decoder-only teacher (kind "lm") answers prompts greedily (temperature 0) or samples from seed
    kind: str = "translation"
    temperature: float = 0.0
    seed: int = 0
    # a decoder-only teacher's decode-step weights (native CPU engine): its greedy output in that precision
    decode_dtype: str = "fp32"

    def as_dict(self) -> dict[str, Any]:
        d = {"teacher_sha256": self.teacher_sha256, "tokenizer_hash": self.tokenizer_hash,
             "beam_size": int(self.beam_size), "length_penalty": float(self.length_penalty),
             "max_len": canonical_max_len(self.max_len), "split": str(self.split),
             "src_lang": str(self.src_lang), "tgt_lang": str(self.tgt_lang)}
        if self.kind != "translation":  # (translation teachers keep the ids they always had)
            d.update(kind=self.kind, temperature=float(self.temperature),
                     seed=int(self.seed) if self.temperature > 0 else None)
            if self.decode_dtype != "fp32":  # (fp32 corpora keep the ids they always had)
                d["decode_dtype"] = str(self.decode_dtype)
        return d

    @property
    def teacher_id(self) -> str:
        """Readable and unique: ``train-b4-a0.6-<12 hex of the settings hash>``."""
        d = self.as_dict()
        digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]
        if self.kind == "lm":
            how = "greedy" if self.temperature <= 0 else f"t{self.temperature:g}-s{self.seed}"
            return f"{d['split']}-lm-{how}-{digest}"
        return f"{d['split']}-b{d['beam_size']}-a{d['length_penalty']:g}-{digest}"


# ---------------------------------------------------------------------------------------------- plan


def ids_digest(ids: Iterable[Any]) -> str:
    h = hashlib.sha256()
    for i in ids:
        h.update(str(i).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def shard_filename(index: int, num_shards: int) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}.jsonl"


def plan_shards(ids: Sequence[Any], shard_size: int) -> list[dict[str, Any]]:
    """Contiguous row ranges of `shard_size` examples, in corpus order; deterministic from the id list."""
    if shard_size < 1:
        raise DistillError(f"shard_size must be >= 1, got {shard_size}")
    n = len(ids)
    num_shards = math.ceil(n / shard_size)
    shards = []
    for s in range(num_shards):
        start, stop = s * shard_size, min(n, (s + 1) * shard_size)
        shards.append({"index": s, "file": shard_filename(s, num_shards), "start": start, "stop": stop,
                       "num_examples": stop - start, "ids_sha256": ids_digest(ids[start:stop]),
                       "state": "pending"})
    return shards


def shards_for_worker(num_shards: int, worker: int, num_workers: int) -> list[int]:
    """Round-robin: worker w gets shards w, w+W, w+2W, ... (neighbouring shards have similar lengths,
    so interleaving balances the load better than contiguous blocks)."""
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise DistillError(f"worker index {worker} is not in [0, {num_workers})")
    return list(range(worker, num_shards, num_workers))


def new_manifest(settings: TeacherSettings, ids: Sequence[Any], shard_size: int, *, corpus: str,
                 teacher_path: str, limit: int | None, command: str, vocab_size: int | None = None) -> dict[str, Any]:
    if len(ids) == 0:
        raise DistillError(f"split '{settings.split}' has no examples to distill")
    if len(set(map(str, ids))) != len(ids):
        seen: set[str] = set()
        dup = list(dict.fromkeys(i for i in map(str, ids) if i in seen or seen.add(i)))
        raise DistillError(f"split '{settings.split}' has duplicate example ids ({len(dup)}: "
                           f"{', '.join(map(repr, dup[:3]))}{' ...' if len(dup) > 3 else ''}); ids must be unique")
    shards = plan_shards(ids, shard_size)
    return {"format": FORMAT_VERSION, "teacher_id": settings.teacher_id, "corpus": corpus,
            **settings.as_dict(), "teacher_path": str(teacher_path),
            "num_examples": len(ids), "shard_size": int(shard_size), "num_shards": len(shards),
            "ids_sha256": ids_digest(ids), "limit": limit, "command": command,
            "shards": shards, "complete": False, "teacher_bleu": None,
            **({"vocab_size": int(vocab_size)} if vocab_size is not None else {})}


def check_compatible(existing: dict[str, Any], wanted: dict[str, Any], out_dir: Path) -> None:
    """Refuse to add to a folder whose corpus was made by another teacher, setting or example selection."""
    diffs = [f"{k}: folder has {existing.get(k)!r}, this run has {wanted.get(k)!r}"
             for k in SETTINGS_KEYS if existing.get(k) != wanted.get(k)]
    if diffs:
        raise DistillError(f"{out_dir} holds a corpus made by another teacher or setting ("
                           + "; ".join(diffs) + "). Nothing was changed. Use another distill.output_dir, "
                           "or leave it unset so the teacher id picks a folder of its own.")
    diffs = [f"{k}: folder has {existing.get(k)!r}, this run has {wanted.get(k)!r}"
             for k in PLAN_KEYS if existing.get(k) != wanted.get(k)]
    if diffs:
        raise DistillError(f"{out_dir} was planned for a different selection of examples (" + "; ".join(diffs)
                           + "). Nothing was changed. Rerun with the folder's settings "
                           f"(`{existing.get('command', DEFAULT_COMMAND)}`), or pass distill.overwrite=true to "
                           "start this corpus again.")


# ------------------------------------------------------------------------------------------ manifest


def read_manifest(out_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise DistillError(f"{Path(out_dir)} is not a distilled corpus (no {MANIFEST}); "
                           f"make one with `{DEFAULT_COMMAND}`")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DistillError(f"cannot read {path}: {e}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT_VERSION or "shards" not in m:
        raise DistillError(f"{path} is not a bpd-train distillation manifest (format {FORMAT_VERSION})")
    return m


def write_manifest(out_dir: str | os.PathLike, manifest: dict[str, Any]) -> None:
    atomic_write_json(Path(out_dir) / MANIFEST, manifest)


# -------------------------------------------------------------------------------------------- shards


def write_shard(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line, written to a temp file and renamed (a shard file that exists is whole)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    atomic_write_text(path, text)


def read_shard(path: str | os.PathLike) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DistillError(f"{path}:{n}: not a JSON line ({e})") from e
    return out


def shard_ids(path: str | os.PathLike) -> list[Any] | None:
    """The ids in a shard file, or None if it is missing or unreadable."""
    try:
        return [r["id"] for r in read_shard(path)]
    except (OSError, UnicodeDecodeError, DistillError, KeyError, TypeError):
        return None


def shard_is_done(out_dir: Path, shard: dict[str, Any]) -> bool:
    """A shard is done when its file exists and holds exactly its planned ids, in order."""
    ids = shard_ids(out_dir / shard["file"])
    return ids is not None and len(ids) == shard["num_examples"] and ids_digest(ids) == shard["ids_sha256"]


def remove_stale_temps(out_dir: Path, files: Iterable[str]) -> int:
    """Temp files left by a killed writer of these shards: only ours (atomic_write_* names them with host and
    pid), and only once that process is gone (a live writer's, or another host's, are left alone)."""
    n = 0
    for name in files:
        for tmp in stale_temp_files(out_dir, name):
            tmp.unlink(missing_ok=True)
            n += 1
    return n


SHARD_RE = re.compile(r"^shard-\d{5}-of-\d{5}\.jsonl$")


def our_files(out_dir: Path) -> list[Path]:
    """What distillation wrote into `out_dir` (manifest, shard files, temp files of dead writers): all that
    distill.overwrite removes; anything else in the folder is the user's and stays."""
    if not out_dir.is_dir():
        return []
    names = {MANIFEST, *(p.name for p in out_dir.iterdir() if SHARD_RE.match(p.name))}
    try:  # temp files of planned shards that never got written
        names.update(s["file"] for s in read_manifest(out_dir)["shards"] if SHARD_RE.match(str(s.get("file"))))
    except (DistillError, KeyError, TypeError, AttributeError):
        pass
    files = [out_dir / n for n in sorted(names) if (out_dir / n).is_file() and not (out_dir / n).is_symlink()]
    return files + [t for n in sorted(names) for t in stale_temp_files(out_dir, n)]


# -------------------------------------------------------------------------------------------- verify


def finish_hint(manifest: dict[str, Any]) -> str:
    cmd = manifest.get("command") or DEFAULT_COMMAND
    return (f"finish it with `{cmd}` (a rerun skips finished shards), or, if every shard was written by a "
            f"job array, `{cmd} distill.action=verify`")


def verify_corpus(out_dir: str | os.PathLike, *, bleu: bool = True) -> dict[str, Any]:
    """Check every shard (ids, counts, no duplicates), record shard states and the teacher's BLEU against
    the gold targets, and mark the manifest complete. Raises DistillError (manifest states updated,
    ``complete`` false) when shards are missing or wrong."""
    out_dir = Path(out_dir)
    m = read_manifest(out_dir)
    tgt = m["tgt_lang"]
    seen: set[str] = set()
    all_ids: list[Any] = []
    hyps: list[str] = []
    refs: list[str] = []
    problems: list[str] = []
    for shard in m["shards"]:
        path = out_dir / shard["file"]
        if not path.is_file():
            shard.update(state="missing", sha256=None, bytes=None, mtime_ns=None)
            problems.append(f"{shard['file']}: missing")
            continue
        try:
            recs = read_shard(path)
            ids = [r["id"] for r in recs]
        except (DistillError, KeyError, TypeError, UnicodeDecodeError) as e:
            shard.update(state="bad", sha256=None, bytes=None, mtime_ns=None)
            problems.append(f"{shard['file']}: unreadable ({e})")
            continue
        dup = [i for i in ids if str(i) in seen]
        if len(ids) != shard["num_examples"] or ids_digest(ids) != shard["ids_sha256"] or dup:
            shard.update(state="bad", sha256=None, bytes=None, mtime_ns=None)
            problems.append(f"{shard['file']}: {len(ids)} examples (planned {shard['num_examples']})"
                            + (f", duplicate ids {dup[:3]}" if dup else "")
                            + ("" if ids_digest(ids) == shard["ids_sha256"] else ", ids differ from the plan"))
            continue
        seen.update(map(str, ids))
        all_ids.extend(ids)
        if m.get("kind") == "lm":  # {id, prompt|messages, response, teacher_ids, gold}
            hyps.extend(r.get("response") or "" for r in recs)
        else:
            hyps.extend(r["translation"][tgt] for r in recs)
        refs.extend(r["gold"] for r in recs)
        st = path.stat()
        shard.update(state="done", sha256=sha256_file(path), bytes=st.st_size, mtime_ns=st.st_mtime_ns)
    if not problems and (len(all_ids) != m["num_examples"] or ids_digest(all_ids) != m["ids_sha256"]):
        problems.append(f"{len(all_ids)} examples in all shards, planned {m['num_examples']} (ids differ)")
    m["complete"] = not problems
    m["num_done_shards"] = sum(s["state"] == "done" for s in m["shards"])
    if problems:
        m["teacher_bleu"] = None
        write_manifest(out_dir, m)
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise DistillError(f"distilled corpus {out_dir} is incomplete: {m['num_done_shards']}/{m['num_shards']} "
                           f"shards done; " + "; ".join(problems[:5]) + more + ". " + finish_hint(m))
    if bleu and all(isinstance(r, str) for r in refs):  # prompts without a reference response: no score
        m["teacher_bleu"] = teacher_bleu(hyps, refs)
    m["verified_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_manifest(out_dir, m)
    return m


def teacher_bleu(hyps: list[str], refs: list[str]) -> dict[str, Any]:
    """The teacher's scores as the manifest records them, from the one BLEU/chrF scorer (bpd_train/scoring.py)."""
    s = corpus_scores(hyps, refs)
    return {"bleu": round(s["bleu"], 4), "bleu_signature": s["bleu_signature"], "chrf": round(s["chrf"], 4),
            "chrf_signature": s["chrf_signature"], "num_sentences": len(hyps)}


# --------------------------------------------------------------------------------------- find / load


def suggest_command() -> str:
    """`python distill.py` plus the corpus-selecting overrides of the running Hydra app (e.g. train.py's
    experiment=smoke), so that an error message holds a command the user can paste."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not inside a Hydra app
        return DEFAULT_COMMAND
    import shlex

    keep = [o for o in task if o.lstrip("+").startswith(("experiment=", "data=", "data.", "paths."))]
    return " ".join([DEFAULT_COMMAND, *map(shlex.quote, keep)])


def _distill_root(corpus_artifacts_dir: Path) -> Path:
    return corpus_artifacts_dir / DISTILL_DIRNAME


def find_distilled_corpus(corpus_artifacts_dir: str | os.PathLike, *, split: str | None = "train",
                          command: str | None = None) -> Path:
    """The single complete distilled corpus of `split` under ``<corpus_artifacts_dir>/distill/``, or a
    clear error. `split=None` accepts any split. `command` is the distillation command to name in the
    message (callers add their data=/experiment= overrides so the user can paste it)."""
    root = _distill_root(Path(corpus_artifacts_dir))
    command = command or suggest_command()
    found: list[tuple[Path, dict]] = []
    for mpath in sorted(root.glob(f"*/{MANIFEST}")):
        try:
            found.append((mpath.parent, read_manifest(mpath.parent)))
        except DistillError:
            continue
    if split is not None:
        found = [(d, m) for d, m in found if m.get("split") == split]
    complete = [(d, m) for d, m in found if m.get("complete")]
    if len(complete) == 1:
        return complete[0][0]
    if len(complete) > 1:
        listing = ", ".join(f"{d} ({m.get('teacher_path')}, beam {m.get('beam_size')}, "
                            f"alpha {m.get('length_penalty')})" for d, m in complete)
        raise DistillError(f"{len(complete)} complete distilled corpora under {root}: {listing}. "
                           "Pick the one to train on with regime.distilled_dir=PATH, or remove the others.")
    if found:
        d, m = found[-1]
        raise DistillError(f"the distilled corpus {d} is not complete; {finish_hint(m)}")
    what = "no distilled corpus" + (f" of split '{split}'" if split else "")
    base = command.replace(DEFAULT_COMMAND, "python train.py +regime=base", 1)
    raise DistillError(f"{what} under {root}; make one with `{command}` (after the base model: `{base}`)")


def is_greedy_output_of(manifest: dict[str, Any], teacher_sha256: str) -> bool:
    """Was this corpus written by that model's own greedy decoding (beam 1, no sampling)?"""
    return (manifest.get("teacher_sha256") == teacher_sha256 and int(manifest.get("beam_size") or 0) == 1
            and float(manifest.get("temperature") or 0.0) == 0.0)


def find_self_corpus(corpus_artifacts_dir: str | os.PathLike, teacher_sha256: str, *, model: str,
                     given: str | os.PathLike | None = None, split: str = "train", command: str | None = None) -> Path:
    """The complete corpus of `model`'s own greedy output (regime source `self`: heads learn exactly what exact
    decoding will accept against) — `given` checked, else the single one under ``<corpus>/distill/``. A clear
    DistillError naming the command that makes it otherwise."""
    command = command or f"{suggest_command()} teacher={model} distill.beam_size=1"
    if given is not None:
        m = read_manifest(Path(given))
        if not is_greedy_output_of(m, teacher_sha256):
            raise DistillError(f"regime.distilled_dir={given} is not {model}'s own greedy output (teacher "
                               f"{m.get('teacher_path')}, beam {m.get('beam_size')}); regime source `self` trains "
                               f"on it: make it with `{command}`, or leave regime.distilled_dir unset")
        if not m.get("complete"):
            raise DistillError(f"the corpus {given} is not complete; {finish_hint(m)}")
        return Path(given)
    root = _distill_root(Path(corpus_artifacts_dir))
    mine = []
    for mpath in sorted(root.glob(f"*/{MANIFEST}")):
        try:
            m = read_manifest(mpath.parent)
        except DistillError:
            continue
        if m.get("split") == split and is_greedy_output_of(m, teacher_sha256):
            mine.append((mpath.parent, m))
    complete = [d for d, m in mine if m.get("complete")]
    if len(complete) == 1:
        return complete[0]
    if len(complete) > 1:
        raise DistillError(f"{len(complete)} complete corpora of {model}'s greedy output under {root}: "
                           f"{', '.join(map(str, complete))}; pick one with regime.distilled_dir=PATH")
    if mine:
        raise DistillError(f"the corpus {mine[-1][0]} of {model}'s greedy output is not complete; "
                           f"{finish_hint(mine[-1][1])}")
    raise DistillError(f"no corpus of {model}'s own greedy output under {root} (regime source `self`); "
                       f"make it with `{command}`")


def load_distilled_corpus(out_dir: str | os.PathLike, vocab_size: int | None = None):
    """The distilled corpus as a ``datasets.Dataset`` in the translation schema, where the target
    language holds the teacher translation. Columns: id, translation, teacher_ids, teacher_score, gold.

    Every shard must be the file verification hashed (sha256 from the manifest; the hash is skipped while size and
    mtime are the recorded ones, and computed once per process otherwise), and every teacher id must be below
    `vocab_size` (default: the teacher's, which the manifest records)."""
    out_dir = Path(out_dir)
    m = read_manifest(out_dir)
    if not m.get("complete"):
        raise DistillError(f"the distilled corpus {out_dir} is not complete "
                           f"({m.get('num_done_shards', 0)}/{m['num_shards']} shards verified); {finish_hint(m)}")
    files = [str(check_shard(out_dir, s, m)) for s in m["shards"]]
    import datasets

    if m.get("kind") == "lm":  # prompt/response (or chat) records as distill.py writes them for a decoder-only model
        ds = _load_json(files, out_dir)
        if len(ds) != m["num_examples"]:
            raise DistillError(f"{out_dir}: read {len(ds)} examples, the manifest says {m['num_examples']}")
        check_teacher_ids(ds, vocab_size if vocab_size is not None else m.get("vocab_size"), out_dir)
        return ds
    features = datasets.Features({
        "id": datasets.Value("string"),
        "translation": {m["src_lang"]: datasets.Value("string"), m["tgt_lang"]: datasets.Value("string")},
        "teacher_ids": datasets.Sequence(datasets.Value("int32")),
        "teacher_score": datasets.Value("float32"),
        "gold": datasets.Value("string"),
    })
    ds = _load_json(files, out_dir, features)
    if len(ds) != m["num_examples"]:
        raise DistillError(f"{out_dir}: read {len(ds)} examples, the manifest says {m['num_examples']}")
    check_teacher_ids(ds, vocab_size if vocab_size is not None else m.get("vocab_size"), out_dir)
    return ds


def _load_json(files: list[str], out_dir: Path, features=None):
    import datasets
    from datasets.exceptions import DatasetGenerationError

    try:
        return datasets.load_dataset("json", data_files=files, split="train", features=features)
    except (DatasetGenerationError, ValueError, TypeError) as e:  # pyarrow's errors are ValueErrors too
        cause = e.__cause__ or e
        raise DistillError(f"{out_dir}: the shards do not read as this corpus's records "
                           f"({type(cause).__name__}: {cause})") from None


# (path, mtime_ns, size) -> sha256 of shards hashed in this process: a corpus is hashed at most once per process,
# and not at all while its files keep the size and mtime that verification recorded
_HASHED: dict[tuple[str, int, int], str] = {}


def check_shard(out_dir: Path, shard: dict[str, Any], m: dict[str, Any]) -> Path:
    """The shard file, if it is the one verification recorded (sha256, size); else a one-line DistillError."""
    p = out_dir / str(shard.get("file"))
    redo = f"rerun `{m.get('command') or DEFAULT_COMMAND}` to redo it"
    if not SHARD_RE.match(p.name) or not p.is_file():
        raise DistillError(f"{p} is missing (or not a shard file of this corpus); {redo}")
    want = shard.get("sha256")
    if not isinstance(want, str):
        raise DistillError(f"{out_dir / MANIFEST} records no sha256 for {p.name}; verify the corpus again with "
                           f"`{m.get('command') or DEFAULT_COMMAND} distill.action=verify`")
    st = p.stat()
    if shard.get("bytes") is not None and st.st_size != shard["bytes"]:
        raise DistillError(f"{p} changed since the corpus was verified ({st.st_size} bytes, "
                           f"{shard['bytes']} recorded); {redo}")
    if (st.st_mtime_ns, st.st_size) == (shard.get("mtime_ns"), shard.get("bytes")):
        return p  # untouched since verification hashed it
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    got = _HASHED.get(key)
    if got is None:
        got = _HASHED[key] = sha256_file(p)
    if got != want:
        raise DistillError(f"{p} was modified after the corpus was verified (sha256 {got[:12]}, manifest "
                           f"{want[:12]}); {redo}")
    return p


def check_teacher_ids(ds, vocab_size: int | None, out_dir: Path) -> None:
    """teacher_ids must be token ids of the model's vocabulary: one line naming the first record that is not."""
    if "teacher_ids" not in ds.column_names:
        return
    import pyarrow as pa
    import pyarrow.compute as pc

    col = ds.data.column("teacher_ids")
    flat = pc.list_flatten(col)
    if len(flat) == 0:
        return
    if not pa.types.is_integer(flat.type):
        raise DistillError(f"{out_dir}: teacher_ids must be lists of integer token ids (got {flat.type})")
    lo, hi = pc.min_max(flat).values()
    lo, hi = lo.as_py(), hi.as_py()
    if lo is not None and (lo < 0 or (vocab_size is not None and hi >= int(vocab_size))):
        bad = next(i for i, ids in enumerate(ds["teacher_ids"])
                   if any(t < 0 or (vocab_size is not None and t >= int(vocab_size)) for t in ids or []))
        top = f"[0, {int(vocab_size)})" if vocab_size is not None else "non-negative ids"
        raise DistillError(f"{out_dir}: record {bad} (id {ds[bad]['id']!r}) has teacher_ids outside the vocabulary "
                           f"{top} (min {lo}, max {hi}): the shard was edited or made by another model; make the "
                           "corpus again (distill.overwrite=true)")
