"""Where a checkpoint is and whether it is whole.

A checkpoint is one file (``torch.save``, ``.safetensors``) or a sharded folder written under FSDP
(``torch.distributed.checkpoint``: a ``.metadata`` index, the ``*.distcp`` shard files it lists, and Lightning's
``meta.pt``). A folder copied or synced only in part is refused by name here, in the launching process, instead of
failing in a rank after the run started. A sharded save replaces the previous folder by renames only
(``replace_folder``), and ``recover_checkpoint`` finishes one that a kill cut between its two renames.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ringdit.checkpoints.safe_dcp import SafeFileSystemReader
from ringdit.common.atomic import file_mode
from ringdit.common.errors import CheckpointError

SHARDED_METADATA = "meta.pt"  # Lightning's name for the non-tensor part (step, loops, hparams, ...)


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name if it has none), for one-line errors."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def checked_output(out: str | Path, *, folder: bool, what: str, overwrite: bool | None = None,
                   source: str | Path | None = None) -> Path:
    """``out=`` of an export, before anything is read or written: a folder path for what writes a folder (``folder``),
    a file path otherwise, and no file where a parent folder has to be. ``what`` names the export in the message.

    ``overwrite=False``: an existing ``out`` is refused (``True``: it is replaced, whole; None: not checked here, for
    callers that checked already). ``source``: the checkpoint being exported, which ``out`` may never be or hold,
    overwrite or not."""
    out = Path(out).expanduser()
    if source is not None:
        source = Path(source).expanduser().resolve()
        if out.resolve() == source or out.resolve() in source.parents:
            held = "is the checkpoint itself" if out.resolve() == source else f"holds the checkpoint {source}"
            raise CheckpointError(f"out={out} {held}: exporting would replace it; choose another out")
    if out.exists() and not out.is_dir() and not out.is_file():  # a device (/dev/null), a pipe, a socket
        raise CheckpointError(f"out={out} is not a regular file or folder (a device or pipe); {what} would replace "
                              f"it with its own: give a file or folder path")
    if folder and out.exists() and not out.is_dir():
        raise CheckpointError(f"out={out} is a file; {what} writes a folder: give a folder path")
    if not folder and out.is_dir():
        raise CheckpointError(f"out={out} is a folder; give the file to write ({what} writes one file), e.g. "
                              f"out={out / 'weights.safetensors'}")
    blocking = next((parent for parent in out.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise CheckpointError(f"cannot write out={out} ({blocking} is a file, not a folder); choose a writable "
                              f"{'folder' if folder else 'file'} path")
    if overwrite is False and (out.exists() or out.is_symlink()):
        raise CheckpointError(f"out={out} exists (a {'folder' if out.is_dir() else 'file'}); {what} would replace "
                              f"it: give a new out, or add overwrite=true to replace it")
    return out


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.is_dir() and (path / SHARDED_METADATA).is_file() and (path / ".metadata").is_file()


def existing_checkpoint(path: str | Path) -> Path:
    """``path`` (``~`` expanded) if it is a file or a complete sharded folder; else a CheckpointError that says which
    it is not."""
    path = Path(path).expanduser()
    if is_sharded_checkpoint(path):
        check_sharded_files(path)
        return path
    if path.is_dir() and any(path.glob("*.distcp")):  # the start of a sharded checkpoint, without its index
        missing = [name for name in (".metadata", SHARDED_METADATA) if not (path / name).is_file()]
        raise CheckpointError(f"{path} is an incomplete sharded checkpoint: {' and '.join(missing)} missing (copied "
                              f"or synced only in part?); copy the whole folder again, or use an earlier checkpoint")
    if path.is_dir():  # e.g. a pipeline folder whose model_index.json is missing
        raise CheckpointError(f"checkpoint {str(path)!r} is a folder that is neither a sharded checkpoint (no "
                              f".metadata) nor a diffusers pipeline folder (no model_index.json); give a .ckpt or "
                              f".safetensors file, a sharded checkpoint folder, or a folder "
                              f"DiffusionPipeline.save_pretrained wrote")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    return path


def check_sharded_files(path: Path) -> None:
    """Every shard file the folder's ``.metadata`` indexes is there and long enough. Reads only the index; no tensor
    data."""
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - a torn or foreign .metadata: whatever unpickling it raised
        raise CheckpointError(f"{path}: its .metadata is not readable ({first_line(error)}); the checkpoint is "
                              f"damaged: copy it again, or use an earlier checkpoint") from None
    needed: dict[str, int] = {}  # shard file -> bytes its entries reach
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    problems = []
    for name, end in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            problems.append(f"{name} is missing")
        elif shard.stat().st_size < end:
            problems.append(f"{name} is truncated ({shard.stat().st_size} of {end} bytes)")
    if problems:
        shown = ", ".join(problems[:5]) + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"{path} is an incomplete sharded checkpoint: {shown} (of the {len(needed)} shard "
                              f"files its .metadata lists); copy the whole folder again, or use an earlier checkpoint")


# ---- replacing a sharded folder, and recovering from a kill in between ---------------------------------------------


def temporary_folder(path: Path) -> str:
    """A new, empty folder beside ``path`` to write its replacement into (``.<name>.*.tmp``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o777 & ~(0o666 & ~file_mode()))  # as mkdir would (umask applied): mkdtemp's 0700 is private
    return tmp


def replace_folder(new: Path, target: Path) -> None:
    """Put the complete folder ``new`` at ``target``. A directory cannot be renamed over another one atomically, so
    the old one is first renamed aside (``.<name>.old``); ``recover_checkpoint`` puts it back if a kill falls
    between the two renames. Every step is a rename: ``target`` is never a partly written folder."""
    old = target.with_name(f".{target.name}.old")
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()
    for stale in target.parent.glob(f".{target.name}.*.tmp"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)


def recover_checkpoint(path: str | Path) -> None:
    """Finish a sharded save that was killed between the two renames of ``replace_folder``: the previous complete
    checkpoint, set aside as ``.<name>.old``, goes back to ``path``."""
    path = Path(path).expanduser()
    aside = path.with_name(f".{path.name}.old")
    if not path.exists() and is_sharded_checkpoint(aside):
        aside.rename(path)
