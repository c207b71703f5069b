"""How every command reports a user's mistake: one line on stderr, exit status 2, no traceback.

train.py, distill.py, evaluate.py, export.py (`exits_on_user_error(work)(cfg)` inside the `@hydra.main` function:
a decorator on that function itself would make Hydra look for conf/ beside this file), python -m
bpd_train.translate and python -m bpd_train.app.zero_cpu all go through here, so "what is a user error" and
"what does its message look like" are decided once. BPD_TRACEBACK=1 re-raises instead (to debug a wrong
classification: a bug surfacing as ValueError).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, TextIO, TypeVar

from bpd_train.configs import (  # noqa: F401 - config_dir re-exported (commands.py)
    HEAD_LOSSES,
    SOURCES,
    TRAINABLE,
    config_dir,
    regime_names,
)
from bpd_train.decode_settings import DTYPE_CHOICES, RENAMED, DecodeError, DecodeSettings

EXIT_USER_ERROR = 2

# Every error class of ours derives from ValueError (CheckpointError, BundleError, TrainError, DistillError,
# EvalError, CorpusError); the OSErrors name a path the user gave (missing, existing, not writable).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)

F = TypeVar("F", bound=Callable)


def error_line(message: object) -> str:
    # Newlines inside a message (datasets, DeepSpeed) would break "one line": join them.
    return "error: " + " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def report(e: BaseException | str, stream: TextIO | None = None) -> int:
    """Print `e` as the one error line and return the exit status; re-raise when BPD_TRACEBACK is set."""
    if isinstance(e, BaseException) and os.environ.get("BPD_TRACEBACK"):
        raise e
    print(error_line(e), file=stream or sys.stderr, flush=True)
    return EXIT_USER_ERROR


def fail(message: str) -> NoReturn:
    """Stop now with one error line (checks that run before any work starts)."""
    sys.exit(report(message))


def exits_on_user_error(fn: F) -> F:
    """Decorator for a command's main function: a user error becomes one line and exit status 2, and the Hydra run
    folder this run made (outputs/<job>/<time>/) is removed again."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            status = report(e)
            discard_run_folder(args[0] if args else None)
            sys.exit(status)

    return wrapper  # type: ignore[return-value]


_STARTED = time.time()  # near enough this process's start: the module is imported before Hydra starts
_NEW_OUTPUTS: Path | None = None  # the first folder of paths.outputs that did not exist before this run
_HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


