"""Corpus loading through `datasets`, into the translation schema, with line-level validation.

Every format ends as a `datasets.DatasetDict` with splits train/validation/test and columns
`id` (str) and `translation` ({src_lang: str, tgt_lang: str}; only the two configured languages).

Local files (`jsonl`, `tsv`, `parallel_text`) are read by `Dataset.from_generator` with our own line reader,
so that every problem is reported with its file and line number: malformed JSON, a missing language key,
an empty side, invalid UTF-8. Bad lines are not raised inside the generator; they become rows with a non-empty `error` column, so the datasets cache keeps them and a cache
hit reports exactly what a fresh read reports. Then `on_bad_line: error` raises one ValueError naming the
first few, and `on_bad_line: skip` logs how many were skipped (and the first few) and drops them.
Whole-file problems are always a CorpusError, whatever the policy: a missing or empty split file, and parallel
files of different lengths (one missing line shifts every later pair, so no line-by-line skip could be right).

`format: hf` calls `load_dataset(hf_name, hf_config)` (default `wmt14`/`de-en`; a folder written by
`save_to_disk` is read with `load_from_disk`) and runs the same row checks. A dataset without a `translation`
column names its two text columns in `data.columns` ({src_lang: column, tgt_lang: column}).

Your own files (docs/data.md): `data.splits: null` finds each split's file under `data.path` by name and format
(train.jsonl, dev.tsv, valid.en/valid.fr, ...; `data.path` may also be the train file itself). A jsonl line is
`{"translation": {src: ..., tgt: ...}}` or flat `{src: ..., tgt: ...}`; a tsv file may start with a header that names
the languages. `data.split_from_train: N` carves N rows each for the validation and test splits that have no file,
from a seeded permutation of train (the same rows on every run and every machine). Example ids must be unique per split.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import datasets
from datasets import Dataset, DatasetDict, Features, Value

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
FORMATS = ("hf", "jsonl", "tsv", "parallel_text")
_READER_VERSION = "2"  # bump when the reader's output changes, so old cached arrow files are not reused
_SHOW = 5  # bad lines quoted in an error or skip message
# File names a split is found under (data.splits: null), and the extensions of each format
_SPLIT_NAMES = {"train": ("train",), "validation": ("validation", "valid", "dev", "val"), "test": ("test",)}
_EXTENSIONS = {"jsonl": (".jsonl", ".jsonl.gz", ".json"), "tsv": (".tsv", ".tsv.gz")}
_CARVE_SEED = 0  # split_from_train's permutation: fixed, so a corpus's carved splits never change


class CorpusError(ValueError):
    """A corpus the user must fix (a file, a line, a setting): one line naming the file, no traceback."""


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """Read a key from a dict, a DictConfig or an attribute object."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    try:
        return cfg.get(key, default)  # DictConfig
    except AttributeError:
        return getattr(cfg, key, default)


def _features(src: str, tgt: str) -> Features:
    return Features({"id": Value("string"), "translation": {src: Value("string"), tgt: Value("string")},
                     "error": Value("string")})


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    # Split on b"\n" only: str.splitlines would also split on U+2028, \x0b, \x1c..., which are legal in text.
    with _open_bytes(path) as f:
        for lineno, raw in enumerate(f, start=1):
            yield lineno, raw.rstrip(b"\n").rstrip(b"\r")


def _decode(raw: bytes, where: str) -> tuple[str | None, str]:
    try:
        return raw.decode("utf-8"), ""
    except UnicodeDecodeError as e:
        return None, f"{where}: invalid UTF-8 at byte {e.start}"


def _check_pair(s: Any, t: Any, src: str, tgt: str, where: str) -> str:
    for lang, text in ((src, s), (tgt, t)):
        if not isinstance(text, str):
            return f"{where}: '{lang}' is {type(text).__name__}, not a string"
        if not text.strip():
            return f"{where}: empty '{lang}' side"
    return ""


def _row(id_: str, src: str, tgt: str, s: str = "", t: str = "", error: str = "") -> dict:
    return {"id": id_, "translation": {src: s if not error else "", tgt: t if not error else ""}, "error": error}


