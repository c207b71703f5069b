"""Atomic file output and content hashes: a crash never leaves a half-written checkpoint, shard or bundle.

Files and folders end with the permissions the user's umask gives (tempfile would leave 0600/0700)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
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


def _temp_prefix(name: str) -> str:
    # host and pid in the name: a later run removes a temp file only once the process that made it is gone
    return f".{name}.{_TMP_TAG}-{socket.gethostname()}-{os.getpid()}-"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path.name), suffix=".tmp")
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


def stale_temp_files(folder: str | os.PathLike, name: str) -> list[Path]:
    """The temp files atomic_write_*(folder/name) left behind in processes that no longer run on this host. Temp
    files of a live process, of another host (a shared file system) or not named by us are never listed."""
    pattern = re.compile(rf"^\.{re.escape(name)}\.{_TMP_TAG}-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+\.tmp$")
    host, out = socket.gethostname(), []
    for p in Path(folder).glob(f".{glob.escape(name)}.{_TMP_TAG}-*.tmp"):
        m = pattern.match(p.name)
        if m and m["host"] == host and not _pid_alive(int(m["pid"])) and p.is_file() and not p.is_symlink():
            out.append(p)
    return out


def outside(folder: str | os.PathLike, name: str) -> str | None:
    """Why `folder/name` is not a file of `folder` (an absolute name, a '..' part, or a symlink that resolves
    elsewhere), or None when it is. A Hugging Face hub cache snapshot (<repo>/snapshots/<rev>/) holds links into
    its repository's blobs/ folder: those count as inside."""
    rel = Path(str(name))
    if rel.is_absolute() or ".." in rel.parts or str(name) in ("", "."):
        return f"{name!r} is not a plain relative name"
    folder = Path(folder)
    base = folder.resolve()
    target = (folder / rel).resolve()
    roots = [base]
    if base.parent.name == "snapshots" and (base.parent.parent / "blobs").is_dir():
        roots.append((base.parent.parent / "blobs").resolve())
    for root in roots:
        if target == root or root in target.parents:
            return None
    return f"{Path(folder) / rel} resolves to {target}, outside {base}"


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


_AT_FDCWD, _RENAME_NOREPLACE = -100, 1


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_RENAMEAT2 = _renameat2()


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` to `dst` only if nothing is at `dst`, not even an empty folder (FileExistsError otherwise):
    renameat2(RENAME_NOREPLACE) where Linux and the file system have it; elsewhere a check, then rename(2), which
    leaves one window: an empty folder created at `dst` between the two would be replaced (a non-empty one never)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(src), None, str(dst))  # EEXIST -> FileExistsError
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _keep(old: Path, path: Path) -> Path:
    """Move a folder out of the 'old' sibling name (which a later run would clean up) to one no cleanup matches."""
    kept = path.with_name(f"{path.name}.kept-{os.getpid()}-{old.name.rsplit('-', 1)[-1]}")
    try:
        rename_noreplace(old, kept)
    except OSError:
        return old
    return kept


@contextlib.contextmanager
def atomic_dir(
    path: str | os.PathLike, overwrite: bool = False, replaceable: Callable[[Path], bool] | None = None
) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it is renamed to `path` in one step.

    With overwrite=False an existing `path` is an error (nothing is touched). With overwrite=True an existing
    folder is replaced only when it is empty or `replaceable(path)` says it is one this code wrote (never a user's
    folder or file: FileExistsError, nothing touched); the old folder is moved aside first and removed only after
    the new one is in place. Temp folders a killed earlier call left behind are removed first.

    The final step replaces only what was checked at the start: whatever appears at `path` meanwhile (another
    tool's folder, a second writer's output) is never moved or deleted, and this call fails with FileExistsError
    instead, so of two concurrent writers exactly one succeeds.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(path)
    seen = _identity(path)
    if seen is not None:
        if not overwrite:
            raise FileExistsError(f"{path} already exists; remove it or pass overwrite=True")
        if path.is_symlink() or not path.is_dir():
            raise FileExistsError(f"{path} exists and is not a folder; not replacing it")
        if any(path.iterdir()) and not (replaceable and replaceable(path)):
            raise FileExistsError(f"{path} exists and is not a folder this program wrote; not replacing it")
    tmp = _sibling(path, "tmp")
    try:
        yield tmp
        raced = FileExistsError(
            f"{path} appeared or changed while this was being written (another program or a "
            "second run writing the same output); nothing was replaced: choose another output"
        )
        if seen is None:
            try:
                rename_noreplace(tmp, path)
            except FileExistsError:
                raise raced from None
            return
        old = tmp.with_name(f".{path.name}.{_TMP_TAG}-old-" + tmp.name[len(f".{path.name}.{_TMP_TAG}-tmp-") :])
        try:
            rename_noreplace(path, old)
        except FileNotFoundError:  # removed meanwhile: nothing left to replace
            old = None
        if old is not None and (
            _identity(old) != seen
            or old.is_symlink()
            or not old.is_dir()
            or (any(old.iterdir()) and not (replaceable and replaceable(old)))
        ):
            try:
                rename_noreplace(old, path)  # not the folder checked at the start: put it back untouched
            except OSError:
                raise FileExistsError(f"{raced} (what was at {path} is kept as {_keep(old, path)})") from None
            raise raced
        try:
            rename_noreplace(tmp, path)
        except FileExistsError:
            kept = f" (the previous output is kept as {_keep(old, path)})" if old is not None else ""
            raise FileExistsError(f"{raced}{kept}") from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
