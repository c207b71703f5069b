"""The package's layering, read from its imports with `ast` (module level and inside functions alike): the decode
engine stands alone, the data side imports no decoder, the model nothing above it, and no import circle anywhere
(docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

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
                anchor = anchor[: len(anchor) - (node.level - 1)] if node.level > 1 else anchor
                base = ".".join(anchor + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
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
    src = (
        "import bpd_train.model.lm\n"
        "from bpd_train import decoding\n"
        "def f():\n"
        "    from ..data import corpus\n"
        "    import importlib\n"
        "    importlib.import_module('bpd_train.evaluation.metrics')\n"
        "class C:\n"
        "    def g(self):\n"
        "        from .packed import DecodeWeights\n"
    )
    names = {n for _, n in imported_modules(src, "bpd_train.engine.x")}
    assert {
        "bpd_train.model.lm",
        "bpd_train.decoding",
        "bpd_train.data.corpus",
        "bpd_train.evaluation.metrics",
        "bpd_train.engine.packed.DecodeWeights",
    } <= names
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
    side, call into it, never the reverse (bpd_train/families reads the model's classes, the model not the families).
    Nor does it import the decode engine: a decoder owns the decode options and packed weights and hands the step
    weights to the model (engine/weights.py PackedWeights)."""
    bad = violations(
        "model",
        ("engine", "training", "evaluation", "distillation", "data", "sources", "families", "app"),
    )
    assert not bad, "\n".join(bad)


ROOT_UTILITIES = ("io.py", "max_len.py", "scoring.py", "configs.py", "decode_settings.py", "_version.py")
# `python -m bpd_train.X` keeps working: thin modules at the root that only call bpd_train/app/X.py's main (export:
# re-exports the names `from bpd_train.export import load_bundle` takes, as older bundles' model cards write it)
ENTRY_POINTS = ("translate.py", "pipeline.py", "real_model.py", "export.py")
# the package's folders, bottom to top (docs/architecture.md); hf_generate/ is transformers' custom-generate code
# shipped inside exported models, which imports nothing of the package
LAYERS = (
    "engine",
    "model",
    "decoding",
    "data",
    "families",
    "sources",
    "training",
    "evaluation",
    "distillation",
    "app",
)


def test_the_package_root_holds_utilities_and_entry_points_only():
    """Every layer is a folder: the root keeps the package's __init__ and build helper, the small utilities below
    every layer and the thin `python -m` entry points; the layer list names the folders, each of which exists."""
    assert all((PKG / name).is_dir() and (PKG / name / "__init__.py").is_file() for name in LAYERS)
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert root == sorted(("__init__.py", "_build.py", *ROOT_UTILITIES, *ENTRY_POINTS)), root
    folders = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert folders == sorted((*LAYERS, "hf_generate")), folders


def test_the_entry_points_only_call_the_apps_main():
    """bpd_train/translate.py etc. import from their app module and nothing else of the package (the command lives
    in bpd_train/app/, where the layer rules read it), and define nothing but the `__main__` call."""
    for name in ENTRY_POINTS:
        path = PKG / name
        source = path.read_text(encoding="utf-8")
        own = {m for _, m in imported_modules(source, _module_name(path)) if m.startswith("bpd_train")}
        stem = name.removesuffix(".py")
        assert own and all(m.startswith(f"bpd_train.app.{stem}") for m in own), (name, own)
        defined = [n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not defined, name


def test_the_root_utilities_import_no_layer():
    """The small modules at the package root sit under every layer (max_len and the BLEU scorer are shared by data/,
    decoding/ and evaluation/ through them), so they import none of the layers."""
    bad = []
    for name in ROOT_UTILITIES:
        path = PKG / name
        for line, mod in imported_modules(path.read_text(encoding="utf-8"), _module_name(path)):
            parts = mod.split(".")
            if parts[0] == "bpd_train" and len(parts) > 1 and parts[1] in LAYERS:
                bad.append(f"bpd_train/{name}:{line}: imports {mod}")
    assert not bad, "\n".join(bad)


def private_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, "module.name") for every `from <a module of the package> import _name` in `source` (module level or
    inside functions, relative imports resolved): a name with one leading underscore belongs to its own module."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)] if node.level > 1 else anchor
            base = ".".join(anchor + ([base] if base else []))
        if base.split(".")[0] != "bpd_train":
            continue
        out += [
            (node.lineno, f"{base}.{a.name}")
            for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")
        ]
    return out