def discard_run_folder(cfg: Any = None) -> None:
    """Remove the folder Hydra made for this run (a single run, not a sweep) when it holds only what Hydra wrote
    there in this process (.hydra/ and the job's log), then the folders left empty above it inside paths.outputs.
    A folder holding anything else, or files older than this process (a requeued SLURM job's), stays."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
            return
        out = Path(str(HydraConfig.get().runtime.output_dir)).resolve()
        files = [p for p in out.rglob("*") if not p.is_dir()]
        hydra_files = {out / rel for rel in _HYDRA_FILES}
        if any(p not in hydra_files and not (p.parent == out and p.suffix == ".log") for p in files):
            return
        if any(p.stat().st_mtime < _STARTED - 1 for p in files):
            return
        for p in files:
            p.unlink()
        for d in (out / ".hydra", out):
            if d.is_dir():
                d.rmdir()
        # empty folders above it go too: inside paths.outputs, or up to the first folder this run created for it
        outputs = cfg.get("paths", {}).get("outputs") if cfg is not None else None
        root = Path(str(outputs)).resolve() if outputs else None
        parent = out.parent
        while not any(parent.iterdir()) and (
            (_NEW_OUTPUTS is not None and (parent == _NEW_OUTPUTS or _NEW_OUTPUTS in parent.parents))
            or (_NEW_OUTPUTS is None and root is not None and root in parent.parents)
        ):
            parent.rmdir()
            parent = parent.parent
    except Exception:  # the error line is printed already: a failed cleanup must not replace it with a traceback
        return


# --- config overrides: checked before Hydra starts, so a typo is one line naming the closest valid key ----------


def check_argv(argv: list[str]) -> None:
    """Before Hydra starts (and makes an output folder), and before Lightning is imported: a training run must
    pick a regime with +regime=."""
    if any(
        a.split("=", 1)[0]
        in (
            "--help",
            "-h",
            "--hydra-help",
            "--info",
            "--cfg",
            "-c",
            "--shell-completion",
            "-sc",
            "--resolve",
            "-p",
            "--package",
        )
        for a in argv
    ):
        return
    choices = ",".join(regime_names())
    if any(a.startswith(("regime=",)) for a in argv):
        fail(f"regime is not in the defaults list; write +regime=NAME (choices: {choices})")
    if not any(a.startswith(("+regime=", "++regime=")) for a in argv):
        fail(f"choose a regime: python train.py +regime={{{choices}}} [experiment=smoke]")


def _leaves(node: object, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix] if prefix else []
    out = [prefix] if prefix else []
    for k, v in node.items():
        out += _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def _closest(word: str, choices: list[str]) -> str | None:
    import difflib

    hit = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return hit[0] if hit else None


def _suggest(key: str, tree: dict) -> str:
    paths = _leaves(tree)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] == leaf]
    guess = same_leaf[0] if len(same_leaf) == 1 else _closest(key, paths)
    if guess is None:
        guess = _closest(leaf, [p.rsplit(".", 1)[-1] for p in paths])
        guess = next((p for p in paths if guess and p.rsplit(".", 1)[-1] == guess), None)
    return f" (did you mean {guess}?)" if guess else ""


_MISSING = object()


def _lookup(tree: dict, key: str) -> tuple[object, object, list[str]]:
    """(value or _MISSING, deepest existing ancestor, path of that ancestor)."""
    node: object = tree
    seen: list[str] = []
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node, seen = node[part], seen + [part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node, seen = node[int(part)], seen + [part]
        else:
            return _MISSING, node, seen
    return node, node, seen


def _open(ancestor: object, path: list[str]) -> bool:
    # Where a new key is meant to be added: an object built from _target_ (its keyword arguments), the callbacks
    # map (a new callback), or a slot that is null or {} in the config (e.g. data.hf_kwargs, pipeline.regime_overrides).
    return (
        ancestor is None
        or ancestor == {}
        or "callbacks" in path
        or (isinstance(ancestor, dict) and "_target_" in ancestor)
    )


# Keys that were renamed: the new name, in one line.
RENAMED_KEYS = {f"decode.{old}": f"decode.{new}" for old, new in RENAMED.items()} | {
    "loss.draft_vocab": "loss.draft_lowest_ids"
}

# Keys whose value may be a number or a word (Lightning's devices=auto).
_ANY_TYPE = {"trainer.devices"}


def _type_error(key: str, default: object, value: object) -> str | None:
    # Only a word where a number or a boolean is expected: several keys take a number or a list (max_len: 20 or
    # [1.5, 10]) or a boolean or a number (decode.adaptive), and the code that reads them knows.
    if key in _ANY_TYPE or not isinstance(value, str) or "${" in value or isinstance(default, str) or default is None:
        return None
    if isinstance(default, bool):
        return f"{key} expects true or false, got {value!r}"
    if isinstance(default, (int, float)):
        return f"{key} expects a number, got {value!r}"
    return None


def _group_error(e: Exception, conf: Path) -> str:
    options = [o for o in (getattr(e, "options", None) or []) if not str(o).startswith("_")]
    missing = getattr(e, "missing_cfg_file", None) or ""
    group, _, name = str(missing).rpartition("/")
    if options and group:
        guess = _closest(name, options)
        hint = f" (did you mean {group}={guess}?)" if guess else ""
        return f"unknown {group} {name!r}{hint}; choices: {', '.join(sorted(options))}"
    return str(e).split("\n\n")[0]


def check_config(config_name: str, argv: list[str], command: str, environment: bool = True) -> None:
    """Refuse, with one line naming the closest valid key, what Hydra would ignore, crash on or explain in a page:
    unknown keys (with or without `+`), wrong value types, unknown config group options, values the code would
    refuse; with `environment`, also a corpus path that is not there and a GPU trainer on a machine without one.
    Exits 2; returns if fine."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    args = [a for a in argv if not a.startswith("-")]
    if any(a in ("--help", "-h") for a in argv):
        print(usage(config_name, command), flush=True)  # then Hydra's --help prints the config
        return
    if not args or any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return  # Hydra's own flags (--cfg job, --info, -cn NAME, ...) take values: Hydra reads this command line
    conf = config_dir()
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except Exception as e:  # Hydra's OverrideParseException and grammar errors
        fail(f"cannot parse the overrides: {str(e).splitlines()[0]}")
    if any(o.is_sweep_override() for o in overrides):
        return  # a multirun sweep: Hydra composes one config per point and reports on its own
    mine = [o for o in overrides if not o.key_or_group.startswith("hydra")]
    groups = [o for o in mine if (conf / o.key_or_group).is_dir() and "." not in o.key_or_group]
    values = [o for o in mine if o not in groups]
    hint = f"; see {command} --help"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
            try:
                base = compose(config_name, overrides=[o.input_line for o in groups])
            except Exception as e:
                fail(_group_error(e, conf) + hint)
            tree = OmegaConf.to_container(base, resolve=False)
            for o in values:
                if o.is_delete() or o.is_sweep_override():
                    continue
                key = o.key_or_group
                value, ancestor, path = _lookup(tree, key)
                if value is _MISSING:
                    if (o.is_add() or o.is_force_add()) and _open(ancestor, path):
                        continue
                    if key in RENAMED_KEYS:
                        fail(f"{key} is now {RENAMED_KEYS[key]}{hint}")
                    what = "'+' adds a key that nothing reads" if o.is_add() else "not a config key"
                    fail(f"unknown config key {key!r}: {what}{_suggest(key, tree)}{hint}")
                if not (o.is_add() or o.is_force_add()):
                    try:  # the default's resolved value (e.g. trainer.max_steps: ${steps.base})
                        value = OmegaConf.select(base, key)
                    except Exception:  # an interpolation only Hydra's runtime can resolve: compare as written
                        pass
                    err = _type_error(key, value, o.value())
                    if err:
                        fail(err + hint)
            try:  # anything else Hydra refuses (e.g. '+' on a key that exists) as one line too
                composed = compose(config_name, overrides=[o.input_line for o in mine])
            except Exception as e:
                fail(str(e).split("\n\n")[0] + hint)
            check_values(config_name, composed, hint)
            _note_outputs(composed)
            if environment:
                check_data_path(config_name, composed, hint)
            if environment and config_name == "train" and not any(a in ("-m", "--multirun") for a in argv):
                check_device(composed, [o.key_or_group for o in mine])
    finally:
        GlobalHydra.instance().clear()


