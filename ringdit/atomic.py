"""Files written whole or not at all: every file ringdit writes for a user (checkpoints, exports, LoRA adapters,
shards, samples.npz) goes through ``atomic_write``, so a kill at any moment leaves either the previous file or the
complete new one, never a torn one; and a new file gets the mode ``open()`` would give it (the umask's)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def file_mode() -> int:
    """The mode ``open()`` / ``torch.save`` give a new file: 0o666 minus this process's umask."""
    try:
        with open("/proc/self/status") as status:  # Linux: read without changing it
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, but only for an instant)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_write(path: str | Path):
    """Yield a temporary path beside ``path`` to write; on success it gets the usual new-file mode (umask
    respected, instead of mkstemp's 0600, which would hide the file from a shared group), is fsynced and renamed
    onto ``path`` (atomic on POSIX), and the rename is made durable; on failure it is removed. Temporary files left
    by an earlier write of ``path`` that was killed are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.close(fd)
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fchmod(fd, file_mode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
