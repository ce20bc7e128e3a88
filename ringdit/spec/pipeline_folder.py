"""A diffusers pipeline folder sampled as published: ``infer.py ckpt_path=<folder>``, ``python -m ringdit.serve
ckpt_path=<folder>``.

``pipeline_checkpoint`` describes the folder as a ringdit checkpoint describes its run, so that everything after it
(sizes, prompts, schedulers, layouts, decoding) is what sampling a fine-tune does:

- the model is the folder's transformer(s) (``model.pretrained``), of the family whose ``Family.pipelines`` names the
  folder's pipeline class (``model_index.json``), with two experts where the pipeline has a ``boundary_ratio``;
- the "data" are the pipeline's: latents of its VAE at its default size, prompts of its text encoder at its
  ``max_sequence_length``;
- sampling takes the pipeline's own defaults, read from its ``__call__`` signature (``num_inference_steps``,
  ``guidance_scale``, height, width, frames) and its scheduler (``scheduler/``): the pipeline's output for a seed's
  noise is what ringdit samples.

The empty prompt's encoding is the unconditional half of guidance, as the pipelines encode their default negative
prompt; infer.py and the server encode it with the folder's text encoder.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from ringdit.commands.cli import CONF_DIR
from ringdit.common.errors import ConfigError
from ringdit.common.safe_json import read_json
from ringdit.diffusion.schedulers import SCHEDULERS, check_scheduler_file
from ringdit.media.pretrained import find_folder
from ringdit.media.vae import VAE
from ringdit.models.conditioning import TEXT
from ringdit.models.diffusers.families import family_of_pipeline, published_pipelines
from ringdit.spec.model import model_config

INDEX = "model_index.json"


def is_pipeline_folder(path) -> bool:
    return path is not None and (Path(str(path)).expanduser() / INDEX).is_file()


def pipeline_checkpoint(folder: str) -> dict:
    """The ``model`` / ``data`` / ``objective`` / ``sampling`` a checkpoint records, for the pipeline in ``folder``."""
    import diffusers

    root = Path(folder).expanduser()
    index = read_json(root / INDEX, f"ckpt_path={folder}: {root / INDEX}", kind=dict,
                      fix="give a folder DiffusionPipeline.save_pretrained wrote")
    name = index.get("_class_name")
    family = family_of_pipeline(name)
    supported = published_pipelines()
    if family is None or not hasattr(diffusers, str(name)):
        raise ConfigError(f"ckpt_path={folder} is a {name} folder; ringdit samples {', '.join(supported)} folders as "
                          f"published; fine-tune this model (model.pretrained={folder}) and sample the run, or a "
                          f"LoRA run of it with base={folder}")
    defaults = {key: p.default for key, p in inspect.signature(getattr(diffusers, name).__call__).parameters.items()}
    scheduler_class = (index.get("scheduler") or [None, None])[1]
    sampler = next((key for key, value in SCHEDULERS.items() if value == scheduler_class), None)
    if sampler is None:
        raise ConfigError(f"ckpt_path={folder}: its scheduler {scheduler_class} is not one ringdit steps "
                          f"({', '.join(SCHEDULERS.values())})")
    text_len = int(defaults["max_sequence_length"])
    vae = _vae_description(root, folder)
    encoder = _text_encoder_description(root, folder, text_len)
    spatial, temporal = vae["spatial_compression"], vae["temporal_compression"] or 1
    height, width = int(defaults["height"]), int(defaults["width"])
    image_size = [height // spatial, width // spatial]
    if family.video:
        image_size = [(int(defaults["num_frames"]) - 1) // temporal + 1, *image_size]
    data = {"channels": vae["latent_channels"], "image_size": image_size, "conditioning": TEXT,
            "text_len": text_len, "text_dim": encoder["dim"], "num_classes": 0, "class_names": [],
            "latent_scale": 1.0, "vae": vae, "text_encoder": encoder, "pipeline": str(root.resolve())}
    boundary = index.get("boundary_ratio")
    if boundary is not None and (isinstance(boundary, bool) or not isinstance(boundary, (int, float))
                                 or not 0 < boundary < 1):
        raise ConfigError(f"ckpt_path={folder}: {root / INDEX}: boundary_ratio={boundary!r} must be a number in (0, 1) "
                          f"(the share of the timesteps the high-noise expert denoises) or null for one transformer; "
                          f"give the model_index.json save_pretrained wrote")
    preset = {**_preset(family.name), "pretrained": str(root.resolve()), "boundary_ratio": boundary}
    scheduler_file = root / "scheduler" / "scheduler_config.json"
    scheduler = read_json(scheduler_file, f"ckpt_path={folder}: its scheduler config", kind=dict,
                          fix="give the folder save_pretrained wrote")
    check_scheduler_file(scheduler, scheduler_file, scheduler_class)
    shift = float(scheduler.get("flow_shift") or 1.0)
    objective = {"_target_": "ringdit.diffusion.FlowMatching", "time_sampling": "uniform", "logit_mean": 0.0,
                 "logit_std": 1.0, "shift": shift, "resolution": None}
    sampling = {"sampler": sampler, "steps": int(defaults["num_inference_steps"]),
                "cfg_scale": float(defaults["guidance_scale"]), "cfg_scale_2": None, "shift": shift,
                "shift_terminal": None}
    return {"model": model_config(preset, data), "data": data, "objective": objective, "sampling": sampling}


def _preset(name: str) -> dict:
    """``conf/model/<name>.yaml`` with the presets it inherits (its ``defaults`` list), read as data: this runs inside
    a Hydra command, where Hydra cannot compose a second config."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    merged: dict = {}
    for parent in raw.pop("defaults", None) or ["_self_"]:
        merged.update(raw if parent == "_self_" else _preset(parent))
    return merged


def _vae_description(root: Path, folder: str) -> dict:
    return VAE(root, "vae", setting=f"ckpt_path={folder}'s vae/").describe()


def _text_encoder_description(root: Path, folder: str, text_len: int) -> dict:
    """What prepare records of the folder's text encoder, read from its config (its weights are loaded where prompts
    are encoded, not here)."""
    encoder = find_folder(root, "text_encoder", "config.json", f"ckpt_path={folder}'s text_encoder/")
    config = read_json(encoder / "config.json", f"ckpt_path={folder}: {encoder / 'config.json'}", kind=dict,
                       fix="give the folder save_pretrained wrote")
    key = "d_model" if "d_model" in config else "hidden_size"
    dim = config.get(key)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ConfigError(f"ckpt_path={folder}: {encoder / 'config.json'}: {key}={dim!r} must be a positive integer "
                          f"(the text encoder's width); give the folder save_pretrained wrote")
    tokenizer = root / "tokenizer" if (root / "tokenizer" / "tokenizer_config.json").is_file() else encoder
    return {"class": (config.get("architectures") or ["?"])[0], "path": str(encoder.resolve()),
            "tokenizer": str(tokenizer.resolve()), "max_len": text_len, "dim": int(dim), "pooled": False,
            "masked": True}
