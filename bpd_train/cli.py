"""How every command reports a user's mistake: one line on stderr, exit status 2, no traceback.

train.py, distill.py, evaluate.py, export.py (`exits_on_user_error(work)(cfg)` inside the `@hydra.main` function:
a decorator on that function itself would make Hydra look for conf/ beside this file), python -m
bpd_train.translate and python -m bpd_train.training.zero_cpu all go through here, so "what is a user error" and
"what does its message look like" are decided once. BPD_TRACEBACK=1 re-raises instead (to debug a wrong
classification: a bug surfacing as ValueError).
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, TextIO, TypeVar

EXIT_USER_ERROR = 2

# Every error class of ours derives from ValueError (CheckpointError, BundleError, TrainError, DistillError,
# EvalError, CorpusError); the OSErrors name a path the user gave (missing, existing, not writable).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
                                                IsADirectoryError, PermissionError)

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
    """Decorator for a command's main function: a user error becomes one line and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            sys.exit(report(e))

    return wrapper  # type: ignore[return-value]


# --- config overrides: checked before Hydra starts, so a typo is one line naming the closest valid key ----------

def config_dir() -> Path:
    """The folder of Hydra configs: the clone's conf/, or the copy an installed wheel ships (bpd_train/_build.py)."""
    from bpd_train import REPO_ROOT

    return REPO_ROOT / "conf"


def regime_names() -> list[str]:
    """The regimes `+regime=` can pick: conf/regime/*.yaml (conf/regime/_*.yaml hold what several share)."""
    return sorted(p.stem for p in (config_dir() / "regime").glob("*.yaml") if not p.stem.startswith("_"))


def check_argv(argv: list[str]) -> None:
    """Before Hydra starts (and makes an output folder), and before Lightning is imported: a training run must
    pick a regime with +regime=."""
    if any(a.split("=", 1)[0] in ("--help", "-h", "--hydra-help", "--info", "--cfg", "-c", "--shell-completion",
                                  "-sc", "--resolve", "-p", "--package") for a in argv):
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
    return (ancestor is None or ancestor == {} or "callbacks" in path
            or (isinstance(ancestor, dict) and "_target_" in ancestor))


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


def check_config(config_name: str, argv: list[str], command: str) -> None:
    """Refuse, with one line naming the closest valid key, what Hydra would ignore, crash on or explain in a page:
    unknown keys (with or without `+`), wrong value types, unknown config group options. Exits 2; returns if fine."""
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
                compose(config_name, overrides=[o.input_line for o in mine])
            except Exception as e:
                fail(str(e).split("\n\n")[0] + hint)
    finally:
        GlobalHydra.instance().clear()


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
        ("regime.init_from=PATH", "head regimes: the model to start from (default: <corpus>/base; hf:<folder> imports)"),
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
        ("decode.dtype=fp32|bf16|int8", "decode precision"),
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
            return ln[len("Summary:"):].strip()
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
        config_name, f"{command} [experiment=NAME] [KEY=VALUE ...]")
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
    out.append("\nA typo is refused with the closest valid key. Every key of the config below can be set as "
               "KEY=VALUE; a group as GROUP=OPTION.")
    return "\n".join(out) + "\n"

