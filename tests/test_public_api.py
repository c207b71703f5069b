"""The public API is declared: `bpd_train.__all__` lists the names `from bpd_train import ...` gives, the lazy ones
(which import torch on first use) are visible to type checkers through `if TYPE_CHECKING:` imports, the package ships
`py.typed`, and the public functions of the command-line layer carry type hints."""

import ast
import inspect
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO_ROOT

INIT = REPO_ROOT / "bpd_train" / "__init__.py"


def test_all_names_resolve_and_import_stays_light():
    code = (
        "import sys, bpd_train\n"
        "assert 'torch' not in sys.modules, 'import bpd_train imported torch'\n"
        "missing = [n for n in bpd_train.__all__ if not hasattr(bpd_train, n)]\n"
        "assert not missing, missing\n"
        "ns = {}\nexec('from bpd_train import *', ns)\n"
        "assert set(bpd_train.__all__) <= set(ns), sorted(set(bpd_train.__all__) - set(ns))\nprint('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def _type_checking_names() -> set[str]:
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                names |= {a.asname or a.name for a in imp.names}
    return names


def test_lazy_names_are_declared_for_type_checkers():
    """Every name the module-level __getattr__ serves is imported under TYPE_CHECKING and listed in __all__."""
    import bpd_train

    lazy = {n for n in bpd_train.__all__ if n not in vars(bpd_train)}
    assert lazy == _type_checking_names() == {"Translator", "Output", "load_bundle"}
    with pytest.raises(AttributeError):
        bpd_train.not_a_name  # noqa: B018


def test_package_is_marked_typed():
    assert (REPO_ROOT / "bpd_train" / "py.typed").is_file()
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["bpd_train"]


@pytest.mark.parametrize("module", ["bpd_train", "bpd_train.app.cli", "bpd_train.app.commands"])
def test_public_functions_have_type_hints(module):
    import importlib

    mod = importlib.import_module(module)
    bare = []
    for name, fn in vars(mod).items():
        if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
            continue
        sig = inspect.signature(fn)
        bare += [
            f"{name}({p})"
            for p in sig.parameters.values()
            if p.annotation is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if sig.return_annotation is inspect.Signature.empty:
            bare.append(f"{name} -> ?")
    assert not bare, bare
