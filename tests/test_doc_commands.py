"""Every shell command in README.md and docs/*.md runs as written, as far as can be checked without running it:
`python train.py ...` (and distill.py, evaluate.py, export.py, the bpd-* commands) compose with Hydra and pass the
pre-check a real run makes; the flags of `python -m bpd_train.X` and `python bench/X.py` parse with that command's
own parser; `make X` names a target of the Makefile; `pip install` names extras pyproject.toml declares; every file of
the repository a command names exists."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HYDRA_SCRIPTS = {
    "train.py": "train",
    "distill.py": "distill",
    "evaluate.py": "evaluate",
    "export.py": "export",
    "bpd-train": "train",
    "bpd-distill": "distill",
    "bpd-evaluate": "evaluate",
    "bpd-export": "export",
}
# folders of the repository whose files commands name (a file a command writes, e.g. under artifacts/, is not one)
REPO_DIRS = ("bench/", "conf/", "docs/", "slurm/", "tests/", "bpd_train/", ".ci/", "data/")
PLACEHOLDER = re.compile(r"<[A-Za-z][^<>]*>")  # <repository url>, <LM bundle>


def _blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each bash code block."""
    out, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        if lines[i].strip() in ("```bash", "```sh", "```shell", "```console"):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            out.append((start + 1, "\n".join(body)))
        i += 1
    return out


def _logical_lines(block: str) -> list[tuple[int, str]]:
    """Lines with their `\\` continuations joined (and a trailing `|` continued), comments dropped."""
    out, buf, first = [], "", 0
    for no, raw in enumerate(block.splitlines()):
        line = raw.rstrip()
        if not buf:
            first = no
        code = _strip_comment(line)
        if code.endswith("\\"):
            buf += code[:-1] + " "
            continue
        if code.rstrip().endswith("|"):
            buf += code + " "
            continue
        buf += code
        if buf.strip():
            out.append((first, buf.strip()))
        buf = ""
    if buf.strip():
        out.append((first, buf.strip()))
    return out


def _strip_comment(line: str) -> str:
    """The line without its `# comment` (a # inside quotes or a word stays)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every simple command of every bash block: variables the block assigns are substituted,
    pipelines and && / ; lists split, redirections and leading VAR=value assignments dropped."""
    found = []
    for path in DOCS:
        variables: dict[str, str] = {}  # a page's conventions (H=..., X=...) hold for its later blocks too
        for start, block in _blocks(path):
            for no, line in _logical_lines(block):
                where = f"{path.relative_to(ROOT)}:{start + no}"
                line = PLACEHOLDER.sub("PLACEHOLDER", line)
                for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
                    try:
                        words = shlex.split(part)
                    except ValueError as e:
                        found.append((where, ["<unparsable>", str(e), part]))
                        continue
                    words = _expand(words, variables)
                    words = _drop_redirections(words)
                    if not words:
                        continue
                    if len(words) == 1 and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                        name, value = words[0].split("=", 1)
                        variables[name] = value  # D="data=local ..." for the lines below
                        continue
                    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                        words = words[1:]  # PARTITION=gpu ... bash slurm/pipeline.sh
                    if words:
                        found.append((where, words))
    return found


def _expand(words: list[str], variables: dict[str, str]) -> list[str]:
    out = []
    for w in words:
        m = re.fullmatch(r"\$\{?(\w+)\}?", w)
        if m and m.group(1) in variables:
            out += shlex.split(variables[m.group(1)])
            continue
        out.append(re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), w))
    return out


def _drop_redirections(words: list[str]) -> list[str]:
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("<", ">", ">>", "2>", "2>&1", "&>"):
            skip = w != "2>&1"
        elif re.fullmatch(r"\d?>>?\S+|<\S+", w):
            continue
        else:
            out.append(w)
    return out


# ---------------------------------------------------------------------------------------------------- checks
def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M)}


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


class _Parsed(Exception):
    pass


