"""Every decode setting, declared once: name, type, default, allowed values and help text (`DecodeSettings`).

Pure Python, below every layer (no torch): the front ends read it before anything heavy loads. Everything else is
derived from the fields below, as transformers derives `generate`'s arguments from its `GenerationConfig`:

- the `python -m bpd_train.translate` flags (`add_arguments` / `from_args`: `--<name-with-dashes>`),
- the `Translator` keyword overrides (`Translator(..., settings=None, **overrides)`, `DecodeSettings.replace`),
- `conf/decode/*.yaml` (`from_config`; tests/test_decode_options.py checks the files' defaults against these),
- the evaluator's `EvalSettings.decode`,
- the engine's `DecodeOptions` (engine/packed.py), derived data built from a checked `DecodeSettings` only
  (decoding/settings.py `decode_options`).

A value is checked once, here, when a `DecodeSettings` is built; a bad one is a `DecodeError` of one line,
`name=value: expected ...`, the same from the API, the command line (exit 2) and a config.

Adding a setting: one `setting(...)` field below (and its YAML line where a config should show it); then the code
that acts on it (docs/architecture.md "A decode option" shows a whole one).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Callable, Mapping, Sequence

from bpd_train.max_len import DEFAULT_MAX_LEN, parse_max_len

METHODS = ("blockwise", "greedy")
DTYPES = ("fp32", "bf16", "int8", "q4")  # decode-step weights (engine/fastlinear.py packs them)
AUTO = "auto"
DTYPE_CHOICES = (*DTYPES, AUTO)  # the dtype setting's values: auto resolves by the model's file (decoding/settings.py)
# evaluate.py's dtype unless given (conf/decode/_settings.yaml): its tables compare precisions against fp32, the
# model's weights exactly, while serving's default (auto) picks the fastest precision for the model's file type
EVAL_DTYPE = "fp32"
TREE_NODES = 62  # the native loop's bound (one 64-bit ancestry mask per fed row)
RULE_NAMES = "exact, top<N> (e.g. top2, topk:2) or distance:<eps>"
_TOPK = re.compile(r"^top(?:[-_:]?k)?[-_:]?(\d+)$")
_DISTANCE = re.compile(r"^(?:distance|dist|eps)[-_:]?([0-9.]+)$")

# old names still taken, each with one line that names the new one
RENAMED = {"draft_vocab": "draft_top_tokens"}


class DecodeError(ValueError):
    """Decode settings or inputs that cannot work (an unknown rule, a block size above the model's k, a prompt
    that does not fit, ...): one line that names what to change."""


# ------------------------------------------------------------------------------------------ the value checks
# Each takes a value as the API, a config or the command line (a string) gives it and returns it normalised, or
# raises ValueError("expected ...") -- DecodeSettings prefixes the name and the value.
def is_auto(v) -> bool:
    return isinstance(v, str) and v.strip().lower() == AUTO


def _is_none(v) -> bool:
    return v is None or (isinstance(v, str) and v.strip().lower() in ("", "null", "none", "full", "0")) or v == 0


def as_int(v) -> int | None:
    """An int as written (an int, or a string of one); None for anything else (bools included)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and re.fullmatch(r"\s*[-+]?\d+\s*", v):
        return int(v)
    return None


def _choice(choices: Sequence[str]) -> Callable[[Any], str]:
    def check(v) -> str:
        s = str(v).strip().lower()
        if s not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return s

    return check


def _ints(lo: int, hi: int | None, expected: str, *, allow: Callable[[int], bool] = lambda n: True):
    def check(v) -> int:
        n = as_int(v)
        if n is None or n < lo or (hi is not None and n > hi) or not allow(n):
            raise ValueError(f"expected {expected}")
        return n

    return check