# --- values: checked on the composed config, so a run is refused in a second, before torch, Lightning or a model
# or corpus is loaded. The regime's and the decode settings' choices are the code's own tuples (bpd_train/configs.py,
# bpd_train/decode_settings.py); the others are kept beside the code that reads them (named there), and
# tests/test_config_values.py checks that the two agree.
CHOICES: dict[str, tuple[str, ...]] = {
    "data.format": ("hf", "jsonl", "tsv", "parallel_text"),  # bpd_train.data.corpus.FORMATS
    "data.on_bad_line": ("error", "skip"),  # bpd_train.data.corpus.load_corpus
    "loss.head_loss": HEAD_LOSSES,
    "regime.head_loss": HEAD_LOSSES,  # (its default is ${loss.head_loss})
    "regime.trainable": TRAINABLE,
    "regime.source": SOURCES,
    "optim.schedule.name": ("inverse_sqrt", "cosine", "constant"),  # bpd_train.training.optim.SCHEDULES
    "model.heads": ("bpd", "medusa", "chain"),  # bpd_train.model.lm.config.HEAD_TYPES
    "progress_bar": ("tqdm", "rich", "none"),  # bpd_train.training.trainer.callbacks
    "decode.dtype": DTYPE_CHOICES,
    "export.format": ("bundle", "hf", "vllm"),  # bpd_train.app.export.FORMATS
    "distill.action": ("run", "verify", "plan", "status"),  # bpd_train.distillation.job.ACTIONS
}


def _value(cfg: Any, key: str) -> object:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, default=_MISSING)
    except Exception:  # an interpolation only Hydra's runtime resolves (${hydra:...}, ${now:...}): the run decides
        return _MISSING


def _note_outputs(cfg: Any) -> None:
    # the first folder on the way to paths.outputs that does not exist yet: Hydra will make it for this run
    global _NEW_OUTPUTS
    outputs = _value(cfg, "paths.outputs")
    if not isinstance(outputs, str):
        return
    new = Path(outputs).expanduser().resolve()
    if new.exists():
        return
    while not new.parent.exists():
        new = new.parent
    _NEW_OUTPUTS = new