def _parse_flags(monkeypatch, run, argv: list[str]) -> None:
    """Run a command's main() until its argparse parser has read argv: a bad flag exits 2 there; nothing runs."""
    orig_known = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        raise _Parsed(orig_known(self, args, namespace))

    def parse_args(self, args=None, namespace=None):
        ns, extra = orig_known(self, args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        raise _Parsed(ns)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    try:
        run(argv)
    except _Parsed:
        return
    except SystemExit as e:
        raise AssertionError(f"the flags do not parse (exit {e.code})") from None
    raise AssertionError("no argument parser read the flags")


def _python_target(words: list[str]) -> tuple[str, str, list[str]] | None:
    """('module' | 'script', name, argv) of `python -m X ...` / `python X.py ...` (also behind torchrun, srun)."""
    for i, w in enumerate(words):
        if re.fullmatch(r"(\S*/)?python3?", w) or w in ("torchrun",):
            rest = words[i + 1 :]
            while rest and rest[0].startswith("-") and rest[0] != "-m":
                rest = rest[1:]  # torchrun --nproc-per-node=4, python -u
            if rest[:1] == ["-m"] and len(rest) > 1:
                return "module", rest[1], rest[2:]
            if rest and rest[0].endswith(".py"):
                return "script", rest[0], rest[1:]
            return None
    return None


CMDS = commands()


def test_the_docs_hold_commands():
    """Not vacuously green: the extraction finds the commands the README shows."""
    flat = [" ".join(w) for _, w in CMDS]
    assert len(CMDS) > 60
    assert any(c.startswith("python train.py +regime=base experiment=demo data=local") for c in flat), flat[:20]
    assert any(c.startswith("make demo") for c in flat) and any("bpd_train.translate" in c for c in flat)
    assert not [c for c in flat if c.startswith("<unparsable>")], [c for c in flat if c.startswith("<unparsable>")]


def test_no_command_the_pinned_tools_lack():
    """The hub client installs `hf`; its old `huggingface-cli` is gone."""
    hits = [f"{w}: {' '.join(c)}" for w, c in CMDS if c[0] == "huggingface-cli"]
    hits += [str(p.relative_to(ROOT)) for p in DOCS if "huggingface-cli" in p.read_text(encoding="utf-8")]
    assert not hits, hits


def _ids(kind):
    return [f"{w} {' '.join(c)[:60]}" for w, c in CMDS if kind(c)]


def _is_hydra(c):
    t = _python_target(c)
    return (c[0] in HYDRA_SCRIPTS) or (
        t is not None
        and t[0] == "script"
        and Path(t[1]).name in HYDRA_SCRIPTS
        and Path(t[1]).parent in (Path("."), Path(""))
    )


HYDRA_CMDS = [(w, c) for w, c in CMDS if _is_hydra(c)]


@pytest.mark.parametrize("where,words", HYDRA_CMDS, ids=[f"{w}" for w, _ in HYDRA_CMDS])
def test_config_commands_compose(where, words):
    from bpd_train.app.cli import check_argv, check_config

    if words[0] in HYDRA_SCRIPTS:
        name, argv = HYDRA_SCRIPTS[words[0]], words[1:]
    else:
        _, script, argv = _python_target(words)
        name = HYDRA_SCRIPTS[Path(script).name]
    argv = [a for a in argv if "PLACEHOLDER" not in a and "..." not in a]
    try:
        if name == "train":
            check_argv(argv)
        check_config(name, argv, f"python {name}.py", environment=False)
    except SystemExit as e:
        pytest.fail(f"{where}: `{' '.join(words)}` is refused (exit {e.code}); stderr has the line")


PY_CMDS = [(w, c) for w, c in CMDS if not _is_hydra(c) and _python_target(c) is not None]


@pytest.mark.parametrize("where,words", PY_CMDS, ids=[f"{w}" for w, _ in PY_CMDS])
def test_python_commands_parse(where, words, monkeypatch):
    kind, name, argv = _python_target(words)
    if any("PLACEHOLDER" in a for a in argv):
        argv = [a if "PLACEHOLDER" not in a else "x" for a in argv]
    if kind == "module":
        if not name.startswith("bpd_train"):
            return  # another project's module (pip, venv, build)
        assert importlib.util.find_spec(name) is not None, f"{where}: no module {name}"
        module = importlib.import_module(name)
        main = getattr(module, "main", None)
        if main is None:  # python -m bpd_train.app.commands train ...: the config commands
            return
        _parse_flags(monkeypatch, lambda a: main(a), argv)
        return
    path = ROOT / name
    assert path.is_file(), f"{where}: {name} does not exist"
    spec = importlib.util.spec_from_file_location(f"doc_cmd_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(path.parent))
    spec.loader.exec_module(module)
    main = getattr(module, "main", None)
    if main is None:
        return  # a script without a parser of flags: its existence is what can be checked
    _parse_flags(monkeypatch, lambda a: main(a) if main.__code__.co_argcount else main(), argv)


MAKE_CMDS = [(w, c) for w, c in CMDS if c[0] == "make"]


@pytest.mark.parametrize("where,words", MAKE_CMDS, ids=[f"{w}" for w, _ in MAKE_CMDS])
def test_make_targets_exist(where, words):
    targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    missing = [t for t in targets if t not in _makefile_targets()]
    assert not missing, f"{where}: `{' '.join(words)}`: no Makefile target {missing}"


def test_pip_extras_and_files_exist():
    extras, bad = _extras(), []
    for where, words in CMDS:
        if "pip" in words[:3] and "install" in words:
            for w in words:
                for group in re.findall(r"\[([\w,.-]+)\]", w):
                    bad += [f"{where}: extra {e!r}" for e in group.split(",") if e not in extras]
            for flag, value in zip(words, words[1:]):
                if flag in ("-c", "-r", "--constraint", "--requirement") and not (ROOT / value).is_file():
                    bad.append(f"{where}: {value} does not exist")
    assert not bad, bad


def test_files_named_by_commands_exist():
    bad = []
    for where, words in CMDS:
        for w in words:
            value = w.split("=", 1)[1] if re.match(r"[\w.+-]+=", w) else w
            if value.startswith(REPO_DIRS) and not any(ch in value for ch in "*?{[") and "PLACEHOLDER" not in value:
                if not (ROOT / value).exists():
                    bad.append(f"{where}: {value}")
    assert not bad, bad


def test_hf_cli_flags_exist():
    """`hf download ... --local-dir DIR`: the hub client's own --help lists every flag the docs use."""
    import shutil
    import subprocess

    hf = shutil.which("hf") or str(Path(sys.executable).parent / "hf")
    uses = [(w, c) for w, c in CMDS if c[0] == "hf"]
    assert uses, "the docs show how to download a model with hf"
    if not Path(hf).exists():
        pytest.skip("the hub client's `hf` command is not installed here")
    for where, words in uses:
        r = subprocess.run([hf, words[1], "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{where}: `hf {words[1]}` is not a command of the hub client"
        missing = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in r.stdout]
        assert not missing, f"{where}: hf {words[1]} has no {missing}"


def test_regime_lists_name_every_regime():
    """The lists of regimes in the entry point's and the config's header comments are complete."""
    from bpd_train.app.cli import regime_names

    for name in ("train.py", "conf/train.yaml"):
        head = "\n".join((ROOT / name).read_text(encoding="utf-8").splitlines()[:4])
        missing = [r for r in regime_names() if not re.search(rf"\b{r}\b", head)]
        assert not missing, f"{name}'s header lists no {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_links_between_pages_resolve():
    """Every relative link of README.md and docs/*.md names a file of the repository, and its #anchor a heading."""
    bad = []
    for page in DOCS:
        text = page.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", dest.read_text(encoding="utf-8"), re.M)}
                if anchor not in heads:
                    bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, bad
