"""Atomic file output and content hashes: a crash never leaves a half-written checkpoint, shard or bundle.

Files and folders end with the permissions the user's umask gives (tempfile would leave 0600/0700)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask can only set-and-return)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


_TMP_TAG = "bpd"  # temp siblings: .<name>.bpd-{tmp,old}-<host>-<pid>-<random>, so only ours are ever cleaned up


def _sibling_re(name: str) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(name)}\.{_TMP_TAG}-(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_siblings(path: str | os.PathLike) -> list[Path]:
    """Remove the temp/old folders that a killed atomic_dir(path) left beside `path`: only those named by our
    pattern, made on this host by a process that no longer runs (a live export's temp folder is left alone).
    A process killed between its two renames left the previous folder only as its 'old' sibling: put it back."""
    path = Path(path)
    pattern, host, removed = _sibling_re(path.name), socket.gethostname(), []
    if not path.parent.is_dir():
        return removed
    for p in path.parent.iterdir():
        m = pattern.match(p.name)
        if m and m["host"] == host and not _pid_alive(int(m["pid"])) and p.is_dir() and not p.is_symlink():
            if ".bpd-old-" in p.name and not path.exists() and any(p.iterdir()):
                os.replace(p, path)
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _sibling(path: Path, kind: str) -> Path:
    prefix = f".{path.name}.{_TMP_TAG}-{kind}-{socket.gethostname()}-{os.getpid()}-"
    d = tempfile.mkdtemp(dir=path.parent, prefix=prefix)
    os.chmod(d, 0o777 & ~umask())
    return Path(d)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False,
               replaceable: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it is renamed to `path` in one step.

    With overwrite=False an existing `path` is an error (nothing is touched). With overwrite=True an existing
    folder is replaced only when it is empty or `replaceable(path)` says it is one this code wrote (never a user's
    folder or file: FileExistsError, nothing touched); the old folder is moved aside first and removed only after
    the new one is in place. Temp folders a killed earlier call left behind are removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(path)
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{path} already exists; remove it or pass overwrite=True")
        if path.is_symlink() or not path.is_dir():
            raise FileExistsError(f"{path} exists and is not a folder; not replacing it")
        if any(path.iterdir()) and not (replaceable and replaceable(path)):
            raise FileExistsError(f"{path} exists and is not a folder this program wrote; not replacing it")
    tmp = _sibling(path, "tmp")
    try:
        yield tmp
        old = None
        if path.exists():
            old = _sibling(path, "old")
            os.replace(path, old)  # onto the empty folder mkdtemp made: rename(2) replaces an empty directory
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
