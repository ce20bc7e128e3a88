"""The weights of a ``save_pretrained`` folder (diffusers or transformers), checked before anything loads them.

``check_weights_folder`` finds the safetensors files that ``from_pretrained(folder, use_safetensors=True)`` would
read -- one file, or the shards a ``*.safetensors.index.json`` lists -- and checks each one's header: the 8-byte
length, the JSON it announces and the tensors' byte ranges, which must end exactly at the end of the file. That is
cheap (no tensor data is read) and finds what a loader would find only after a run has started: a truncated
download or save, an empty file, a Git LFS pointer, a missing shard. A folder with pickled weights only (``.bin``:
loading them can run code) is refused with the command that converts it; so is one without weights.

The model (``model.pretrained``, ``init_from``), the VAE and the text encoder folders all use it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ringdit.common.errors import ConfigError

# the file name from_pretrained reads: <stem>.safetensors, or the shards of <stem>.safetensors.index.json
WEIGHTS_STEMS = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}
PICKLE_STEMS = {"diffusers": "diffusion_pytorch_model", "transformers": "pytorch_model"}  # <stem>.bin[.index.json]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
REFETCH = "re-download it, or re-save the model with save_pretrained"
REFETCH_ALL = "re-download the model, or re-save it with save_pretrained"


def weights_files(folder: Path, library: str = "diffusers") -> tuple[Path | None, Path | None]:
    """(the index, the single file) that ``from_pretrained(folder, use_safetensors=True)`` would read, as the
    library picks them: diffusers prefers the index, transformers the single file; (None, None) if neither exists."""
    stem = WEIGHTS_STEMS[library]
    index, single = folder / f"{stem}.safetensors.index.json", folder / f"{stem}.safetensors"
    first, second = (index, single) if library == "diffusers" else (single, index)
    for candidate in (first, second):
        if candidate.is_file() or candidate.is_symlink():  # a broken link (a hub cache's missing blob) is named too
            return (candidate, None) if candidate is index else (None, candidate)
    return None, None


def check_weights_folder(folder: str | Path, *, setting: str, value, class_name: str,
                         library: str = "diffusers") -> list[Path]:
    """Raise a one-line ``ConfigError`` naming ``setting=value``, the file and the fix unless every safetensors file
    that ``class_name.from_pretrained(folder, use_safetensors=True)`` reads is whole; return those files."""
    folder = Path(folder)
    where = f"{setting}={value}"
    index, single = weights_files(folder, library)
    if single is not None:
        check_safetensors_header(single, where)
        return [single]
    if index is not None:
        return _check_index(index, where)
    stem = WEIGHTS_STEMS[library]
    pickled = PICKLE_SUFFIXES + tuple(f"{suffix}.index.json" for suffix in PICKLE_SUFFIXES)
    pickles = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name.endswith(pickled))
    if pickles:
        shown = ", ".join(pickles[:4]) + (f" and {len(pickles) - 4} more" if len(pickles) > 4 else "")
        convertible = any(name.startswith(f"{PICKLE_STEMS[library]}.bin") for name in pickles)
        how = (f"convert them to safetensors once, where you trust the files: "
               f"{convert_command(folder, class_name, library)}" if convertible else
               "convert the model to safetensors where you trust the files (load it there, then save_pretrained it "
               "into this folder)")
        raise ConfigError(f"{where}: cannot load {class_name} weights from {folder}: it holds pickled weights only "
                          f"({shown}), which can run code when loaded and are refused; {how}")
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    found = f" (it holds {', '.join(others[:4])}: a variant or another model's files, which are not read)" \
        if others else ""
    raise ConfigError(f"{where}: cannot load {class_name} weights from {folder}: it has no {stem}.safetensors or "
                      f"{stem}.safetensors.index.json{found}; save the model there with save_pretrained, or point "
                      f"{setting} at the folder that holds its weights")


def convert_command(folder: Path, class_name: str, library: str) -> str:
    """The one-liner that rewrites ``folder``'s pickled weights as safetensors (transformers saves safetensors only)."""
    load, save = ("", ", safe_serialization=True") if library == "diffusers" else (", use_safetensors=False", "")
    return (f"python -c \"from {library} import {class_name} as M; M.from_pretrained({str(folder)!r}{load})"
            f".save_pretrained({str(folder)!r}{save})\"")


