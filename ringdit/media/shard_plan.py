"""A prepared folder's shards on disk: their paths, the bucket plan written beside them (``out/buckets.json``), and
the checks a resumed run makes that the shards there were planned and keyed as this run's would be."""

from __future__ import annotations

import json
from pathlib import Path

from ringdit.common.atomic import atomic_write
from ringdit.data.text_latent_shards import MASK_KEY
from ringdit.common.errors import ConfigError
from ringdit.media.buckets import Bucket, Buckets
from ringdit.media.folder import MediaItem
from ringdit.media.retext import sample_name
from ringdit.models.conditioning import CONTROL_KEY

PLAN = "buckets.json"  # with buckets: each shard's bucket and files (see the module docstring)
PLAN_FORMAT = "ringdit.prepare.buckets/1"


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.safetensors"


def check_resumed_task(out_dir: Path, task: str, masked: bool = False, controlled: bool = False) -> None:
    """Shards already in ``out_dir`` were prepared for the same task and with loss masks and control videos alike (else
    resuming would mix shards with and without the image-to-video, the mask or the control keys): a ``ConfigError``
    if not. (A glyph encoder added or dropped is another text encoder: the text files are encoded again.)"""
    from safetensors import safe_open

    done = next(iter(sorted(out_dir.glob("shard-*.safetensors"))), None)
    if done is None:
        return
    try:
        with safe_open(str(done), framework="pt") as f:
            before = (f.metadata() or {}).get("task", "t2v")  # shards from before task= are text-to-video
            had_masks = MASK_KEY in f.keys()  # noqa: SIM118 - a safetensors handle lists its tensors with keys()
            had_control = CONTROL_KEY in f.keys()  # noqa: SIM118
    except Exception:  # noqa: BLE001 - an unreadable shard is the reader's to report; it says nothing of the task
        return
    if before != task:
        raise ConfigError(f"out={out_dir} holds shards prepared with task={before} ({done.name}), but task={task}; "
                          f"pass task={before} to resume them, or prepare into a new out= folder")
    if had_masks != masked:
        raise ConfigError(f"out={out_dir} holds shards prepared {'with' if had_masks else 'without'} loss masks "
                          f"({done.name}), but mask_path is {'set' if masked else 'null'}; resume them as they were "
                          f"prepared, or prepare into a new out= folder")
    if had_control != controlled:
        raise ConfigError(f"out={out_dir} holds shards prepared {'with' if had_control else 'without'} control videos "
                          f"({done.name}), but control is {'set' if controlled else 'null'}; resume them as they were "
                          f"prepared, or prepare into a new out= folder")


def check_plan(out_dir: Path, root: Path, shards: list[tuple[Bucket, list[MediaItem]]], rank: int,
               unreadable: list[str], too_short: list[str], chooser: Buckets,
               stills: list[str] = ()) -> None:
    """Write the plan to ``out/buckets.json`` (rank 0, atomically), or, when shards are there already, check that it
    is the plan they were written by (else resuming would mix two plans): a ``ConfigError`` if not."""
    def relative(path: Path | str) -> str:
        try:
            return Path(path).relative_to(root).as_posix()
        except ValueError:
            return str(path)

    planned = [{"shard": shard_path(out_dir, i).name, "bucket": bucket.name,
                "files": [sample_name(item, root) for item in files]}
               for i, (bucket, files) in enumerate(shards)]
    path = out_dir / PLAN
    done = any(out_dir.glob("shard-*.safetensors"))
    if path.is_file():
        try:
            before = json.loads(path.read_text())["shards"]
        except (OSError, ValueError, KeyError, TypeError):
            before = None
        if before == planned:
            return
        if done:
            changed = _difference(before, planned)
            raise ConfigError(f"out={out_dir}: the shards there were planned differently ({changed}"
                              f"): the input folder or the bucket settings changed; prepare into a new out= folder, "
                              f"or delete its shard-*.safetensors and {PLAN} to start again")
    elif done:
        raise ConfigError(f"out={out_dir} holds shards prepared without buckets (it has no {PLAN}); prepare into a "
                          f"new out= folder, or delete its shard-*.safetensors to start again")
    if rank == 0:
        counts: dict[str, int] = {}
        for bucket, files in shards:
            counts[bucket.name] = counts.get(bucket.name, 0) + len(files)
        out_dir.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as tmp:
            tmp.write_text(json.dumps({"format": PLAN_FORMAT, "input": str(root), "buckets": chooser.describe(),
                                       "samples": counts, "shards": planned,
                                       "skipped": {"unreadable": [relative(p) for p in unreadable],
                                                   "too_short": [relative(p) for p in too_short],
                                                   **({"stills": [relative(p) for p in stills]} if stills else {})}},
                                      indent=1))


def _difference(before, planned: list[dict]) -> str:
    """What changed between two plans, in a few words."""
    if not isinstance(before, list):
        return f"{PLAN} cannot be read"
    for i, (old, new) in enumerate(zip(before, planned)):
        if old == new:
            continue
        files = old.get("files") if isinstance(old, dict) else None
        bucket = old.get("bucket") if isinstance(old, dict) else None
        if isinstance(files, list) and len(files) == len(new["files"]) and bucket == new["bucket"]:
            was, now = next(((a, b) for a, b in zip(files, new["files"]) if a != b), (None, None))
            if was is not None:
                return f"shard {i} would hold {now} instead of {was}"
        return (f"shard {i} was {len(files) if isinstance(files, list) else '?'} files of {bucket}, now "
                f"{len(new['files'])} of {new['bucket']}")
    return f"{len(before)} shards then, {len(planned)} now"
