"""``ModelSpec``: the model a run builds -- its config with the data's shape filled in, and the tokens per sample that
ring / Ulysses split -- checked by building it on the meta device (no memory) before any process is spawned."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ringdit.common.errors import ConfigError, require_count, require_number
from ringdit.models.build import build_model
from ringdit.models.checkpointing import checkpoint_fraction
from ringdit.parallel import ParallelDims
from ringdit.spec.setting_types import check_setting_types, declared_types


@dataclass(frozen=True)
class ModelSpec:
    config: dict   # the model's config (``_target_`` and its settings), with the data's shape filled in
    tokens: int    # tokens per sample: the sequence the sequence-parallel ranks split

    @property
    def kind(self) -> type[nn.Module]:
        """The model's class: what it declares of itself (``ringdit.models.protocol.DiffusionModel``)."""
        return model_class(self.config)

    @staticmethod
    def check_settings(model_cfg: DictConfig | dict) -> None:
        """The sizes a user sets, each alone: checked before the data is opened (cheap), the rest in ``from_data``."""
        model = model_cfg or {}
        if model.get("_target_"):  # each setting of the kind the model class declares (activation_offload: a bool)
            kind = model_class({"_target_": model["_target_"]})
            check_setting_types("model", {key: model.get(key) for key in declared_types(kind) if key in model}, kind)
        for key in ("hidden_size", "depth", "num_heads"):  # depth=0 would train a model without blocks, silently
            if key in model:
                require_count(f"model.{key}", model[key])
        if "activation_checkpointing" in model:  # '' is falsy: the model would take it as false, silently
            checkpoint_fraction(model["activation_checkpointing"])
        if "mlp_ratio" in model:
            require_number("model.mlp_ratio", model["mlp_ratio"], low=0, low_open=True)
        if "class_dropout_prob" in model:
            require_number("model.class_dropout_prob", model["class_dropout_prob"], low=0, high=1)

    @classmethod
    def from_data(cls, model_cfg: DictConfig | dict, data_info: dict,
                  ulysses_degree: int) -> tuple[ModelSpec, nn.Module]:
        """The model ``model_cfg`` makes of this data (``model_config``), and that model built on meta; every bucket
        of the data must be a shape it patches."""
        config = model_config(model_cfg, data_info)
        patch = model_class(config).patch_shape_of(config)
        if patch is not None:  # before the model is built around the most frequent bucket, which may be the bad one
            check_buckets(data_info, patch)
        spec, meta_model = cls.from_config(config, ulysses_degree)
        check_buckets(data_info, meta_model.patch_shape)
        return spec, meta_model

    @classmethod
    def from_config(cls, config: dict, ulysses_degree: int) -> tuple[ModelSpec, nn.Module]:
        """A complete model config (a checkpoint's): the spec and the model built on meta, for the checks that
        need its parameters (LoRA targets, weights files, memory)."""
        meta_model = build_on_meta(config, ulysses_degree)
        return cls(config=config, tokens=math.prod(meta_model.default_grid)), meta_model


BUCKET_FIX = ("make every bucket a multiple of the patch: prepare's bucket_step (or its buckets= list) a multiple of "
              "the VAE's downsampling x the patch, data=image_folder's data.bucket_step a multiple of the patch; or "
              "leave those samples out")


def check_buckets(data_info: dict, patch: tuple[int, ...]) -> None:
    """A ConfigError for a bucket (sample shape) the model cannot patch: smaller than the patch, or not divisible."""
    where = f"data.path={data_info['source']['path']}" if "source" in data_info else "data"
    if "buckets" not in data_info:  # one sample shape: the patch is what the user can change
        shape = tuple(data_info["image_size"])
        if len(shape) == len(patch) and any(s < p or s % p for s, p in zip(shape, patch)):
            raise ConfigError(f"{where}: the data's sample shape {list(shape)} is not divisible by the model's patch "
                              f"{list(patch)} (model.patch_size); pick a patch that divides {list(shape)}, or data "
                              f"whose shape is a multiple of the patch")
    for bucket in data_info.get("buckets", [{"shape": data_info["image_size"]}]):
        shape = tuple(bucket["shape"])
        samples = f" ({bucket['samples']} samples)" if "samples" in bucket else ""
        if len(shape) != len(patch):
            raise ConfigError(f"{where}: a bucket of shape {list(shape)}{samples} has {len(shape)} dims, the model "
                              f"patches {len(patch)}-D data {list(patch)}")
        if any(s < p for s, p in zip(shape, patch)):
            raise ConfigError(f"{where}: the bucket {list(shape)}{samples} is smaller than the model's patch "
                              f"{list(patch)}; {BUCKET_FIX}")
        if any(s % p for s, p in zip(shape, patch)):
            nearest = [s // p * p for s, p in zip(shape, patch)]
            raise ConfigError(f"{where}: the bucket {list(shape)}{samples} is not divisible by the model's patch "
                              f"{list(patch)} (the nearest shape that is: {nearest}); {BUCKET_FIX}")


def model_config(model_cfg: DictConfig | dict, data_info: dict) -> dict:
    """The model config with the data's shape filled in by the model class itself (``config_for_data``: channels,
    size and classes for the DiT; channels, latent shape and text embedding shape for a diffusers model)."""
    config = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    return model_class(config).config_for_data(config, data_info)


def model_class(config: dict) -> type[nn.Module]:
    """The class ``config["_target_"]`` names (imported, not instantiated)."""
    from hydra.utils import get_class

    target = config.get("_target_")
    if not target:
        raise ConfigError("model: the config has no _target_ (pick a preset: model=dit, model=wan_tiny, ...)")
    try:
        return get_class(target)
    except (ImportError, ValueError) as error:
        raise ConfigError(f"model._target_={target}: {str(error).strip().splitlines()[0]}") from None


def kind_name(config: dict) -> str:
    """The model kind's name a model config builds (``DiffusionModel.kind_name``: "dit", a diffusers family's)."""
    return model_class(config).kind_name_of(config)


def build_on_meta(config: dict, ulysses_degree: int = 1) -> nn.Module:
    """The model built and parallelized on the meta device (no memory): its settings, and whether its attention
    layers fit the layout (a head for every Ulysses rank), are checked before any process is spawned."""
    with torch.device("meta"):
        try:
            model, _ = build_model(config, dims=ParallelDims(ulysses_degree=ulysses_degree), backend="math")
        except InstantiationException as error:
            if isinstance(error.__cause__, ConfigError):
                raise error.__cause__ from None
            raise ConfigError(f"model: {error.__cause__ or error}") from None
    return model