def rule_spec(spec) -> tuple[str, float]:
    """An acceptance rule as written (decoding/acceptance.py's grammar: `exact`; `top<N>` = `topk:<N>`, also
    `top-N`, `topk<N>`, bare `topk` = top-1; `distance:<eps>`, also `dist`/`eps`, bare `distance` = eps 0; or a dict
    {"name": exact|topk|distance, "n"/"eps": ...}) -> ("exact", 0) | ("topk", n) | ("distance", eps). A rule object
    (an AcceptanceRule, made in Python) -> ("object", 0). Anything else is a ValueError listing the names."""
    if spec is None:
        return ("exact", 0)
    if callable(spec) and hasattr(spec, "label"):
        return ("exact", 0) if getattr(spec, "label", None) == "Exact" else ("object", 0)
    if isinstance(spec, Mapping) or hasattr(spec, "keys"):
        d = dict(spec)
        name = str(d.pop("name", d.pop("rule", ""))).lower()
        if name == "exact" and not d:
            return ("exact", 0)
        if name in ("topk", "distance") and set(d) <= {"n" if name == "topk" else "eps"}:
            return rule_spec(f"{name}:{d.get('n', 1) if name == 'topk' else d.get('eps', 0.0)}")
        raise ValueError(f"unknown acceptance rule {spec!r}; use exact, topk (n) or distance (eps)")
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s == "exact":
            return ("exact", 0)
        if s in ("topk", "distance"):
            return ("topk", 1) if s == "topk" else ("distance", 0.0)
        if m := _TOPK.match(s):
            if int(m.group(1)) < 1:
                raise ValueError(f"bad acceptance rule {spec!r}: TopK needs n >= 1, got {int(m.group(1))}")
            return ("topk", int(m.group(1)))
        if m := _DISTANCE.match(s):
            try:
                return ("distance", float(m.group(1)))
            except ValueError:
                pass
    raise ValueError(f"unknown acceptance rule {spec!r}: use {RULE_NAMES}, or Exact(), TopK(n), Distance(eps)")


def _accept(v):
    rule_spec(v)
    return v if callable(v) and hasattr(v, "label") else ("exact" if v is None else v)


def _max_len(v):
    m = parse_max_len(list(v) if isinstance(v, (tuple, list)) else v)
    if not isinstance(m, int) and not all(math.isfinite(x) for x in m):
        raise ValueError("expected finite numbers [a, b] (at most a * source_len + b tokens)")
    return m


def _max_len_checked(v):
    try:
        return _max_len(v)
    except ValueError as e:
        if str(e).startswith("expected"):
            raise
        raise ValueError("expected an int, or [a, b] = at most a * source_len + b tokens (a >= 0)") from None


def check_draft_top_tokens(v):
    if is_auto(v):
        return AUTO
    if _is_none(v):
        return None
    n = as_int(v)
    if n is None or n < 1:
        raise ValueError("expected a number of tokens >= 1, auto, or null (all of them)")
    return n


def check_proposal_dtype(v):
    if is_auto(v):
        return AUTO
    if _is_none(v):
        return None
    if str(v).strip().lower() not in DTYPES:
        raise ValueError(f"expected one of {', '.join(DTYPES)}, auto or none")
    return str(v).strip().lower()


def _dtype(v) -> str:
    s = str(v).strip().lower()
    if s not in DTYPE_CHOICES:
        raise ValueError(f"expected one of {', '.join(DTYPES)} or auto")
    return s


def _adaptive(v) -> bool | float | None:
    if isinstance(v, str):
        v = {"true": True, "false": False, "auto": None, "none": None, "null": None}.get(v.strip().lower(), v)
    if v is None or isinstance(v, bool):
        return v
    try:
        t = float(v)
    except (TypeError, ValueError):
        t = math.nan
    if not 0.0 < t < 1.0:
        raise ValueError("expected true, false, auto (None) or a threshold in (0, 1)")
    return t


def _block_size(v) -> int | None:
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "null")):
        return None
    n = as_int(v)
    if n is None or n < 1:
        raise ValueError("expected an int >= 1 (at most the model's k), or None for the model's k")
    return n


