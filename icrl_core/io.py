"""Atomic file and folder writes: a reader sees the old version or the new one, never half of one."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from icrl_core.errors import UserError


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_user_bytes(path: Path | str, what: str = "file", hint: str = "",
                    error: type[UserError] = UserError) -> bytes:
    """The bytes of a file the user named (or configured). Any reason it cannot be read (missing, a directory,
    no permission) is an `error` (a UserError: exit code 2) that names the path; `what` says what the file
    should be, `hint` how to get it."""
    path = Path(path)
    hint = f" ({hint})" if hint else ""
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        raise error(f"{path}: {what} not found{hint}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected the {what}{hint}") from None
    except PermissionError:
        raise error(f"{path}: no permission to read the {what}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None


def read_user_text(path: Path | str, what: str = "file", hint: str = "",
                   error: type[UserError] = UserError) -> str:
    """`read_user_bytes` decoded as UTF-8; text in another encoding is an `error` naming the byte."""
    raw = read_user_bytes(path, what, hint, error)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: the {what} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory; give a file path to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # renameat2(2) flags (Linux >= 3.15)
_AT_FDCWD = -100


@functools.lru_cache(maxsize=1)
def _libc_renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None


def _renameat2(source: Path, target: Path, flags: int) -> bool:
    """renameat2(source, target, flags); False where the call or the flag is unsupported (other systems, some
    filesystems): the caller falls back to plain renames."""
    call = _libc_renameat2()
    if call is None:
        return False
    if call(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(source), None, str(target))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_LEFTOVER = re.compile(r"old-(?P<old>\d+)|(?P<tmp>\d+)\.[^.]+\.tmp")


def _leftovers(path: Path) -> Iterator[tuple[Path, str, int]]:
    """(folder, kind, pid) of the hidden siblings atomic_dir makes for `path`: `.NAME.PID.*.tmp` (the new
    version being written, or the old one after an exchange) and `.NAME.old-PID` (the old version set aside)."""
    for sibling in path.parent.glob(f".{glob.escape(path.name)}.*"):
        found = _LEFTOVER.fullmatch(sibling.name[len(path.name) + 2:])
        if found:
            yield sibling, "old" if found["old"] else "tmp", int(found["old"] or found["tmp"])


def recover_dir(path: Path | str) -> None:
    """Finish what a process that died inside `atomic_dir(path)` left: with the two-rename fallback, a crash between
    the renames leaves `path` missing and the old version set aside, which goes back; anything else a dead process
    left beside `path` (a half-written new version, an old version already replaced) is removed. Folders of
    live processes (this one included) are left alone. `atomic_dir` calls it first."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    for sibling, kind, pid in sorted(_leftovers(path), key=lambda item: item[1] != "old"):
        if _pid_alive(pid):  # this process too: another thread may be writing
            continue
        if kind == "old" and not path.exists():
            os.replace(sibling, path)
            _fsync_dir(path.parent)
        else:
            shutil.rmtree(sibling, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: Path | str, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it takes the place of `path` atomically: readers see the old
    folder or the new one, also if this process dies at any point.

    Replacing an existing folder is one `renameat2(RENAME_EXCHANGE)` (Linux): the two folders swap names, then the
    old one is deleted. Where that is unsupported: `path` -> `.NAME.old-PID`, the new folder -> `path`, delete the
    old; a crash between the two renames leaves the old folder set aside, and the next `atomic_dir(path)` (or
    `recover_dir(path)`) puts it back. `overwrite=False` raises FileExistsError if `path` exists (atomically
    where RENAME_NOREPLACE is supported)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        for child in tmp.rglob("*"):
            if child.is_file():
                with open(child, "rb") as handle:
                    os.fsync(handle.fileno())
        _fsync_dir(tmp)
        if path.exists():
            if not overwrite:
                raise FileExistsError(path)
            if not _renameat2(tmp, path, RENAME_EXCHANGE):  # exchanged: tmp now holds the old folder
                old = path.with_name(f".{path.name}.old-{os.getpid()}")
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
        elif not _renameat2(tmp, path, RENAME_NOREPLACE):
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def exclusive_lock(path: Path | str, on_wait=None) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing) until the block ends; another holder makes
    this wait (`on_wait()` is called once first). The OS drops the lock when its process dies, so a killed holder
    never blocks the next one."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_folder(folder: Path | str) -> str:
    """The sha256 of a folder's files (names and bytes, not subfolders): rewriting any file changes it."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    return hashlib.sha256("".join(f"{p.name}:{sha256_file(p)};" for p in files).encode()).hexdigest()
