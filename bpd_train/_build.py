"""Build step (pyproject.toml: tool.setuptools.cmdclass): a wheel carries the Hydra configs and the bundled corpus.

A clone keeps conf/ and data/ at the top level (python train.py works there); a wheel copies them to
bpd_train/_root/conf and bpd_train/_root/data, where bpd_train.REPO_ROOT points once installed. An editable install
reads the clone's own folders, so nothing is copied for it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools.command.build_py import build_py

SHIPPED = ("conf", "data/bible-en-fr", "data/README.md")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        here = Path(__file__).resolve().parent.parent
        dest = Path(self.build_lib) / "bpd_train" / "_root"
        for rel in SHIPPED:
            src, out = here / rel, dest / rel
            if src.is_dir():
                shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            elif src.is_file():
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)