def parse_tree(value) -> tuple[tuple[int, ...], ...]:
    """Candidate-tree rank paths from "0 1 0,0" (paths apart by spaces or ';', ranks by ','), a sequence of
    sequences, or None / "" / () (no tree). Raises ValueError naming what was wrong."""
    try:
        return _tree(value)
    except ValueError as e:
        raise ValueError(f"tree={value!r}: {e}") from None


def _tree(value) -> tuple[tuple[int, ...], ...]:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return ()
    if isinstance(value, str):
        value = [p.split(",") for p in value.replace(";", " ").split()]
    try:
        paths = tuple(tuple(int(r) for r in p) for p in value)
    except (TypeError, ValueError):
        raise ValueError(
            "expected rank paths such as '0 1 0,0' (paths apart by spaces or ';', ranks by commas)"
        ) from None
    if any(not p or min(p) < 0 for p in paths):
        raise ValueError("expected one rank >= 0 per head from head 2 on in every path")
    nodes = {p[:i] for p in paths for i in range(1, len(p) + 1)}
    if len(nodes) > TREE_NODES:
        raise ValueError(f"expected at most {TREE_NODES} nodes, got {len(nodes)}")
    return tuple(sorted(set(paths)))


def _strings(v) -> tuple[str, ...]:
    v = (v,) if isinstance(v, str) else tuple(v or ())
    if not all(isinstance(x, str) and x for x in v):
        raise ValueError("expected non-empty strings")
    return v


def _temperature(v) -> float:
    t = _number(v)
    if t is None or not 0.0 <= t <= 100.0:
        raise ValueError("expected a number >= 0 (0: greedy decoding; 1: the model's own distribution)")
    return 0.0 if t == 0 else t


def _top_p(v) -> float:
    p = _number(v)
    if p is None or not 0.0 < p <= 1.0:
        raise ValueError("expected a probability in (0, 1] (1: off)")
    return p


def _number(v) -> float | None:
    """A finite float as written (a number, or a string of one); None for anything else (bools included)."""
    if isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def setting(default, help: str, check: Callable[[Any], Any], **cli) -> Any:
    """One declared setting: its default, its help text (the command line's and the docs'), the check that
    normalises a value or refuses it, and how the command line spells it where not `--<name>` taking one value
    (argparse keywords: metavar, nargs, action; yaml=False for a setting the decode configs do not list)."""
    return field(default=default, metadata={"help": help, "check": check, "cli": cli})


