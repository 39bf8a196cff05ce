"""Modes of what the tool writes for others to read (exports, checkpoints, prepared data, the converted
target cache): those of ordinary files under the process umask, 0644 / 0755 under umask 022.

The atomic writes build their output in a private temp folder (tempfile.mkdtemp makes it 0700) and
safetensors writes its file 0600; without this, a serving engine running under another account could
not read an exported drafter.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def current_umask() -> int:
    """The process umask. Linux (4.7+) reports it in /proc/self/status; elsewhere it is set and put back
    at once, the only portable way to read it."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def follow_umask(root: Path) -> None:
    """Give `root` (a file, or a folder and everything in it) the modes an ordinary file or folder made now
    would have: 0o666 / 0o777 less the umask. Only for trees this process has just written."""
    mask = current_umask()
    root = Path(root)
    if root.is_symlink():
        return
    if not root.is_dir():
        os.chmod(root, 0o666 & ~mask)
        return
    os.chmod(root, 0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)
