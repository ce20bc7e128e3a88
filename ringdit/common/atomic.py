"""Files written whole or not at all: every file ringdit writes for a user (checkpoints, exports, LoRA adapters,
shards, samples.npz) goes through ``atomic_write``, so a kill at any moment leaves either the previous file or the
complete new one, never a torn one; and a new file gets the mode ``open()`` would give it (the umask's)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import tempfile
import time
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
STALE_TEMPORARY_SECONDS = 600  # a write in progress (on another host) touches its file far more often than this
NEARLY_FULL_BYTES = 2**20  # a write that failed with less than this left failed for lack of space: torch.save's own
# writer reports that as "enforce fail at inline_container.cc ... unexpected pos", without an errno


class DiskFullError(OSError):
    """A write that failed because its file system (or the user's quota) is full; what was there before is intact."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]"
        return self.strerror or super().__str__()


def free_bytes(folder: str | Path) -> int | None:
    """Bytes this process can still write under ``folder`` (root may use the blocks reserved for it); None where
    the file system cannot say."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    return (stats.f_bfree if os.geteuid() == 0 else stats.f_bavail) * stats.f_frsize


def disk_full(error: BaseException, folder: str | Path) -> bool:
    """Whether ``error``, raised while writing under ``folder``, came from a full disk or quota: ENOSPC / EDQUOT
    anywhere in its chain, or (a writer that hides the errno) almost no space left now."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    free = free_bytes(folder)
    return free is not None and free < NEARLY_FULL_BYTES


def disk_full_error(path: str | Path, *, replaced: str) -> DiskFullError:
    """The one message for a write that filled the disk: what, where, how much is left, and what is still intact
    (``replaced``: the thing the write would have replaced, e.g. "the previous checkpoint")."""
    path = Path(path)
    free = free_bytes(path.parent)
    left = f"{free / 2**20:.1f} MiB left" if free is not None else "no space left"
    if path.exists():
        intact = f"{replaced} ({path}) is intact"
    else:  # a new file (step_*.ckpt): the newest of its kind beside it is the last good one
        siblings = [p for p in path.parent.glob(f"*{path.suffix}") if p.is_file() and p != path] if path.suffix else []
        newest = max(siblings, key=lambda p: p.stat().st_mtime, default=None)
        intact = f"nothing was written at {path}" + (f"; the last good one, {newest.name}, is intact" if newest else "")
    return DiskFullError(errno.ENOSPC, f"the disk is full: writing {path} failed ({left} on the file system of "
                                       f"{path.parent}); {intact}; free space (or write elsewhere) and run again")


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
    by an earlier write of ``path`` that was killed are removed first (not one another process is writing now). A write that fills the disk ends in one
    ``DiskFullError`` that says so, where, and that the previous ``path`` is intact."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not path.is_file():  # a FIFO, a device (/dev/null), a folder: a
        # rename would put a regular file in its place (as root, even over /dev/full)
        raise FileExistsError(errno.EEXIST, f"{path} exists and is not a regular file (a device, pipe or folder); "
                                            f"refusing to replace it: write to a file path", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_owner()}.", suffix=".tmp", dir=path.parent)
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
    except BaseException as error:
        full = isinstance(error, Exception) and disk_full(error, path.parent)  # before the partial file is gone
        Path(tmp).unlink(missing_ok=True)
        if full and not isinstance(error, DiskFullError):
            raise disk_full_error(path, replaced=f"the previous {path.name}") from error
        raise
    _fsync_folder(path.parent)


def _owner() -> str:
    """What a temporary file's name says of its writer: this process's id and (a digest of) its host name."""
    return f"{os.getpid()}-{hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]}"


def _writer_gone(temporary: Path, name: str) -> bool:
    """Whether the writer of ``temporary`` (``.<name>.<pid>-<host>.<random>.tmp``) is a process of this host that
    no longer runs; False where that cannot be told (another host, a name without its owner)."""
    owner = temporary.name[len(name) + 2:].split(".", 1)[0]
    pid, _, host = owner.partition("-")
    if not pid.isdigit() or host != _owner().partition("-")[2]:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it runs (as another user)
        return False
    return False


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files of writes of ``path`` that were killed: those whose writer (named in the file's
    name) no longer runs on this host, or untouched for ``STALE_TEMPORARY_SECONDS`` (a writer on another host). One
    being written (another run, or another test worker, writing the same cached shard at once) is kept: removing it
    would fail that write's rename."""
    now = time.time()
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):  # gone already: its writer renamed or removed it
            if _writer_gone(stale, path.name) or now - stale.stat().st_mtime > STALE_TEMPORARY_SECONDS:
                stale.unlink()


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