# ------------------------------------------------------------------------------------------ the declaration
@dataclass(frozen=True)
class DecodeSettings:
    """Everything that decides how texts are decoded, checked when built (a bad value is one DecodeError naming the
    field, the value and what it may be). "auto" values resolve against the model, tokenizer and device
    (decoding/settings.py)."""

    method: str = setting("blockwise", "blockwise | greedy", _choice(METHODS), yaml=False)
    accept: Any = setting(
        "exact",
        "acceptance rule: exact (greedy's output) | top<N> (e.g. top2) | distance:<eps>",
        _accept,
        yaml=False,
    )
    block_size: int | None = setting(
        None, "k for blockwise decoding, at most the model's; none: the model's k", _block_size, yaml=False
    )
    max_len: Any = setting(
        DEFAULT_MAX_LEN,
        "generated tokens: an int, or A B = at most A * source_len + B per input",
        _max_len_checked,
        nargs=2,
        metavar=("A", "B"),
    )
    dtype: str = setting(
        AUTO,
        "decode-step weights: fp32 | bf16 | int8 | q4 (a GGUF file's own 4-bit blocks, 8-bit activations); auto: "
        "the fastest for the model's file type on this device (e.g. q4 for a Q4_1 GGUF on a CPU with the int8 "
        f"kernels, else fp32; translate says which and why); evaluate.py keeps {EVAL_DTYPE}",
        _dtype,
    )
    draft_top_tokens: Any = setting(
        AUTO,
        "heads 2..k propose among the N tokens the tokenizer ranks highest (head 1 still verifies over all: output "
        "unchanged); auto: a quarter of a vocabulary of 2048+ tokens; none: all of them",
        check_draft_top_tokens,
        metavar="N",
    )
    proposal_dtype: Any = setting(
        AUTO,
        "heads 2..k and their projection alone in bf16 | int8: cheaper proposals, output unchanged (head 1 "
        "verifies in dtype); auto: int8 on a CPU with the int8 kernels; none: dtype",
        check_proposal_dtype,
        metavar="DTYPE",
    )
    adaptive: Any = setting(
        None,
        "feed only proposals whose heads pay (output unchanged); auto: on with the exact rule on the CPU (the "
        "evaluator times the full feed and, beside it, this choice); false feeds every proposal; or a threshold "
        "in (0, 1)",
        _adaptive,
        metavar="auto|true|false|T",
    )
    batch_size: int = setting(32, "inputs per batch (grouped by length)", _ints(1, None, "an int >= 1"), yaml=False)
    lookup: int = setting(
        0,
        "decoder-only: N > 0 also proposes from the prompt and answer so far where their last N..1 tokens occurred "
        "before (prompt lookup; output unchanged, sampling's distribution too; adaptive feeding on batches only); "
        "0: off",
        _ints(0, 8, "an int in 0..8 (0: off)"),
        metavar="N",
    )
    narrow: int = setting(
        0,
        "with lookup, one row (sampling: each row): a step whose context repeats fewer than 2 tokens feeds W rows "
        "(the heads' first W-1 proposals; 1: the last token alone, a plain step) instead of the full block; output "
        "unchanged; 0: always the full block",
        _ints(0, None, "0 (off) or an int >= 1 (rows of a step whose context repeats < 2 tokens)"),
        metavar="W",
    )
    tree: Any = setting(
        (),
        "decoder-only, one row: a step whose context repeats fewer than 2 tokens feeds a candidate tree of the "
        "heads' ranked proposals instead, e.g. '0;1' (head 2's first two choices; paths apart by ';', one rank "
        "per head by ','); output unchanged (sampling: its distribution); empty: the chain",
        _tree,
        metavar="PATHS",
    )
    stop: Any = setting(
        (),
        "end each answer before the first of these strings (repeat the flag for several); its ids end at the token "
        "that completes it (the rows still decode to EOS or max_len)",
        _strings,
        action="append",
        metavar="TEXT",
    )

    temperature: float = setting(
        0.0,
        "0: greedy decoding (exact blockwise gives greedy's output); T > 0: sample from softmax(logits / T), "
        "blockwise with the same distribution as plain sampling (heads draft, head 1 accepts with min(1, p/q))",
        _temperature,
        metavar="T",
    )
    top_k: int = setting(
        0,
        "with temperature > 0: sample among the N most likely tokens (heads' drafts too); 0: all tokens",
        _ints(0, None, "an int >= 0 (0: all tokens)"),
        metavar="N",
    )
    top_p: float = setting(
        1.0,
        "with temperature > 0: sample among the most likely tokens whose probabilities sum to at least P "
        "(nucleus; after top_k); 1: all tokens",
        _top_p,
        metavar="P",
    )
    seed: int = setting(
        0,
        "with temperature > 0: input i of a call samples from its own generator seeded seed + i (same seed, "
        "settings and inputs: same tokens, whatever the batch)",
        _ints(0, 2**63 - 1, "an int >= 0"),
        metavar="N",
    )
    verify: str = setting(
        "match",
        "with temperature > 0 and heads: match keeps a draft only where it is the token plain sampling picks there "
        "(plain sampling's text for the same seed, at any batch size: batches sample plainly where heads do not "
        "pay); speculative accepts it with probability min(1, p/q) (the same distribution, not the same text)",
        _choice(("match", "speculative")),
        metavar="match|speculative",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            try:
                object.__setattr__(self, f.name, f.metadata["check"](value))
            except ValueError as e:
                raise DecodeError(f"{f.name}={value!r}: {e}") from None
        if self.temperature > 0 and rule_spec(self.accept)[0] != "exact":
            raise DecodeError(
                f"accept={self.accept_label!r} with temperature={self.temperature:g}: acceptance rules are for "
                "greedy decoding (temperature 0); sampling accepts a draft with probability min(1, p/q), which "
                "keeps the model's distribution"
            )

    @property
    def sampling(self) -> bool:
        """Whether these settings sample (temperature > 0) rather than decode greedily."""
        return self.temperature > 0

    # ------------------------------------------------------------------------------------------ derived views
    @classmethod
    def names(cls) -> list[str]:
        """The settings' names: Translator's keyword overrides, the translate flags' names, the decode config keys."""
        return [f.name for f in fields(cls)]

    @classmethod
    def yaml_names(cls) -> list[str]:
        """The settings conf/decode/*.yaml list (the others are the evaluator's grid or a serving choice)."""
        return [f.name for f in fields(cls) if f.metadata["cli"].get("yaml", True)]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    def replace(self, **changes) -> "DecodeSettings":
        """These settings with `changes` (settings' names; an old name is taken with a warning); checked."""
        return replace(self, **_known(changes))

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "DecodeSettings":
        """The settings a decode config (conf/decode, a plain mapping) gives; keys that are not settings (the
        evaluator's block_sizes and rules) are left to their reader."""
        given = {k: v for k, v in dict(cfg).items() if k in cls.names() or k in RENAMED}
        return cls(**_known(given))

    def as_config(self) -> dict[str, Any]:
        """The settings as a config or a report writes them (JSON types)."""
        out = {}
        for name in self.names():
            v = getattr(self, name)
            if name == "accept" and not isinstance(v, str):
                v = v.label
            out[name] = list(v) if isinstance(v, tuple) and name == "max_len" else v
        out["tree"] = tree_label(self.tree)
        return out

    # ---------------------------------------------------------------------------- resolved against a model
    @property
    def accept_label(self) -> str:
        """The rule as reports and the command line's summary name it: as written, or a rule object's label."""
        return self.accept if isinstance(self.accept, str) else self.accept.label

    def k(self, model_k: int, where: str = "this model") -> int:
        """The blockwise block size for a model with `model_k` heads (checked: at most model_k)."""
        k = model_k if self.block_size is None else self.block_size
        if self.block_size is not None and self.method == "blockwise":
            check_block_sizes([k], model_k, where)
        return k

    def adaptive_on(self, device) -> bool | float:
        """Adaptive feeding: None (auto, the default) turns it on where it cannot change the output and is measured
        -- the exact rule on the CPU -- so a batch whose heads do not pay decodes at greedy's speed and heads that
        pay keep most of their speedup; True / False / a threshold are the caller's choice."""
        if self.adaptive is None:
            return rule_spec(self.accept)[0] == "exact" and str(device).startswith("cpu")
        return self.adaptive


def tree_label(tree) -> str:
    """A candidate tree as written: ((0,), (1, 0)) -> '0;1,0'."""
    return ";".join(",".join(map(str, p)) for p in tree)


def _known(given: Mapping[str, Any]) -> dict[str, Any]:
    """`given` with old names mapped to new ones (one warning line each); an unknown name is a DecodeError."""
    out = {}
    names = DecodeSettings.names()
    for k, v in given.items():
        if k in RENAMED:
            warnings.warn(f"decode setting {k} is now {RENAMED[k]}", DeprecationWarning, stacklevel=3)
            k = RENAMED[k]
        if k not in names:
            raise DecodeError(f"unknown decode setting {k!r}: choose from {', '.join(names)}")
        out[k] = v
    return out


def default_block_sizes(k: int) -> list[int]:
    """The model's k and every smaller even k (k = 8 -> [8, 6, 4, 2]); [] for a plain model (k = 1)."""
    if k <= 1:
        return []
    return sorted({k, *range(2, k, 2)}, reverse=True)


def check_block_sizes(sizes: Sequence[int] | None, k: int, where: str) -> list[int]:
    """Block sizes to evaluate for a model with k heads. A plain model (k = 1) only has greedy decoding, whatever
    is asked (it is the reference column when base and heads runs are evaluated together)."""
    if sizes is None or k <= 1:
        return default_block_sizes(k)
    out = []
    for s in sizes:
        s = int(s)
        if s < 1:
            raise DecodeError(f"block size must be >= 1, got {s}")
        if s > k:
            raise DecodeError(f"block size {s} is above the k = {k} heads of {where}: use block sizes <= {k}")
        if s > 1 and s not in out:
            out.append(s)
    return out


# ------------------------------------------------------------------------------------------ the command line
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser, group_title: str | None = "decoding") -> None:
    """One flag per setting, `--<name-with-dashes>`, with the declared help and default; an old name (RENAMED) is
    taken as well. Flags default to None (not given): from_args keeps the declared default then."""
    group = parser.add_argument_group(group_title) if group_title else parser
    defaults = DecodeSettings.defaults()
    old = {new: o for o, new in RENAMED.items()}
    for f in fields(DecodeSettings):
        cli = {k: v for k, v in f.metadata["cli"].items() if k != "yaml"}
        shown = defaults[f.name]
        shown = (
            tree_label(shown) if f.name == "tree" else " ".join(map(str, shown)) if isinstance(shown, tuple) else shown
        )
        flags = [_flag(f.name)] + ([_flag(old[f.name])] if f.name in old else [])
        if f.name == "adaptive":
            cli = {"action": _adaptive_action()}
        group.add_argument(*flags, dest=f.name, default=None, help=f"{f.metadata['help']} (default: {shown})", **cli)


