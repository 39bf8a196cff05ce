"""Bringing files back from the time-limited GPU machine, whose $OUT returns at most 8 files, 16 MiB each,
64 MiB in all, no deeper than two folders.

- `pack_drafter`: an exported drafter folder as `drafter.tar.gz` in parts of at most 15 MiB, with
  SHA256SUMS (deterministic: the same files give the same bytes); tools/join_drafter.sh checks and joins it.
- `pack_logs`: logs as one tar.gz; a file over a size keeps its tail.
- `bring_back`: summary files, the drafter and the logs into $OUT within the limits: the summary first,
  then the drafter, then the logs (the optional members dropped first when they do not fit).

Used by benchmarks/quality.py --copy-to (which puts tools/ on sys.path); no dependency beyond the standard
library. The target's own bundle for that machine is tools/gpu_bundle.sh + tools/gpu_assemble.sh.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional


@dataclass(frozen=True)
class OutLimits:
    files: int
    file_bytes: int
    total_bytes: int


OUT_LIMITS = OutLimits(files=8, file_bytes=16 * 2**20, total_bytes=64 * 2**20)
PART_BYTES = 15 * 2**20
DRAFTER_ARCHIVE = "drafter.tar.gz"
LOGS_ARCHIVE = "logs.tar.gz"


def part_suffix(k: int) -> str:
    """aa, ab, ..., az, ba, ...: the names `split -a 2` gives, so `cat NAME.part-*` joins them in order."""
    if k >= 26 * 26:
        raise ValueError("more than 676 parts")
    return chr(ord("a") + k // 26) + chr(ord("a") + k % 26)


class PartWriter:
    """A write-only file object that spreads its bytes over `folder/NAME.part-aa`, `-ab`, ... of at most
    `part_bytes` each, hashing every part and the whole."""

    def __init__(self, folder: Path, name: str, part_bytes: int):
        self.folder, self.name, self.part_bytes = folder, name, part_bytes
        self.parts: list[dict] = []
        self.whole = hashlib.sha256()
        self.size = 0
        self._f = None
        self._h = None
        self._n = 0

    def _rotate(self) -> None:
        self._close_part()
        part = f"{self.name}.part-{part_suffix(len(self.parts))}"
        self._f, self._h, self._n = open(self.folder / part, "wb"), hashlib.sha256(), 0
        self.parts.append({"name": part})

    def _close_part(self) -> None:
        if self._f is not None:
            self._f.close()
            self.parts[-1].update(sha256=self._h.hexdigest(), bytes=self._n)
            self._f = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.whole.update(view)
        self.size += len(view)
        while len(view):
            if self._f is None or self._n >= self.part_bytes:
                self._rotate()
            chunk = view[: self.part_bytes - self._n]
            self._f.write(chunk)
            self._h.update(chunk)
            self._n += len(chunk)
            view = view[len(chunk):]
        return len(data)

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if not self.parts:
            self._rotate()  # an empty stream still gets one (empty) part
        self._close_part()


def _deterministic_tarinfo(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644 if info.isfile() else 0o755
    return info


def pack_drafter(export: Path, dest: Path, part_bytes: int = PART_BYTES) -> dict:
    """The exported drafter folder as `dest/drafter.tar.gz.part-aa, -ab, ...` (each at most `part_bytes`)
    and `dest/SHA256SUMS` (sha256sum format: every part, then the whole archive). The archive holds the
    folder's files under their own names (no leading folder); same files -> same bytes. Joined and checked
    by tools/join_drafter.sh. Returns {"parts": [{name, sha256, bytes}], "archive_sha256", "archive_bytes",
    "files": {name: bytes}}."""
    export, dest = Path(export), Path(dest)
    if not (export / "model.safetensors").is_file():
        raise FileNotFoundError(f"{export} has no model.safetensors: not an exported drafter")
    dest.mkdir(parents=True, exist_ok=True)
    for old in list(dest.glob(f"{DRAFTER_ARCHIVE}.part-*")) + [dest / "SHA256SUMS"]:
        old.unlink(missing_ok=True)
    files = sorted(p for p in export.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(export).parts))
    writer = PartWriter(dest, DRAFTER_ARCHIVE, part_bytes)
    with gzip.GzipFile(filename="", mode="wb", fileobj=writer, compresslevel=6, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in files:
                tar.add(path, arcname=path.relative_to(export).as_posix(), recursive=False,
                        filter=_deterministic_tarinfo)
    writer.close()
    sums = "".join(f"{p['sha256']}  {p['name']}\n" for p in writer.parts)
    sums += f"{writer.whole.hexdigest()}  {DRAFTER_ARCHIVE}\n"
    (dest / "SHA256SUMS").write_text(sums)
    return {"parts": writer.parts, "archive_sha256": writer.whole.hexdigest(), "archive_bytes": writer.size,
            "files": {p.relative_to(export).as_posix(): p.stat().st_size for p in files}}


def pack_logs(members: list[tuple[Path, str]], out: Path, max_member_bytes: int = 8 * 2**20) -> list[str]:
    """`out` (tar.gz) holding each existing `(path, name)`; a file over `max_member_bytes` keeps its tail
    (its name gets `.tail`). Returns the names written."""
    written = []
    with tarfile.open(out, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for path, name in members:
            path = Path(path)
            if not path.is_file():
                continue
            size = path.stat().st_size
            if size <= max_member_bytes:
                tar.add(path, arcname=name, recursive=False, filter=_deterministic_tarinfo)
            else:
                with open(path, "rb") as f:
                    f.seek(size - max_member_bytes)
                    data = f.read()
                name += ".tail"
                info = _deterministic_tarinfo(tarfile.TarInfo(name))
                info.size, info.mtime = len(data), int(path.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
            written.append(name)
    return written


class _OutBudget:
    """Files and bytes already in $OUT (also those put there by someone else) against the limits."""

    def __init__(self, dest: Path, limits: OutLimits):
        others = [p for p in dest.rglob("*") if p.is_file()]
        self.limits, self.files, self.total = limits, len(others), sum(p.stat().st_size for p in others)

    def fits(self, n: int, size: int, largest: int) -> bool:
        lim = self.limits
        return self.files + n <= lim.files and self.total + size <= lim.total_bytes and largest <= lim.file_bytes

    def take(self, n: int, size: int) -> None:
        self.files, self.total = self.files + n, self.total + size


def bring_back(dest: Path, *, files: list[Path], drafter: Optional[Path], logs: list[tuple[Path, str]],
               optional_logs: list[tuple[Path, str]] = (), say: Callable[[str], None] = print,
               limits: OutLimits = OUT_LIMITS, part_bytes: int = PART_BYTES) -> None:
    """Into `dest` (the GPU machine's $OUT), within `limits`: each of `files` (that exists) under its own
    name; the exported `drafter` folder (None: none to bring) as drafter/{drafter.tar.gz.part-*, SHA256SUMS}
    or nothing of it; logs.tar.gz with `logs` and `optional_logs` ((path, name in the archive); the optional
    ones, in priority order, are left out from the last when the whole does not fit). What an earlier call left there is replaced; what did
    not fit is said."""
    dest.mkdir(parents=True, exist_ok=True)
    for src in files:
        (dest / src.name).unlink(missing_ok=True)
    (dest / LOGS_ARCHIVE).unlink(missing_ok=True)
    shutil.rmtree(dest / "drafter", ignore_errors=True)
    budget = _OutBudget(dest, limits)
    for src in files:
        if src.is_file() and budget.fits(1, src.stat().st_size, src.stat().st_size):
            shutil.copy(src, dest / src.name)
            budget.take(1, src.stat().st_size)
    if drafter is not None:
        _bring_drafter(drafter, dest, budget, say, part_bytes)
    _bring_logs(dest / LOGS_ARCHIVE, logs, optional_logs, budget, say)


def _bring_drafter(export: Path, dest: Path, budget: _OutBudget, say: Callable[[str], None], part_bytes: int) -> None:
    if not (export / "model.safetensors").is_file():
        say(f"copy-to: no exported drafter in {export} yet: nothing to bring back of it")
        return
    try:
        packed = pack_drafter(export, dest / "drafter", part_bytes)
    except BaseException:
        shutil.rmtree(dest / "drafter", ignore_errors=True)  # no half set of parts
        raise
    n = len(packed["parts"]) + 1
    size = sum(p["bytes"] for p in packed["parts"]) + (dest / "drafter" / "SHA256SUMS").stat().st_size
    if budget.fits(n, size, max(p["bytes"] for p in packed["parts"])):
        budget.take(n, size)
        say(f"copy-to: drafter {export} -> {dest / 'drafter'}: {DRAFTER_ARCHIVE} in {n - 1} parts "
            f"({size / 2**20:.1f} MiB, sha256 {packed['archive_sha256'][:16]}...); here: "
            "tools/join_drafter.sh <files>/drafter <new folder>")
    else:
        shutil.rmtree(dest / "drafter")
        say(f"copy-to: the drafter does not fit ({n} files, {size / 2**20:.1f} MiB with {budget.files} files, "
            f"{budget.total / 2**20:.1f} MiB already there; limits {budget.limits}): NOT copied back")


def _bring_logs(out: Path, logs: list[tuple[Path, str]], optional_logs: list[tuple[Path, str]], budget: _OutBudget,
                say: Callable[[str], None]) -> None:
    size = 0
    optional_logs = list(optional_logs)  # in priority order: the last ones go first when the archive is too big
    for members in (list(logs) + optional_logs[:k] for k in range(len(optional_logs), -1, -1)):
        names = pack_logs(members, out)
        size = out.stat().st_size
        if budget.fits(1, size, size):
            say(f"copy-to: {LOGS_ARCHIVE} ({size / 2**20:.2f} MiB): {', '.join(names)}")
            return
    out.unlink()
    say(f"copy-to: {LOGS_ARCHIVE} does not fit ({size / 2**20:.1f} MiB; {budget.files} files, "
        f"{budget.total / 2**20:.1f} MiB there already): not copied")