def check_values(config_name: str, cfg: Any, hint: str = "") -> None:
    """One line naming the key, the value and the choices for a value the code would refuse later."""
    for key, choices in CHOICES.items():
        value = _value(cfg, key)
        if value is _MISSING or value is None or str(value) in choices:
            continue
        guess = _closest(str(value), list(choices))
        fail(
            f"{key}={value}: not a choice; choose one of {', '.join(choices)}"
            f"{f' (did you mean {key}={guess}?)' if guess else ''}{hint}"
        )
    decode = _value(cfg, "decode")
    if decode is not _MISSING and decode is not None:  # every decode setting, checked by its declaration
        from omegaconf import OmegaConf

        try:
            DecodeSettings.from_config(OmegaConf.to_container(decode, resolve=True))
        except DecodeError as e:
            fail(f"decode.{e}{hint}")
        except Exception:  # an interpolation only Hydra's runtime resolves: the run decides
            pass
    if config_name == "train":  # k is model.block_size alone (the same checks guard training/run.py train())
        k, rk = _value(cfg, "model.block_size"), _value(cfg, "regime.block_size")
        if _MISSING not in (k, rk) and rk != k:
            fail(
                f"regime.block_size={rk}: the number of heads is set as model.block_size (regime.block_size reads it)"
                f"{hint}"
            )
        if _value(cfg, "regime.stage") == "base" and k not in (1, _MISSING):
            fail(
                f"model.block_size={k}: regime base trains the base model, head 1 alone; k is for the head regimes "
                f"(+regime=frozen|finetune|distill|both|self){hint}"
            )
    want = _value(cfg, "evaluate.bleu_sentences")
    if (
        want is not _MISSING
        and want is not None
        and str(want).lower() != "all"
        and not (isinstance(want, int) and not isinstance(want, bool) and want > 0)
    ):
        fail(f"evaluate.bleu_sentences must be `all`, null or a positive number of sentences, got {want!r}{hint}")


def check_data_path(config_name: str, cfg: Any, hint: str = "") -> None:
    """A corpus on disk that is not there: named now, not after the accelerator, the tokenizer and the model."""
    fmt, path = _value(cfg, "data.format"), _value(cfg, "data.path")
    if fmt is _MISSING or str(fmt) == "hf" or path is _MISSING:
        return
    if path is None:
        if config_name in ("train", "distill", "evaluate") and _value(cfg, "data.lm.files") in (None, _MISSING):
            fail(
                f"data.path is not set: data.format={fmt} reads the corpus from data.path=DIR (a folder of split "
                f"files, or one train file){hint}"
            )
        return
    if not Path(str(path)).expanduser().exists():
        fail(f"data.path={path}: no such file or folder{hint}")


def cuda_device_visible() -> bool | None:
    """Whether this machine shows a CUDA (or ROCm) device, read without importing torch: False where surely none
    (CUDA_VISIBLE_DEVICES empty or -1; Linux without NVIDIA, ROCm or WSL device nodes), None where it cannot tell."""
    import glob

    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    if not sys.platform.startswith("linux"):
        return None
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def check_device(cfg: Any, keys: list[str]) -> None:
    """trainer=gpu is the default (written for a GPU or a cluster): on a machine without one, say in one line what
    to add instead of failing after the data and the model are loaded."""
    acc = _value(cfg, "trainer.accelerator")
    if str(acc) not in ("gpu", "cuda") or cuda_device_visible() is not False:
        return
    chosen = (
        "trainer=gpu (the default)"
        if not any(k == "trainer" or k.startswith("trainer.") for k in keys)
        else f"trainer.accelerator={acc}"
    )
    fail(
        f"{chosen} but this machine has no CUDA device: add experiment=smoke or experiment=demo (CPU-sized "
        f"presets), or trainer=cpu to train this config on the CPU"
    )


# --- --help: what a new user needs first (regimes, experiments, the options people change), then the config ----