def _adaptive_action():
    import argparse

    class Adaptive(argparse.Action):
        """--adaptive (true), --no-adaptive (false), --adaptive=T (a threshold or auto)."""

        def __init__(self, option_strings, dest, **kw):
            kw.pop("nargs", None)
            opts = list(option_strings) + [o.replace("--", "--no-", 1) for o in option_strings]
            super().__init__(opts, dest, nargs="?", **kw)

        def __call__(self, parser, namespace, values, option_string=None):
            if option_string and option_string.startswith("--no-"):
                setattr(namespace, self.dest, False)
            else:
                setattr(namespace, self.dest, True if values is None else values)

    return Adaptive


def from_args(args, defaults: Mapping[str, Any] | None = None, **changes) -> DecodeSettings:
    """The settings a command line gave (add_arguments's flags; not given: `defaults`, e.g. a bundle's, else the
    declared default), with `changes`."""
    given = {name: getattr(args, name) for name in DecodeSettings.names() if getattr(args, name, None) is not None}
    return DecodeSettings(**{**dict(defaults or {}), **given, **changes})


def carried(meta: Mapping[str, Any] | None, where: str) -> tuple[dict[str, Any], str | None]:
    """The decode settings a bundle carries (its config.json "decode": {"settings", "why"}, written by export.py
    from its evaluation) as (settings, why), checked: a bad value is one DecodeError naming the bundle; settings
    this version does not know are left out with a warning. ({}, None) where it carries none."""
    d = (meta or {}).get("decode")
    if not d:
        return {}, None
    if not isinstance(d, Mapping) or not isinstance(d.get("settings", {}), Mapping):
        raise DecodeError(f"{where}: config.json's decode entry must be {{'settings': {{...}}, 'why': ...}}")
    given = dict(d.get("settings") or {})
    unknown = sorted(k for k in given if k not in DecodeSettings.names() and k not in RENAMED)
    if unknown:
        warnings.warn(f"{where}: decode settings {unknown} are not known to this version; left out", stacklevel=2)
    given = {k: v for k, v in given.items() if k not in unknown}
    try:
        DecodeSettings(**_known(given))
    except DecodeError as e:
        raise DecodeError(f"{where}: its decode settings: {e}") from None
    return given, (str(d["why"]) if d.get("why") else None)
