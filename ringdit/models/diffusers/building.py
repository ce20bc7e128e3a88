"""How a family's diffusers transformer is built: its diffusers class from an architecture config (random init), or
from a local diffusers folder (its config.json read and checked against the class, its weights' headers checked;
shapes only while building on the meta device) -- and the two experts of a two-expert folder (Wan 2.2 A14B's
``transformer`` and ``transformer_2``), which must share one architecture and the folder's boundary."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ringdit.common.errors import ConfigError
from ringdit.models.diffusers.families import Family, get_family
from ringdit.models.diffusers.folders import check_config_values, check_weights_folder
from ringdit.models.materialize import building_on_meta
from ringdit.common.safe_json import read_json


EXPERTS = ("high", "low")  # a two-expert model's transformer and transformer_2, in WanPipeline's order


def second_expert_subfolder(subfolder: str | None) -> str:
    """The low-noise expert's subfolder (diffusers' ``transformer_2``)."""
    return f"{subfolder}_2"


def check_boundary_ratio(boundary_ratio, pretrained: str | None, subfolder: str | None,
                         setting: str = "model.pretrained") -> float | None:
    if boundary_ratio is None:
        return None
    if isinstance(boundary_ratio, bool) or not isinstance(boundary_ratio, (int, float)) \
            or not 0 < boundary_ratio < 1:
        raise ConfigError(f"model.boundary_ratio={boundary_ratio!r} is not in (0, 1): it is the fraction of the "
                          f"1000 training timesteps where a two-expert model switches from its high-noise to its "
                          f"low-noise expert (Wan 2.2 A14B: 0.875 text-to-video, 0.9 image-to-video); null for one "
                          f"transformer")
    if pretrained is not None and not subfolder:
        raise ConfigError(f"{setting}={pretrained} with model.subfolder=null: a two-expert model "
                          f"(model.boundary_ratio) reads its experts from <folder>/transformer and "
                          f"<folder>/transformer_2; set model.subfolder=transformer")
    return float(boundary_ratio)


def check_folder_experts(pretrained: str, subfolder: str, boundary_ratio: float | None) -> None:
    """A pipeline folder with two experts (``transformer_2/``; its ``model_index.json`` says where they switch) for a
    model configured with one, or with another boundary: a ConfigError, not half a model or experts switched where
    they were not trained to."""
    root = Path(pretrained).expanduser()
    try:  # plain JSON data, nothing in it is run
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, ValueError):
        index = {}
    folder_ratio = index.get("boundary_ratio") if isinstance(index, dict) else None
    second = second_expert_subfolder(subfolder)
    if boundary_ratio is None and (folder_ratio is not None or (root / second).is_dir()):
        raise ConfigError(f"model.pretrained={pretrained} holds two experts ({second}/, boundary_ratio="
                          f"{folder_ratio}): use model=wan22_a14b (or set model.boundary_ratio={folder_ratio}), so "
                          f"that both load and each denoises its own times")
    if boundary_ratio is not None and isinstance(folder_ratio, (int, float)) and folder_ratio != boundary_ratio:
        raise ConfigError(f"model.boundary_ratio={boundary_ratio} but model.pretrained={pretrained} switches its "
                          f"experts at {folder_ratio} (model_index.json), where they were trained to; set "
                          f"model.boundary_ratio={folder_ratio}")


def check_same_architecture(high: nn.Module, low: nn.Module, pretrained: str | None) -> None:
    """WanPipeline runs the experts on the same latents: they must be one architecture."""
    ours, theirs = (dict(expert.config) for expert in (high, low))
    differing = sorted(key for key in ours
                       if not key.startswith("_") and plain_value(ours[key]) != plain_value(theirs.get(key)))
    if differing:
        details = ", ".join(f"{key}={ours[key]!r} vs {theirs.get(key)!r}" for key in differing[:6])
        raise ConfigError(f"model.pretrained={pretrained}: transformer/ and transformer_2/ are different "
                          f"architectures ({details}); a two-expert model's experts share one")


def plain_value(value):
    return list(value) if isinstance(value, tuple) else value


def diffusers_class(family: Family) -> type[nn.Module]:
    import diffusers

    return getattr(diffusers, family.model_class)


def build_transformer(family: Family, config: dict | None, pretrained: str | None, subfolder: str | None,
                      setting: str = "model.pretrained") -> nn.Module:
    transformer = _load_transformer(family, config, pretrained, subfolder, setting)
    if family.attention_processors is not None:  # processors that dispatch, in place of ones that call PyTorch's
        family.attention_processors(transformer)
    return transformer


def _load_transformer(family: Family, config: dict | None, pretrained: str | None, subfolder: str | None,
                      setting: str) -> nn.Module:
    cls = diffusers_class(family)
    if pretrained is None:
        if not config:
            raise ConfigError("model: give model.pretrained=<local diffusers folder> or an architecture model.config "
                              "(e.g. model=wan_tiny)")
        return cls.from_config(dict(config))
    folder = pretrained_folder(family, pretrained, subfolder, setting)
    arch = read_config(family, folder, pretrained, setting)
    # the weights' headers, before any rank starts (train.py builds on meta first); safetensors only: a .bin can
    # run code when unpickled, and diffusers would fall back to it when a folder has no safetensors
    check_weights_folder(folder, setting=setting, value=pretrained, class_name=family.model_class)
    if torch.empty(0).device.type == "meta" or building_on_meta():  # shapes only: the weights load per rank later
        return cls.from_config(arch)
    try:
        return cls.from_pretrained(str(folder), local_files_only=True, torch_dtype=torch.float32, use_safetensors=True)
    except (OSError, ValueError, RuntimeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"{setting}={pretrained}: could not load the weights in {folder}: {first}") from None


def pretrained_folder(family: Family, pretrained: str, subfolder: str | None, setting: str = "model.pretrained"
                      ) -> Path:
    root = Path(pretrained).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{setting}={pretrained} is not a folder; give a local diffusers folder (as saved by "
                          f"save_pretrained or downloaded with huggingface-cli; nothing is downloaded here)")
    folder = root / subfolder if subfolder else root
    if not (folder / "config.json").is_file():
        where = f"{subfolder}/config.json" if subfolder else "config.json"
        raise ConfigError(f"{setting}={pretrained} has no {where}: not a diffusers {family.model_class} folder"
                          + (" (if the folder is the transformer itself, set model.subfolder=null)" if subfolder else ""))
    return folder


def read_config(family: Family, folder: Path, pretrained: str, setting: str = "model.pretrained") -> dict:
    """The architecture in ``folder/config.json`` (plain JSON data: nothing in it is imported or run)."""
    config = read_json(folder / "config.json", f"{setting}={pretrained}: {folder / 'config.json'}", kind=dict,
                       fix=f"give a diffusers {family.model_class} folder (as save_pretrained writes it)")
    kind = config.get("_class_name", family.model_class)
    if kind != family.model_class:
        raise ConfigError(f"{setting}={pretrained} holds a {kind}, not a {family.model_class} "
                          f"(model.family={family.name}); pick the model preset that matches the folder")
    import diffusers

    check_config_values(config, getattr(diffusers, family.model_class), folder / "config.json",
                        f"{setting}={pretrained}")
    return {key: value for key, value in config.items() if not key.startswith("_")}


def guidance_embedding(config: dict) -> bool | None:
    """Whether a diffusers model is guidance-distilled (``guidance_embeds``, as its class defaults it: FLUX.2 yes,
    FLUX.1 and QwenImage no, Wan none); None while its architecture is a pretrained folder not read yet."""
    import inspect

    import diffusers

    architecture = config.get("config")
    if not architecture:
        return None
    parameter = inspect.signature(getattr(diffusers, get_family(config["family"]).model_class).__init__
                                  ).parameters.get("guidance_embeds")
    return bool(architecture.get("guidance_embeds", parameter.default if parameter is not None else False))
