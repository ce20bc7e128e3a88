"""``DiffusersTransformer``: a diffusers transformer (Wan, ...) as a ringdit denoiser, sequence-parallel by its plan.

Built from a local diffusers folder (``pretrained``; nothing is downloaded) or from an architecture ``config`` with
random init. The conditioning is a dict of batch-first tensors (``text``: the text encoder's hidden states, ...);
the unconditional ("null") conditioning used for classifier-free guidance -- the empty or negative prompt's
embedding -- is a buffer of this module, so it travels with checkpoints and exports.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from ringdit.errors import ConfigError
from ringdit.models.diffusers.adapter import parallelize
from ringdit.models.diffusers.families import Family, get_family

Tensor = torch.Tensor


class DiffusersTransformer(nn.Module):
    """``family``'s diffusers transformer with ringdit attention.

    Args:
        family: a key of ``ringdit.models.diffusers.FAMILIES`` (``wan``).
        config: the diffusers architecture config (used when ``pretrained`` is None).
        pretrained: a local diffusers folder; ``subfolder`` inside it holds ``config.json`` and the weights.
        input_size: the latent shape ``(T, H, W)`` / ``(H, W)`` of the data; in_channels: latent channels.
        text_len, text_dim: the shape of one text embedding ``(L, D_text)``, for the null-condition buffer.
        condition_dropout_prob: the chance that training replaces a sample's conditioning by the null one.
        activation_checkpointing: recompute each transformer block in backward (``gradient_checkpointing``: alias).
    """

    def __init__(
        self,
        family: str,
        config: dict | None = None,
        pretrained: str | None = None,
        subfolder: str | None = "transformer",
        input_size: tuple[int, ...] | None = None,
        in_channels: int | None = None,
        text_len: int | None = None,
        text_dim: int | None = None,
        condition_dropout_prob: float = 0.1,
        attention_backend: str | None = None,
        activation_checkpointing: bool = False,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        if not 0 <= condition_dropout_prob < 1:
            raise ValueError(f"model.condition_dropout_prob must be in [0, 1), got {condition_dropout_prob}")
        self.family: Family = get_family(family)
        self.transformer = build_transformer(self.family, config, pretrained, subfolder)
        arch = self.transformer.config
        self.in_channels = arch.in_channels
        self.condition_dropout_prob = condition_dropout_prob
        self.input_size = tuple(input_size) if input_size is not None else None
        patch = tuple(arch.patch_size) if isinstance(arch.patch_size, (list, tuple)) else (arch.patch_size,) * 2
        self.patch_size = patch
        if self.input_size is not None:
            check_latent_shape(self.input_size, patch, in_channels, arch.in_channels)
            self.default_grid = tuple(s // p for s, p in zip(self.input_size, patch))
        text_len, text_dim = text_len or 1, text_dim or arch.text_dim
        if text_dim != arch.text_dim:
            raise ConfigError(f"the data's text embeddings have width {text_dim} but model.config.text_dim is "
                              f"{arch.text_dim}: encode the captions with the model's own text encoder")
        self.register_buffer("null_text", torch.zeros(1, text_len, text_dim))  # (1, L, D_text)
        if activation_checkpointing or gradient_checkpointing:  # recompute each block in backward
            self.transformer.enable_gradient_checkpointing()
        parallelize(self.transformer, self.family.plan, attention_backend)

    def forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        """x (B, C, [T,] H, W) noisy latents, t (B,) model time 0..1000 -> the prediction (B, C, [T,] H, W),
        gathered from every sequence-parallel rank."""
        return self.family.forward(self.transformer, x, t, cond)

    # ---- conditioning --------------------------------------------------------------------------------------------
    def null_condition(self, batch: int) -> dict[str, Tensor]:
        return {"text": self.null_text.expand(batch, -1, -1)}

    def drop_condition(self, cond: dict[str, Tensor], drop: Tensor) -> dict[str, Tensor]:
        """Replace the conditioning of the samples where ``drop`` (B,) is True by the null conditioning."""
        null = self.null_condition(drop.shape[0])
        return {key: torch.where(drop.view(-1, *[1] * (value.dim() - 1)), null[key].to(value), value)
                if key in null else value for key, value in cond.items()}

    @torch.no_grad()
    def set_null_condition(self, text: Tensor) -> None:
        """The empty / negative prompt's embedding ``(1, L, D_text)`` or ``(L, D_text)``."""
        text = text.reshape(1, *text.shape[-2:])
        if text.shape != self.null_text.shape:
            raise ValueError(f"null text embedding of shape {tuple(text.shape)} does not fit "
                             f"{tuple(self.null_text.shape)}")
        self.null_text.copy_(text)

    @property
    def tokens_per_sample(self) -> int:
        return math.prod(self.default_grid)


