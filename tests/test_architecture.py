"""The package's layering, read from its imports with `ast` (module level and inside functions alike): the decode
engine stands alone, and the data side imports no decoder."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "bpd_train"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import anywhere in `source` (the module named `module`): `import a.b`, `from a
    import b` (as a.b too: b may be a submodule), relative imports resolved, and importlib.import_module /
    __import__ calls with a literal name."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)] if node.level > 1 else anchor
                base = ".".join(anchor + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return out


def violations(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    """Imports of `forbidden` packages (bpd_train.X and its submodules) by any module under bpd_train/`layer`."""
    bad = []
    for path in sorted((PKG / layer).rglob("*.py")):
        mod = _module_name(path)
        for line, name in imported_modules(path.read_text(encoding="utf-8"), mod, path.name == "__init__.py"):
            if any(name == f"bpd_train.{f}" or name.startswith(f"bpd_train.{f}.") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT).as_posix()}:{line}: imports {name}")
    return sorted(set(bad))


def test_the_import_reader_sees_every_form():
    src = ("import bpd_train.model.lm\n"
           "from bpd_train import decoding\n"
           "def f():\n"
           "    from ..data import corpus\n"
           "    import importlib\n"
           "    importlib.import_module('bpd_train.evaluation.metrics')\n"
           "class C:\n"
           "    def g(self):\n"
           "        from .packed import DecodeWeights\n")
    names = {n for _, n in imported_modules(src, "bpd_train.engine.x")}
    assert {"bpd_train.model.lm", "bpd_train.decoding", "bpd_train.data.corpus", "bpd_train.evaluation.metrics",
            "bpd_train.engine.packed.DecodeWeights"} <= names
    pkg = {n for _, n in imported_modules("from . import step\n", "bpd_train.engine", is_package=True)}
    assert "bpd_train.engine.step" in pkg


def test_the_engine_imports_no_model_decoder_data_or_evaluation():
    """engine/ is the layer below the models and decoders: they call into it and give it what it must know (head
    kinds, stop ids, rotary tables in the decoder state), never the reverse."""
    bad = violations("engine", ("model", "decoding", "data", "evaluation"))
    assert not bad, "\n".join(bad)


def test_data_imports_no_decoder_evaluation_or_training():
    """data/ prepares corpora; decoding (e.g. distilled targets), scoring and training are the callers' business
    (what both sides need, max_len and the BLEU scorer, lives below them: bpd_train/max_len.py, scoring.py)."""
    bad = violations("data", ("decoding", "evaluation", "training", "distillation"))
    assert not bad, "\n".join(bad)


def test_the_model_imports_nothing_from_the_layers_above_it():
    """model/ is pure torch: the stages that train, evaluate, distill, load, convert or bundle a model, and the data
    side, call into it, never the reverse (bpd_train/families reads the model's classes, the model not the families)."""
    bad = violations("model", ("training", "evaluation", "distillation", "data", "loading", "convert", "bundle",
                               "families"))
    assert not bad, "\n".join(bad)
