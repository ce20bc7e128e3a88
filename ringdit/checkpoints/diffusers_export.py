"""A diffusers model's checkpoint written as a diffusers pipeline folder that ``DiffusionPipeline.from_pretrained``
loads: the base pipeline's components (VAE, text encoders, tokenizers, scheduler, image encoder, ``model_index.json``)
copied from the pipeline folder the run started from, and the trained transformer(s) -- ``transformer/`` (and
``transformer_2/``, a two-expert model's low-noise expert) -- written by diffusers' own ``save_pretrained``: a
``config.json`` and safetensors shards of at most ``max_shard_size`` with their index
(``diffusion_pytorch_model.safetensors.index.json``), or one file when the model fits in one shard.

The base is ``base=`` when given, else the folder the run recorded (``model.pretrained``, or an ``init_from`` that is
a pipeline folder). A run without one (a model built from an architecture preset, or from a transformer folder) gets
its transformer folders only, and ``export_diffusers`` says so. ringdit reads the result back too
(``model.pretrained=<out>``, ``init_from=<out>``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ringdit.checkpoints.location import checked_output, first_line, replace_folder, temporary_folder
from ringdit.checkpoints.weights import read_weights
from ringdit.common.errors import CheckpointError, ConfigError
from ringdit.common.safe_json import read_json
from ringdit.spec.checkpoint import recorded_hparams
from ringdit.spec.model import ModelSpec, model_class

MAX_SHARD_SIZE = "10GB"  # diffusers' save_pretrained default; the Wan / Flux repositories' shards are 5-10 GB


def shard_bytes(max_shard_size) -> int:
    """``max_shard_size`` (``5GB``, ``500MB``, or a number of bytes) in bytes, as save_pretrained reads it
    (huggingface_hub's ``split_torch_state_dict_into_shards``)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(str(max_shard_size))
    except (ValueError, TypeError, AttributeError):
        size = None
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ConfigError(f"max_shard_size={max_shard_size!r} is not a size; give e.g. max_shard_size=5GB, 500MB or "
                          f"a number of bytes")
    return size


def recorded_base(model_cfg: dict, hparams: dict) -> str | None:
    """The pipeline folder the run started from, as it recorded it: ``model.pretrained`` (with its transformer in a
    subfolder) or an ``init_from`` folder; None when the run started from neither."""
    if model_cfg.get("pretrained") and model_cfg.get("subfolder", "transformer"):
        return str(model_cfg["pretrained"])
    init_from = hparams.get("init_from")
    if init_from and Path(str(init_from)).expanduser().is_dir() and \
            (Path(str(init_from)).expanduser() / "model_index.json").is_file():
        return str(init_from)
    return None


def pipeline_components(base: str | Path, subfolders: list[str], model_class: str, setting: str) -> dict:
    """``base``'s ``model_index.json``, checked to be a diffusers pipeline whose transformer components are exactly
    ``subfolders``, each a ``model_class``. ``setting`` names where ``base`` came from in the messages."""
    root = Path(base).expanduser()
    fix = "give base=<the diffusers pipeline folder the model was fine-tuned from> (it holds model_index.json)"
    if not root.is_dir():
        raise ConfigError(f"{setting}={base} is not a folder; {fix}")
    if not (root / "model_index.json").is_file():
        raise ConfigError(f"{setting}={base} is not a diffusers pipeline folder (no model_index.json); {fix}")
    index = read_json(root / "model_index.json", f"{setting}={base}: model_index.json", kind=dict, fix=fix)
    present = {name for name, entry in index.items() if name.startswith("transformer") and isinstance(entry, list)
               and len(entry) == 2 and entry[1] is not None}
    if present != set(subfolders):
        raise ConfigError(f"{setting}={base} is a pipeline of {len(present)} transformer(s) ({', '.join(sorted(present))}"
                          f") but the checkpoint holds {len(subfolders)} ({', '.join(subfolders)}); give the base "
                          f"pipeline of the model that was trained")
    for name in subfolders:
        if index[name][1] != model_class:
            raise ConfigError(f"{setting}={base}: its {name} is a {index[name][1]}, the checkpoint's a {model_class}; "
                              f"give the base pipeline of the model that was trained")
    return index


def export_diffusers(ckpt_path: str | Path, out: str | Path, prefer: str = "ema", base: str | None = None,
                     max_shard_size=MAX_SHARD_SIZE, weights: tuple[dict, dict] | None = None
                     ) -> tuple[Path, str | None]:
    """Write the checkpoint's transformer(s) (EMA weights by default) under the folder ``out`` with the base
    pipeline's other components, replacing ``out`` whole (a kill while writing leaves the previous one as it was).
    Returns ``out`` and, for a transformer-only export, a note saying why there is no pipeline. ``weights``: the
    ``(state, info)`` to write instead of the checkpoint's (a LoRA run's base with its adapter fused)."""
    out = checked_output(out, folder=True, what="format=diffusers (a pipeline folder)")
    shard_bytes(max_shard_size)
    _, info = weights or read_weights(ckpt_path, prefer, load_tensors=False)  # the configs: the base is checked
    # before the weights
    model_cfg = info.get("model") or {}
    if not model_cfg or not model_class(model_cfg).diffusers_folders:
        raise CheckpointError(f"{ckpt_path} holds ringdit's DiT, not a diffusers transformer: export it with "
                              f"format=ringdit (a .safetensors file)")
    _, model = ModelSpec.from_config(model_cfg, 1)  # on meta: the architecture, no weights
    parts = model.subfolders()
    subfolders = [subfolder for _, subfolder in parts]
    note = None
    if base is not None:
        pipeline_components(base, subfolders, model.family.model_class, "base")
    else:
        recorded = recorded_base(model_cfg, recorded_hparams(str(ckpt_path)))
        try:
            if recorded is None:
                raise ConfigError("the run recorded no pipeline folder (model.pretrained / init_from)")
            pipeline_components(recorded, subfolders, model.family.model_class, "the run's model.pretrained")
            base = recorded
        except ConfigError as why:
            note = (f"wrote the transformer folder(s) only ({why}); give base=<the diffusers pipeline folder> for a "
                    f"whole pipeline that DiffusionPipeline.from_pretrained loads")
    if Path(out).resolve() == (Path(base).expanduser().resolve() if base else None):
        raise ConfigError(f"out={out} is the base pipeline folder itself: exporting would replace it; choose another "
                          f"out")
    state, _ = weights or read_weights(ckpt_path, prefer)
    tmp = Path(temporary_folder(out))
    try:
        if base is not None:
            _copy_components(Path(base).expanduser(), tmp, skip=set(subfolders))
        for prefix, subfolder in parts:
            transformer = model.get_submodule(prefix.rstrip("."))
            tensors = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
            transformer.load_state_dict(tensors, strict=True, assign=True)  # meta -> the trained tensors
            transformer.save_pretrained(tmp / subfolder, max_shard_size=max_shard_size, safe_serialization=True)
        replace_folder(tmp, out)
    except OSError as error:
        raise CheckpointError(f"cannot write out={out} ({error.strerror or first_line(error)}); choose a writable "
                              f"folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # what a failed export had written (gone after a success)
    return out, note


def _copy_components(base: Path, into: Path, skip: set[str]) -> None:
    """Every component of the base pipeline but the transformer(s) it is exported with (copies: the export stays
    whole when the base is moved or deleted). Hidden entries (``.cache``, ``.git``) are left behind."""
    for entry in sorted(base.iterdir()):
        if entry.name in skip or entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, into / entry.name, ignore=shutil.ignore_patterns(".*"))
        else:
            shutil.copy2(entry, into / entry.name)