def test_the_private_import_reader_sees_every_form():
    src = (
        "from bpd_train.data.corpus import _get, load_corpus\n"
        "def f():\n"
        "    from .cli import _hint\n"
        "from bpd_train._version import __version__\n"
        "from os import _exit\n"
    )
    got = [name for _, name in private_imports(src, "bpd_train.evaluation.runner")]
    assert got == ["bpd_train.data.corpus._get", "bpd_train.evaluation.cli._hint"]


def test_no_module_imports_another_modules_private_name():
    """A name with one leading underscore is its module's own: a name another module needs is public (or moves to
    where both can import it). bench/ is held to the same rule; the tests may reach inside a module."""
    bad = []
    for path in sorted([*PKG.rglob("*.py"), *(PKG.parent / "bench").rglob("*.py")]):
        mod = _module_name(path)
        for line, name in private_imports(path.read_text(encoding="utf-8"), mod, path.name == "__init__.py"):
            bad.append(f"{path.relative_to(ROOT).as_posix()}:{line}: imports {name}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------- the import graph
# The most function-local imports of the package's own modules allowed; lower it as imports move to module level.
MAX_LOCAL_OWN_IMPORTS = 60


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _in_functions(tree: ast.AST) -> set[int]:
    """ids of the nodes inside a function body (run when it is called, not at import)."""
    return {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for n in ast.walk(f)
        if n is not f
    }


def import_graph() -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    """({module: {imported module of the package: ["path:line", ...]}}, every function-local import of the package's
    own modules as "path:line"): imports at module level and inside functions alike, as the file-level graph counts
    them; `from pkg import name` is an edge to pkg.name when that is a module, else to pkg."""
    mods = _modules()

    def target(name: str) -> str | None:  # the module of the package an imported name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, list[str]]] = {m: {} for m in mods}
    local: list[str] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip, inside = _type_checking_only(tree), _in_functions(tree)
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom, ast.Call)):
                continue
            names = [n for line, n in imported_modules(ast.unparse(node), mod, path.name == "__init__.py")]
            if isinstance(node, ast.ImportFrom):  # `from a import b`: a.b when b is a module, else a
                base = names[0]
                names = [n if n in mods else base for n in names[1:]] or [base]
            hits = {t for t in map(target, (n for n in names if n.split(".")[0] == "bpd_train")) if t and t != mod}
            for t in hits:
                graph[mod].setdefault(t, []).append(f"{where}:{node.lineno}")
            if hits and id(node) in inside and not isinstance(node, ast.Call):
                local.append(f"{where}:{node.lineno}")
    return graph, local


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected group of two or more modules (Tarjan, then a search)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = sorted(w for w in graph[path[-1]] if w in group)
            if start in nxt:
                out.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return out


def test_the_cycle_finder_finds_a_circle():
    g = {"a": {"b": ["a.py:1"]}, "b": {"c": ["b.py:3"]}, "c": {"a": ["c.py:9"]}, "d": {"a": ["d.py:1"]}}
    assert cycles(g) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": []}, "b": {}}) == []


def test_no_import_circle_in_the_package():
    """Imports go down the layers (docs/architecture.md), at module level and inside functions alike: no module
    reaches itself through the package's own imports, package __init__ files included."""
    graph, _ = import_graph()
    found = cycles(graph)
    lines = [
        " -> ".join(c) + "\n    " + "; ".join(f"{a} -> {b} at {', '.join(graph[a][b])}" for a, b in zip(c, c[1:]))
        for c in found
    ]
    assert not found, "import circles:\n" + "\n".join(lines)


def test_function_local_imports_are_few():
    """Imports sit at module level, where they show what a module needs; inside a function only the package's
    modules that are kept off the import path on purpose (heavy or optional), within a bound that only goes down."""
    _, local = import_graph()
    assert len(local) <= MAX_LOCAL_OWN_IMPORTS, (
        f"{len(local)} function-local imports of bpd_train modules "
        f"(at most {MAX_LOCAL_OWN_IMPORTS}):\n" + "\n".join(local)
    )


def test_no_python_file_is_long():
    """No Python file over 600 lines (after `ruff format`): the package, bench/, tests/ and the entry points."""
    root = PKG.parent
    files = [*PKG.rglob("*.py"), *(root / "bench").rglob("*.py"), *(root / "tests").rglob("*.py"), *root.glob("*.py")]
    long = sorted(str(p.relative_to(root)) for p in files if len(p.read_text().splitlines()) > 600)
    assert not long, long


def test_a_moved_command_says_where_it_went():
    """`python -m bpd_train.training.zero_cpu` (the ZeRO command's old home) refuses with the new command instead
    of exiting 0 having done nothing."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "bpd_train.training.zero_cpu", "--stage=2"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 2 and "python -m bpd_train.app.zero_cpu" in r.stderr