def _gen_jsonl(files: list[str], src: str, tgt: str, fingerprint: str, keys: tuple[str, str] | None = None
               ) -> Iterator[dict]:
    del fingerprint  # only there so that the datasets cache key changes with the files
    k_src, k_tgt = keys or (src, tgt)
    for file in files:
        path = Path(file)
        for lineno, raw in _iter_lines(path):
            where = f"{path}:{lineno}"
            id_ = f"{path.name}:{lineno}"
            if not raw.strip():
                yield _row(id_, src, tgt, error=f"{where}: blank line")
                continue
            text, err = _decode(raw, where)
            if err:
                yield _row(id_, src, tgt, error=err)
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield _row(id_, src, tgt, error=f"{where}: malformed JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                yield _row(id_, src, tgt, error=f"{where}: a JSON {type(obj).__name__}, not an object")
                continue
            tr = obj.get("translation")
            if not isinstance(tr, dict):
                if k_src not in obj and k_tgt not in obj:  # neither schema: say both
                    yield _row(id_, src, tgt, error=f"{where}: no 'translation' object and no {k_src!r}/{k_tgt!r} "
                                                    f"keys (keys: {', '.join(sorted(map(str, obj)))}); expected "
                                                    f'{{"translation": {{"{src}": ..., "{tgt}": ...}}}} or '
                                                    f'{{"{k_src}": ..., "{k_tgt}": ...}}, or set data.columns')
                    continue
                tr = obj  # flat: {src: ..., tgt: ...}
            missing = [k for k in (k_src, k_tgt) if k not in tr]
            if missing:
                yield _row(id_, src, tgt, error=f"{where}: language key {missing[0]!r} not in "
                                                f"{'translation' if tr is not obj else 'the line'} "
                                                f"(keys: {', '.join(sorted(map(str, tr)))})")
                continue
            err = _check_pair(tr[k_src], tr[k_tgt], src, tgt, where)
            id_ = str(obj.get("id", id_))
            yield _row(id_, src, tgt, tr[k_src], tr[k_tgt], err)


def _tsv_header(path: Path, src: str, tgt: str) -> tuple[str, ...] | None:
    """The file's first line as column names when it names both languages (a header), else None."""
    first = next(_iter_lines(path), (0, b""))[1]
    try:
        fields = tuple(f.strip() for f in first.decode("utf-8").split("\t"))
    except UnicodeDecodeError:
        return None
    return fields if src in fields and tgt in fields else None


def _gen_tsv(files: list[str], src: str, tgt: str, columns: tuple[str, ...], fingerprint: str,
             header: str = "auto") -> Iterator[dict]:
    del fingerprint
    for file in files:
        path = Path(file)
        names = _tsv_header(path, src, tgt) if header != "false" else None
        skip_first = bool(names) or header == "true"
        cols = names or columns
        i_src, i_tgt = cols.index(src), cols.index(tgt)
        for lineno, raw in _iter_lines(path):
            if skip_first and lineno == 1:
                continue
            where = f"{path}:{lineno}"
            id_ = f"{path.name}:{lineno}"
            text, err = _decode(raw, where)
            if err:
                yield _row(id_, src, tgt, error=err)
                continue
            fields = text.split("\t")
            if len(fields) != len(cols):
                yield _row(id_, src, tgt, error=f"{where}: {len(fields)} tab-separated fields, expected "
                                                f"{len(cols)} ({', '.join(cols)})")
                continue
            s, t = fields[i_src], fields[i_tgt]
            yield _row(id_, src, tgt, s, t, _check_pair(s, t, src, tgt, where))


def _gen_parallel(pairs: list[list[str]], src: str, tgt: str, fingerprint: str) -> Iterator[dict]:
    del fingerprint
    for src_file, tgt_file in pairs:
        sp, tp = Path(src_file), Path(tgt_file)
        it_s, it_t = _iter_lines(sp), _iter_lines(tp)
        for lineno, ((_, a), (_, b)) in enumerate(zip(it_s, it_t), start=1):  # equal lengths: checked before
            id_ = f"{sp.stem}:{lineno}"
            s, err_s = _decode(a, f"{sp}:{lineno}")
            t, err_t = _decode(b, f"{tp}:{lineno}")
            if err_s or err_t:
                yield _row(id_, src, tgt, error=err_s or err_t)
                continue
            yield _row(id_, src, tgt, s, t, _check_pair(s, t, src, tgt, f"{sp}:{lineno} / {tp}:{lineno}"))


def _count_lines(path: Path) -> int:
    return sum(1 for _ in _iter_lines(path))


def _check_parallel_lengths(pairs: list[list[str]]) -> None:
    for src_file, tgt_file in pairs:
        n_src, n_tgt = _count_lines(Path(src_file)), _count_lines(Path(tgt_file))
        if n_src != n_tgt:
            raise CorpusError(f"parallel files differ in length: {src_file} has {n_src} lines, {tgt_file} has "
                              f"{n_tgt}; a missing or extra line shifts every pair after it, so this is never "
                              "skipped line by line (data.on_bad_line): fix the files")


def _fingerprint(files: list[str], *settings: Any) -> str:
    h = hashlib.sha256(_READER_VERSION.encode())
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def _as_list(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, (str, os.PathLike)):
        return [x]
    return list(x)


def _resolve(path: Any, name: Any) -> str:
    p = Path(str(name))
    return str(p if p.is_absolute() or path is None else Path(str(path)) / p)


def _candidates(folder: Path, split: str, fmt: str, src: str, tgt: str) -> list[tuple[str, list]]:
    """(name shown to the user, files) a split may be found as, in order of preference."""
    out = []
    for name in _SPLIT_NAMES[split]:
        if fmt == "parallel_text":
            out.append((f"{name}.{src}+{name}.{tgt}", [[str(folder / f"{name}.{src}"), str(folder / f"{name}.{tgt}")]]))
        else:
            out += [(f"{name}{ext}", [str(folder / f"{name}{ext}")]) for ext in _EXTENSIONS[fmt]]
    return out


def _flat(files: list) -> list[str]:
    return [f for item in files for f in (item if isinstance(item, list) else [item])]


def _all_exist(files: list) -> bool:
    return all(Path(f).is_file() for f in _flat(files))


def _found_files(data_cfg: Any, split: str, fmt: str) -> list:
    """data.splits: null -- the split's file under data.path, found by name and format; [] when it has none."""
    path = cfg_get(data_cfg, "path")
    src, tgt = str(cfg_get(data_cfg, "src_lang")), str(cfg_get(data_cfg, "tgt_lang"))
    if path is None:
        raise CorpusError("data.path is not set: point it at your corpus folder (or train file), e.g. data=local "
                          "data.path=DIR data.src_lang=en data.tgt_lang=fr; docs/data.md")
    folder = Path(str(path))
    if folder.is_file():  # the one file is the train split; split_from_train carves the others
        return [str(folder)] if split == "train" else []
    if not folder.is_dir():
        raise CorpusError(f"data.path: {folder} does not exist")
    for _, files in _candidates(folder, split, fmt, src, tgt):
        if _all_exist(files):
            return files
    if split == "train":
        looked = ", ".join(n for n, _ in _candidates(folder, split, fmt, src, tgt))
        other = [f"{n} (data.format={f})" for f in ("jsonl", "tsv", "parallel_text") if f != fmt
                 for n, fs in _candidates(folder, split, f, src, tgt) if _all_exist(fs)]
        hint = f"; found {other[0]}" if other else "; or name the files with data.splits.train=FILE"
        raise CorpusError(f"data.format={fmt}: no train file in {folder} (looked for {looked}){hint}")
    return []


def _split_files(data_cfg: Any, split: str, fmt: str) -> list:
    if cfg_get(data_cfg, "splits") is None:
        return _found_files(data_cfg, split, fmt)
    path = cfg_get(data_cfg, "path")
    spec = cfg_get(cfg_get(data_cfg, "splits", {}) or {}, split)
    if spec is None:
        return []
    src, tgt = cfg_get(data_cfg, "src_lang"), cfg_get(data_cfg, "tgt_lang")
    if fmt == "parallel_text":
        # a prefix "train" -> <path>/train.<src>, <path>/train.<tgt>; or a mapping {<lang>: file}; or a list of either
        out = []
        for item in _as_list(spec) if not _is_mapping(spec) else [spec]:
            if _is_mapping(item):
                if src not in item or tgt not in item:
                    raise CorpusError(f"data.splits.{split}: parallel_text needs files for {src!r} and {tgt!r}, "
                                     f"got keys {sorted(item)}")
                out.append([_resolve(path, item[src]), _resolve(path, item[tgt])])
            else:
                out.append([_resolve(path, f"{item}.{src}"), _resolve(path, f"{item}.{tgt}")])
        return out
    return [_resolve(path, f) for f in _as_list(spec)]


def _plain(x: Any) -> Any:
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(x):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return x


def _is_mapping(x: Any) -> bool:
    if isinstance(x, Mapping):
        return True
    try:
        from omegaconf import DictConfig
        return isinstance(x, DictConfig)
    except ImportError:  # pragma: no cover
        return False


def _check_rows_batch(batch: dict, src: str, tgt: str, split: str) -> dict:
    errors = []
    for id_, tr in zip(batch["id"], batch["translation"]):
        tr = tr or {}
        missing = [lang for lang in (src, tgt) if lang not in tr or tr[lang] is None]
        if missing:
            errors.append(f"{split} row {id_}: language key {missing[0]!r} missing")
        else:
            errors.append(_check_pair(tr[src], tr[tgt], src, tgt, f"{split} row {id_}"))
    return {"error": errors}


def _load_hf(data_cfg: Any, src: str, tgt: str, cache_dir: str | None, num_proc: int | None,
             wanted: tuple[str, ...] = SPLITS) -> DatasetDict:
    name = cfg_get(data_cfg, "hf_name") or "wmt14"
    config = cfg_get(data_cfg, "hf_config") or ("de-en" if name == "wmt14" else None)
    # hf_kwargs go to load_dataset as they are (e.g. data_files, revision); tests point hf_name=json at a local
    # file with wmt14's schema and run this same code path offline.
    kwargs = {k: _plain(v) for k, v in (cfg_get(data_cfg, "hf_kwargs") or {}).items()}
    folder = Path(str(name))
    if (folder / "dataset_dict.json").is_file():  # a DatasetDict.save_to_disk folder: load_dataset cannot read it
        raw = datasets.load_from_disk(str(folder))
    else:
        raw = datasets.load_dataset(name, config, cache_dir=cache_dir, **kwargs)
    explicit = cfg_get(data_cfg, "splits") is not None
    splits = cfg_get(data_cfg, "splits") or {}
    given = _plain(cfg_get(data_cfg, "columns"))
    if given is not None and not isinstance(given, dict):
        raise CorpusError(f"data.columns for format=hf maps each language to its column, e.g. {{{src}: source, "
                          f"{tgt}: target}}; got {given!r}")
    out = {}
    for ours in wanted:
        if explicit:
            theirs = cfg_get(splits, ours)
            if theirs is None:
                continue
            if theirs not in raw:
                raise CorpusError(f"{name}/{config} has no split {theirs!r} (has: {', '.join(raw)}); "
                                  f"fix data.splits.{ours}")
        else:  # data.splits: null -- the dataset's own split names
            theirs = next((n for n in _SPLIT_NAMES[ours] if n in raw), None)
            if theirs is None:
                continue
        ds = raw[theirs]
        if "translation" not in ds.column_names:  # flat columns: {src: column, tgt: column} (data.columns)
            cols = {lang: str((given or {}).get(lang, lang)) for lang in (src, tgt)}
            missing = [c for c in cols.values() if c not in ds.column_names]
            if missing:
                raise CorpusError(f"{name}/{config} split {theirs!r} has no 'translation' column and no column "
                                  f"{missing[0]!r} (columns: {', '.join(ds.column_names)}); set data.columns="
                                  f"{{{src}: COLUMN, {tgt}: COLUMN}}")
            ds = ds.map(lambda b: {"translation": [{src: s_, tgt: t_} for s_, t_ in zip(b[cols[src]], b[cols[tgt]])]},
                        batched=True, remove_columns=[c for c in ds.column_names if c != "id"],
                        desc=f"columns {ours}")
        feat = ds.features.get("translation")
        langs = list(getattr(feat, "languages", None) or (feat.keys() if isinstance(feat, dict) else []))
        for lang in (src, tgt):
            if lang not in langs:
                raise CorpusError(f"{name}/{config} split {theirs!r}: language key {lang!r} not in translation "
                                 f"(keys: {', '.join(map(str, langs))}); fix data.src_lang/tgt_lang")
        if "id" not in ds.column_names:
            ds = ds.add_column("id", [f"{theirs}-{i}" for i in range(len(ds))])
        ds = ds.map(
            lambda b: {"translation": [{src: tr[src], tgt: tr[tgt]} for tr in b["translation"]],
                       "id": [str(i) for i in b["id"]], **_check_rows_batch(b, src, tgt, ours)},
            batched=True, num_proc=num_proc, features=_features(src, tgt),
            remove_columns=[c for c in ds.column_names if c not in ("id", "translation")],
            desc=f"check {ours}",
        )
        out[ours] = ds
    return DatasetDict(out)


def _read_local(fmt: str, files: list, src: str, tgt: str, data_cfg: Any, cache_dir: str | None,
                split: str) -> Dataset:
    flat = _flat(files)
    for f in flat:
        if not Path(f).is_file():
            raise CorpusError(f"data.splits.{split}: {f} does not exist (or is not a file); fix data.path or "
                              f"data.splits.{split}")
        if next(_iter_lines(Path(f)), None) is None:  # datasets would only say 'Instruction "train" corresponds to no data!'
            raise CorpusError(f"data.splits.{split}: {f} is empty")
    given = _plain(cfg_get(data_cfg, "columns"))
    if fmt == "jsonl":
        if given is not None and not isinstance(given, dict):
            raise CorpusError(f"data.columns for jsonl maps each language to its key, e.g. {{{src}: source, "
                              f"{tgt}: target}}; got {given!r}")
        keys = (str(given.get(src, src)), str(given.get(tgt, tgt))) if given else None
        gen, kw = _gen_jsonl, {"files": files, "keys": keys}
    elif fmt == "tsv":
        if isinstance(given, dict):
            raise CorpusError(f"data.columns for tsv lists the language of each column, e.g. [{src},{tgt}]; got {given}")
        columns = [str(c) for c in (given or [src, tgt])]
        header = str(cfg_get(data_cfg, "header", "auto")).lower()
        if header not in ("auto", "true", "false"):
            raise CorpusError(f"data.header={header!r}; expected auto, true or false")
        for lang in (src, tgt):
            if lang not in columns:
                raise CorpusError(f"tsv columns {columns} have no language key {lang!r}; set data.columns")
        # a list would be read as shards
        gen, kw = _gen_tsv, {"files": files, "columns": tuple(columns), "header": header}
    else:
        _check_parallel_lengths(files)
        gen, kw = _gen_parallel, {"pairs": files}
    fp = _fingerprint(flat, fmt, src, tgt, kw.get("columns"), kw.get("keys"), kw.get("header"), split)
    ds = Dataset.from_generator(
        gen, features=_features(src, tgt), cache_dir=cache_dir, split=split,
        gen_kwargs={**kw, "src": src, "tgt": tgt, "fingerprint": fp}, fingerprint=fp,
    )
    return ds


def _apply_bad_line_policy(ds: Dataset, split: str, policy: str) -> Dataset:
    errors = ds.data.column("error").to_pylist()
    bad = [i for i, e in enumerate(errors) if e]
    if not bad:
        return ds.remove_columns("error")
    shown = "; ".join(errors[i] for i in bad[:_SHOW])
    more = f" (and {len(bad) - _SHOW} more)" if len(bad) > _SHOW else ""
    if policy == "error":
        raise CorpusError(f"{len(bad)} bad line(s) in split {split!r}: {shown}{more}. "
                         f"Fix the data or set data.on_bad_line=skip")
    log.warning("split %s: skipped %d bad line(s) of %d: %s%s", split, len(bad), len(ds), shown, more)
    bad_set = set(bad)
    keep = [i for i in range(len(ds)) if i not in bad_set]
    return ds.select(keep).flatten_indices().remove_columns("error")


def _carve_sizes(data_cfg: Any) -> dict[str, int]:
    n = _plain(cfg_get(data_cfg, "split_from_train"))
    if n is None:
        return {}
    sizes = {s: n for s in ("validation", "test")} if not isinstance(n, dict) else {str(k): v for k, v in n.items()}
    for split, size in sizes.items():
        if split not in ("validation", "test") or isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CorpusError(f"data.split_from_train: N rows for validation and test, or {{validation: N, test: M}}; "
                              f"got {n!r}")
    return {k: v for k, v in sizes.items() if v}


def _carve(train: Dataset, sizes: dict[str, int]) -> dict[str, Dataset]:
    """Validation/test rows drawn from a fixed-seed permutation of train; train keeps the rest in its own order."""
    total = sum(sizes.values())
    if total >= len(train):
        raise CorpusError(f"data.split_from_train: {total} held-out rows leave nothing of the {len(train)} train rows")
    import numpy as np

    perm = np.random.default_rng(_CARVE_SEED).permutation(len(train))
    out, start = {}, 0
    for split, n in sizes.items():
        out[split] = train.select(sorted(perm[start:start + n].tolist())).flatten_indices()
        start += n
    out["train"] = train.select(sorted(perm[start:].tolist())).flatten_indices()
    log.info("split_from_train: %s carved from %d train rows", {k: len(v) for k, v in out.items()}, len(train))
    return out


def _check_unique_ids(ds: Dataset, split: str) -> None:
    # Distillation, evaluation and resumption match rows by id: two rows with one id would swap or drop translations.
    ids = ds["id"]
    if len(set(ids)) == len(ids):
        return
    seen: set[str] = set()
    dup = list(dict.fromkeys(i for i in ids if i in seen or seen.add(i)))
    raise CorpusError(f"split {split!r} has duplicate example ids ({len(dup)}: {', '.join(map(repr, dup[:3]))}"
                      f"{' ...' if len(dup) > 3 else ''}); ids must be unique")


def load_corpus(data_cfg: Any, cache_dir: str | os.PathLike | None = None,
                splits: tuple[str, ...] = SPLITS) -> DatasetDict:
    """Load the configured corpus as a DatasetDict (train/validation/test) in the translation schema.

    Bad lines follow `data_cfg.on_bad_line` ("error": one ValueError; "skip": counted, logged, dropped).
    `data_cfg.split_from_train` carves validation/test from train where they have no file (see the module doc).
    `data_cfg.limit.<split>` (optional) keeps only the first N rows of a split (smoke runs).
    """
    fmt = cfg_get(data_cfg, "format", "jsonl")
    if fmt not in FORMATS:
        raise CorpusError(f"data.format={fmt!r}; expected one of {FORMATS}")
    src, tgt = cfg_get(data_cfg, "src_lang"), cfg_get(data_cfg, "tgt_lang")
    if not src or not tgt or src == tgt:
        raise CorpusError(f"data.src_lang/tgt_lang must be two different language keys, got {src!r}/{tgt!r}")
    src, tgt = str(src), str(tgt)
    policy = cfg_get(data_cfg, "on_bad_line", "error")
    if policy not in ("error", "skip"):
        raise CorpusError(f"data.on_bad_line={policy!r}; expected 'error' or 'skip'")
    carve = _carve_sizes(data_cfg)
    requested = tuple(splits)
    if carve:  # train depends on which splits have files of their own, so every split is looked at
        splits = SPLITS
    cache_dir = str(cache_dir) if cache_dir is not None else None
    num_proc = cfg_get(data_cfg, "num_proc")
    if fmt == "hf":
        raw = _load_hf(data_cfg, src, tgt, cache_dir, num_proc if (num_proc or 0) > 1 else None, tuple(splits))
    else:
        raw = {}
        for split in splits:
            files = _split_files(data_cfg, split, fmt)
            if files:
                raw[split] = _read_local(fmt, files, src, tgt, data_cfg, cache_dir, split)
    out = {split: _apply_bad_line_policy(raw[split], split, policy) for split in splits if split in raw}
    carve = {k: v for k, v in carve.items() if k not in out}
    if carve and "train" in out:
        out.update(_carve(out["train"], carve))
    if "validation" in requested and "validation" not in out and cfg_get(data_cfg, "splits") is None:
        raise CorpusError(f"the corpus has no validation split (looked for {'/'.join(_SPLIT_NAMES['validation'])} "
                          f"under data.path={cfg_get(data_cfg, 'path') or cfg_get(data_cfg, 'hf_name')}): add one, or set "
                          "data.split_from_train=N to carve N rows each for validation and test from train")
    limit = cfg_get(data_cfg, "limit") or {}
    for split in list(out):
        if split not in requested:
            del out[split]
            continue
        _check_unique_ids(out[split], split)
        n = cfg_get(limit, split)
        if n is not None and n < len(out[split]):
            out[split] = out[split].select(range(int(n)))
    if "train" in requested and "train" not in out:
        raise CorpusError(f"data {cfg_get(data_cfg, 'name')!r}: no train split configured (data.splits.train)")
    log.info("corpus %s: %s", cfg_get(data_cfg, "name"), {k: len(v) for k, v in out.items()})
    return DatasetDict(out)