# The options people change most, per command: (override, one line). Everything else is in the config below them.
_OPTIONS = {
    "train": [
        ("model.block_size=K", "k: number of heads (1 base head + k-1 BPD heads)"),
        ("model=NAME", "model size (conf/model/): tiny, base, big, lm_tiny"),
        ("data=NAME", "corpus (conf/data/): bible_en_fr (bundled), local (your files), wmt14_en_de; docs/data.md"),
        ("data.path=DIR data.format=jsonl|tsv|parallel_text", "your own corpus (with data=local)"),
        ("trainer=cpu|gpu|multinode strategy=auto|ddp|deepspeed_zero2|...", "where and how it runs"),
        ("trainer.max_steps=N", "optimizer steps (defaults: steps.base, steps.heads)"),
        (
            "regime.init_from=PATH",
            "head regimes: the model to start from (default: <corpus>/base; hf:<folder> imports)",
        ),
        ("ckpt_path=last", "resume the run from its last checkpoint"),
        ("paths.artifacts=DIR", "where every stage reads and writes (default: ./artifacts)"),
        ("logger=wandb|csv|none", "metrics logger"),
    ],
    "distill": [
        ("teacher=PATH", "the model whose beam search makes the corpus (default: <corpus>/base)"),
        ("distill.beam_size=N distill.length_penalty=A", "beam search settings (paper: 4, 0.6)"),
        ("distill.split=train", "the split to re-translate"),
        ("distill.limit=N", "only the first N examples"),
        ("paths.artifacts=DIR", "where every stage reads and writes"),
    ],
    "evaluate": [
        ("evaluate.inputs=[PATH,...]", "checkpoints, run folders, bundles or hf:<folder> (default: the corpus's runs)"),
        ("decode.block_sizes=[8,4] decode.rules=[exact,top2]", "blockwise settings to compare with greedy"),
        ("decode=greedy", "greedy only"),
        ("evaluate.split=test evaluate.max_sentences=N", "what to decode"),
        ("evaluate.batch_sizes=[1,32]", "batch sizes timed"),
        ("decode.dtype=fp32|bf16|int8|q4|auto", "decode precision (auto: by the model's file type)"),
    ],
    "export": [
        ("export.checkpoint=PATH", "checkpoint, run folder, ZeRO folder, bundle or hf:<folder> (default: newest run)"),
        ("export.format=bundle|hf", "a bundle, or a transformers checkpoint + heads"),
        ("export.dtype=float32|bfloat16", "weights' precision"),
        ("export.output_dir=DIR export.overwrite=true", "where it goes"),
    ],
}


def _summary(path: Path) -> str:
    """A config file's one-line description: its `# Summary:` line, else the first comment that is not a command."""
    lines = [ln[1:].strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.startswith("#")]
    for ln in lines:
        if ln.startswith("Summary:"):
            return ln[len("Summary:") :].strip()
    for ln in lines:
        if "—" in ln:
            return ln.split("—", 1)[1].strip()
    for ln in lines:
        if ln and not ln.startswith(("@package", "python", "make", "(")):
            return ln
    return ""


def _options(group: str) -> list[Path]:
    folder = config_dir() / group
    return sorted(p for p in folder.glob("*.yaml") if not p.name.startswith("_")) if folder.is_dir() else []


def usage(config_name: str, command: str) -> str:
    out = []
    lead = {"train": f"{command} +regime=NAME [experiment=NAME] [KEY=VALUE ...]"}.get(
        config_name, f"{command} [experiment=NAME] [KEY=VALUE ...]"
    )
    out.append(f"usage: {lead}")
    for group, how in (("regime", "+regime=NAME"), ("experiment", "experiment=NAME")):
        if group == "regime" and config_name != "train":
            continue
        files = _options(group)
        out.append(f"\n{group.capitalize()}s ({how}):")
        width = max(len(p.stem) for p in files)
        out += [f"  {p.stem:<{width}}  {_summary(p)}" for p in files]
    rows = _OPTIONS.get(config_name, [])
    if rows:
        out.append("\nMost used options:")
        width = min(max(len(k) for k, _ in rows), 34)
        out += [f"  {k:<{width}}  {v}" if len(k) <= width else f"  {k}\n  {'':<{width}}  {v}" for k, v in rows]
    out.append(
        "\nA typo is refused with the closest valid key. Every key of the config below can be set as "
        "KEY=VALUE; a group as GROUP=OPTION."
    )
    return "\n".join(out) + "\n"
