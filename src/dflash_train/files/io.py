"""Whole files and folders, written so that a reader (or a kill) never sees half of one, and JSON read back with
its damage named. One helper puts a finished file in place (`replace_file`), one a finished folder
(`replace_dir`); every writer of the package goes through them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import DamagedFileError

# ------------------------------------------------------------------------------------------------ files


def replace_file(tmp: Path, final: Path) -> None:
    """Move a finished temp file to `final` in one rename; a file already there is replaced."""
    os.replace(tmp, final)


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a temp file beside `path` and a rename; a failed write leaves no temp file behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        replace_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


def read_json_file(path: Path, remedy: str) -> Any:
    """The JSON value in `path`; an empty, cut or garbled file raises DamagedFileError naming it and `remedy`."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        problem = f"not UTF-8 text: invalid byte at offset {e.start}"
    except json.JSONDecodeError as e:
        problem = "empty" if not data.strip() else f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        problem = "not valid JSON: nested too deeply"
    raise DamagedFileError(path, problem, remedy, size=len(data))


# ------------------------------------------------------------------------------------------------ folders


def temp_dir_beside(final: Path) -> Path:
    """A fresh hidden folder next to `final` (same filesystem: `replace_dir` is then a rename)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def move_aside(path: Path) -> Path:
    """Rename `path` to a free `NAME.old-YYYYmmdd-HHMMSS[-k]` beside it (never deletes); returns the new name."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        dest = path.with_name(f"{path.name}.old-{stamp}" + (f"-{k}" if k else ""))
        if not dest.exists():
            path.rename(dest)
            return dest
    raise FileExistsError(f"no free name to move {path} aside")


def hidden_old_name(final: Path) -> Path:
    """Where `replace_dir` keeps the folder it replaces until the new one is in place: `.NAME.old-<pid>`."""
    return final.with_name(f".{final.name}.old-{os.getpid()}")


def fsync_tree(path: Path) -> None:
    """Flush every file and folder under `path`, and `path`, to the disk."""
    for f in sorted(Path(path).rglob("*"), reverse=True):
        fsync_path(f)
    fsync_path(path)


def fsync_path(path: Path) -> None:
    """Flush one file or directory entry to the disk (a filesystem that cannot fsync a directory is let be: the
    rename is still atomic)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path, *, keep_old: bool = False,
                complete: Optional[Callable[[Path], bool]] = None, durable: bool = False) -> Optional[Path]:
    """Put the finished temp folder `tmp` in place of `final` by renames: a kill at any moment leaves the old
    folder or the new one, never half of one (between the two renames the old one waits at `hidden_old_name`,
    where a caller that knows a complete folder by its contents can restore it). Whatever stood at `final` (a folder,
    a file or a link) is, with `keep_old`, moved aside to NAME.old-<time> and kept (its new path is returned); else
    moved to the hidden name and deleted after the rename, or put back if the rename fails. With `complete`, a
    `final` for which it holds is left as it is and `tmp` stays for the caller to delete: another process finished
    the same folder first. `durable`: `tmp`'s files are flushed to the disk before it moves, the parent folder
    after (the new folder survives a power loss whole)."""
    if complete is not None and complete(final):
        return None
    if durable:
        fsync_tree(tmp)
    if not (final.exists() or final.is_symlink()):
        _rename_into(tmp, final, complete)
    elif keep_old:
        moved = move_aside(final)
        _rename_into(tmp, final, complete)
        if durable:
            fsync_path(final.parent)
        return moved
    else:
        old = hidden_old_name(final)
        os.replace(final, old)
        try:
            _rename_into(tmp, final, complete)
        except BaseException:
            if not (final.exists() or final.is_symlink()):
                os.replace(old, final)
            raise
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:  # a file or a link where the folder goes: it was replaced too, so it must not stay behind
            old.unlink(missing_ok=True)
    if durable:
        fsync_path(final.parent)
    return None


def _rename_into(tmp: Path, final: Path, complete: Optional[Callable[[Path], bool]]) -> None:
    try:
        os.replace(tmp, final)
    except OSError:
        if complete is None or not complete(final):  # not another process winning the race to `final`
            raise