def _check_index(index: Path, where: str) -> list[Path]:
    _check_readable(index, where)
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ConfigError(f"{where}: {index} is not a valid index of safetensors shards ({error}); {REFETCH_ALL}") \
            from None
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(name, str) for name in weight_map.values()):
        raise ConfigError(f"{where}: {index} has no weight_map of tensor names to shard files; {REFETCH_ALL}")
    shards = sorted(set(weight_map.values()))
    unsafe = [name for name in shards if not name.endswith(".safetensors")]
    if unsafe:  # a loader picks the reader by the file name: a .bin shard would be unpickled
        raise ConfigError(f"{where}: {index} lists shard(s) that are not safetensors ({', '.join(unsafe[:4])}), "
                          f"which would be unpickled and can run code: refused; {REFETCH_ALL}")
    missing = [name for name in shards if not (index.parent / name).is_file()]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ConfigError(f"{where}: {index} lists {len(shards)} shard(s), {len(missing)} of them missing from "
                          f"{index.parent}: {shown}; download the missing shard(s) (or re-save the model with "
                          f"save_pretrained)")
    files = [index.parent / name for name in shards]
    for path in files:
        held = check_safetensors_header(path, where)
        absent = [key for key, name in weight_map.items() if name == path.name and key not in held]
        if absent:
            more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
            raise ConfigError(f"{where}: {index} places {absent[0]!r}{more} in {path.name}, which does not hold it: "
                              f"the index and the shards are from different saves; {REFETCH_ALL}")
    return files


def check_safetensors_header(path: Path, where: str) -> set[str]:
    """Check ``path``'s header against its size (8 + header length + the end of the tensor data); return the tensor
    names. Reads the header only."""
    _check_readable(path, where)
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"{where}: {path} is empty (0 bytes); {REFETCH}")
    with open(path, "rb") as f:
        head = f.read(8)
        if head.startswith(b"version ") and b"git-lfs" in head + f.read(64):
            raise ConfigError(f"{where}: {path} is a Git LFS pointer, not the weights; fetch them with `git lfs "
                              f"pull` in that repository (or re-download it)")
        if len(head) < 8:
            raise ConfigError(f"{where}: {path} is truncated ({size} bytes: not even the 8-byte header length of a "
                              f"safetensors file); {REFETCH}")
        length = int.from_bytes(head, "little")
        if length > min(size - 8, MAX_HEADER):
            raise ConfigError(f"{where}: {path} is truncated or not a safetensors file (its first 8 bytes announce "
                              f"a {length}-byte header, the file has {size} bytes); {REFETCH}")
        f.seek(8)
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{where}: {path} is corrupt or not a safetensors file (its header is not valid JSON: "
                          f"{error}); {REFETCH}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{where}: {path} is corrupt (its header is not a JSON object); {REFETCH}")
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ConfigError(f"{where}: {path} is corrupt (tensor {key!r} has no valid data_offsets in the "
                              f"header); {REFETCH}")
        end = max(end, offsets[1])
    expected = 8 + length + end
    if size < expected:
        raise ConfigError(f"{where}: {path} is truncated: its header describes a file of {expected} bytes, it has "
                          f"{size} (an interrupted download or save?); {REFETCH}")
    if size > expected:
        raise ConfigError(f"{where}: {path} is corrupt: it has {size - expected} bytes after the end of the tensors "
                          f"its header describes ({expected} bytes); {REFETCH}")
    from safetensors import SafetensorError, safe_open

    try:  # the rest of safetensors' own validation (dtypes, shapes against byte ranges, gaps): the header only
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"{where}: {path} is corrupt ({first}); {REFETCH}") from None
    return {key for key in header if key != "__metadata__"}


def _check_readable(path: Path, where: str) -> None:
    if not path.exists():  # a link whose target is gone
        raise ConfigError(f"{where}: {path} is a broken link (to {path.readlink()}, which is missing); {REFETCH}")
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise ConfigError(f"{where}: cannot read {path} ({error.strerror or error}); make it readable, or "
                          f"{REFETCH}") from None


def check_config_values(config: dict, cls, file: Path, where: str, fix: str = "") -> None:
    """Each setting of a folder's ``config.json`` (``config``, read from ``file``) of the type ``cls``'s own default
    for it has -- an integer, a number, true / false, a string, a list of integers where the default is a tuple of
    them -- so that a wrong one is named (``where``: the setting that gave the folder; the file, the key, the value,
    the default) before ``cls`` is built, not met as "not all arguments converted during string formatting"."""
    import inspect
    import math

    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # a class without a Python signature: nothing to compare with
        return
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    for key, value in config.items():
        if key.startswith("_") or key not in defaults or value is None:
            continue  # null: the class's default (diffusers and transformers take it so)
        default = defaults[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        integers = isinstance(value, (list, tuple)) and all(type(v) is int for v in value)
        if isinstance(default, bool):
            bad, what = not isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            bad, what = not (number and math.isfinite(value) and float(value).is_integer()), "an integer"
        elif isinstance(default, float):
            bad, what = not (number and math.isfinite(value)), "a finite number"
        elif isinstance(default, str):
            bad, what = not isinstance(value, str), "a string"
        elif isinstance(default, tuple) and default and all(type(v) is int for v in default):
            bad, what = not (integers or (type(value) is int)), "a list of integers"
        else:
            continue
        if bad:
            shown = json.dumps(value) if isinstance(value, (str, int, float, bool, list, dict)) else repr(value)
            raise ConfigError(f"{where}: {file}: {key}={shown} must be {what} ({cls.__name__}'s default: "
                              f"{json.dumps(default)}); write the value the weights were saved with (the config.json "
                              f"save_pretrained wrote)" + (f"; {fix}" if fix else ""))