# ---- building ----------------------------------------------------------------------------------------------------


def diffusers_class(family: Family) -> type[nn.Module]:
    import diffusers

    return getattr(diffusers, family.model_class)


def build_transformer(family: Family, config: dict | None, pretrained: str | None, subfolder: str | None) -> nn.Module:
    cls = diffusers_class(family)
    if pretrained is None:
        if not config:
            raise ConfigError("model: give model.pretrained=<local diffusers folder> or an architecture model.config "
                              "(e.g. model=wan_tiny)")
        return cls.from_config(dict(config))
    folder = pretrained_folder(family, pretrained, subfolder)
    if torch.empty(0).device.type == "meta":  # a config-time check (train.py builds on meta): shapes only
        return cls.from_config(read_config(family, folder, pretrained))
    try:
        return cls.from_pretrained(str(folder), local_files_only=True, torch_dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"model.pretrained={pretrained}: could not load the weights in {folder}: {first}") from None


def pretrained_folder(family: Family, pretrained: str, subfolder: str | None) -> Path:
    root = Path(pretrained).expanduser()
    if not root.is_dir():
        raise ConfigError(f"model.pretrained={pretrained} is not a folder; give a local diffusers folder (as "
                          f"saved by save_pretrained or downloaded with huggingface-cli; nothing is downloaded here)")
    folder = root / subfolder if subfolder else root
    if not (folder / "config.json").is_file():
        where = f"{subfolder}/config.json" if subfolder else "config.json"
        raise ConfigError(f"model.pretrained={pretrained} has no {where}: not a diffusers {family.model_class} folder"
                          + (" (if the folder is the transformer itself, set model.subfolder=null)" if subfolder else ""))
    return folder


def read_config(family: Family, folder: Path, pretrained: str) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"model.pretrained={pretrained}: {folder / 'config.json'} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.pretrained={pretrained}: {folder / 'config.json'} is not a JSON object")
    kind = config.get("_class_name", family.model_class)
    if kind != family.model_class:
        raise ConfigError(f"model.pretrained={pretrained} holds a {kind}, not a {family.model_class} "
                          f"(model.family={family.name}); pick the model preset that matches the folder")
    return {key: value for key, value in config.items() if not key.startswith("_")}


def check_latent_shape(size: tuple[int, ...], patch: tuple[int, ...], data_channels: int | None, channels: int) -> None:
    if len(size) != len(patch):
        raise ConfigError(f"the data's latents have shape {list(size)} but the model patches {len(patch)}-D "
                          f"{'videos (T, H, W)' if len(patch) == 3 else 'images (H, W)'}")
    if any(s % p for s, p in zip(size, patch)):
        raise ConfigError(f"the data's latent shape {list(size)} is not divisible by the model's patch size "
                          f"{list(patch)}; crop or pad the latents to a multiple of it")
    if data_channels is not None and data_channels != channels:
        raise ConfigError(f"the data's latents have {data_channels} channels but the model takes {channels}: "
                          f"encode with the model's own VAE")
