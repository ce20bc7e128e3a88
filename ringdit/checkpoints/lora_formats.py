"""A LoRA adapter in ComfyUI's format: the model's ORIGINAL layer names (as the model's authors and ComfyUI name
them, not diffusers'), prefixed ``diffusion_model.``, with ``lora_down`` (A), ``lora_up`` (B) and ``alpha`` keys:

    diffusion_model.blocks.0.self_attn.q.lora_down.weight   (rank, in)
    diffusion_model.blocks.0.self_attn.q.lora_up.weight     (out, rank)
    diffusion_model.blocks.0.self_attn.q.alpha              ()  -- the layer adds (alpha / rank) * up @ down

Each family's names are its ``Family`` record's ``original_lora_names`` (``ringdit.models.diffusers.original_names``:
the inverse of what diffusers reads), and its (down, up) key names its ``original_lora_keys``.

Where the original model fuses layers that diffusers keeps apart (Flux's ``img_attn.qkv``, its single blocks'
``linear1`` = q, k, v and the MLP's input; HunyuanVideo 1.5's token refiner ``self_attn_qkv``), the adapters of the
parts become one adapter of the fused layer: the downs stacked, the ups block-diagonal (a part without an adapter
adds zero rows), so the rank is the sum of the parts' and alpha grows with it (alpha / rank is unchanged). That is
exact: the fused layer's update is the parts' updates stacked. A layer whose diffusers reader takes no alpha (Wan's
layers outside the blocks) gets its scale multiplied into ``lora_up`` and no ``alpha`` key (ComfyUI then scales by 1).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from dataclasses import dataclass

import torch

from ringdit.checkpoints.location import first_line
from ringdit.common.errors import ConfigError, require_number
from ringdit.common.safe_json import read_json
from ringdit.models.diffusers.families import find_family, with_original_lora_names
from ringdit.models.diffusers.original_names import Rule
from ringdit.models.lora import adapted_modules

Tensor = torch.Tensor

PREFIX = "diffusion_model."


def name_rules(family: str | None) -> tuple[Rule, ...]:
    """The rules from diffusers' layer names to ``family``'s original ones (its record's ``original_lora_names``);
    () for a family without them, or none."""
    record = find_family(family)
    return record.original_lora_names if record is not None else ()


@dataclass
class Original:
    """One original layer's adapter being assembled: its parts' (down, up) by diffusers' layer name."""

    rule: Rule
    prefix: str  # diffusers' name of the fused layer's parts, less the part (``single_transformer_blocks.0.``)
    pieces: dict[str, tuple[Tensor, Tensor]]


def original_layer(family: str, module: str) -> tuple[str, Rule]:
    """The original name of diffusers' layer ``module`` (``blocks.0.attn1.to_q``) and the rule that gave it."""
    for rule in name_rules(family):
        match = re.fullmatch(rule.pattern, module)
        if match:
            return match.expand(rule.name), rule
    raise ConfigError(f"the adapter on {module} has no ComfyUI name for model.family={family} (ringdit maps the "
                      f"attention, MLP and modulation projections); export it with lora=true format=diffusers, or "
                      f"train with lora.targets that leave it out")


def comfyui_lora(adapters: dict[str, Tensor], scale: float, family: str,
                 out_features: dict[str, int]) -> dict[str, Tensor]:
    """``adapters`` -- one transformer's, by diffusers' names (``blocks.0.attn1.to_q.lora_A.weight``, ``lora_B``) --
    in ComfyUI's format. ``scale``: the adapters' alpha / rank; ``out_features``: every layer's output size (the
    rows a fused layer's part without an adapter takes)."""
    if not name_rules(family):
        raise ConfigError(f"format=comfyui has no layer names for model.family={family}; it exports "
                          f"{', '.join(with_original_lora_names())}; use format=diffusers")
    layers: dict[str, Original] = {}
    for key in sorted(adapters):
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[:-len(".lora_A.weight")]
        down, up = adapters[key], adapters[f"{module}.lora_B.weight"]
        name, rule = original_layer(family, module)
        layer = layers.setdefault(name, Original(rule, module[:len(module) - len(rule.part)], {}))
        layer.pieces[rule.part or module] = (down, up)
    out = {}
    for name, layer in layers.items():
        down, up = _fuse(layer, out_features) if layer.rule.parts else next(iter(layer.pieces.values()))
        key, (down_key, up_key) = f"{PREFIX}{name}", find_family(family).original_lora_keys
        out[f"{key}.{down_key}.weight"] = down.clone().contiguous()
        if layer.rule.alpha:
            out[f"{key}.{up_key}.weight"] = up.clone().contiguous()
            out[f"{key}.alpha"] = torch.tensor(scale * down.shape[0], dtype=torch.float32)  # alpha / rank = scale
        else:
            out[f"{key}.{up_key}.weight"] = (up * scale).contiguous()
    return out


def _fuse(layer: Original, out_features: dict[str, int]) -> tuple[Tensor, Tensor]:
    """The fused layer's adapter: the parts' downs stacked, their ups block-diagonal over the fused layer's rows (a
    part without an adapter: zero rows, so its rows of the weight stay as they are)."""
    downs = [layer.pieces[part][0] for part in layer.rule.parts if part in layer.pieces]
    rank = sum(down.shape[0] for down in downs)
    ups, column = [], 0
    for part in layer.rule.parts:
        rows = layer.pieces[part][1].shape[0] if part in layer.pieces else out_features[layer.prefix + part]
        block = downs[0].new_zeros(rows, rank)  # (rows of this part, rank of the fused adapter)
        if part in layer.pieces:
            down, up = layer.pieces[part]
            block[:, column:column + down.shape[0]] = up
            column += down.shape[0]
        ups.append(block)
    return torch.cat(downs), torch.cat(ups)


# ---- reading LoRA files of other tools (infer.py lora=[...]) -------------------------------------------------------

LORA_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")  # diffusers / ringdit, peft
DOWN_KEYS, UP_KEYS = (".lora_A.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_up.weight")
NAME_PREFIXES = ("transformer.", "base_model.model.", PREFIX)  # diffusers / ringdit, peft, ComfyUI
OTHER_KINDS = {"lora_magnitude_vector": "DoRA", "hada_": "LoHa", "lokr_": "LoKr"}


def lora_file_paths(given: str, experts: int, setting: str) -> list[Path]:
    """The adapter file(s) ``given`` names, one per expert at most: a ``.safetensors`` file, or a folder holding
    ``pytorch_lora_weights.safetensors`` (diffusers' and ``python -m ringdit.export lora=true``'s; a two-expert
    export's low-noise expert's in ``transformer_2/``) or ``adapter_model.safetensors`` (peft's ``save_pretrained``)."""
    path = Path(str(given)).expanduser()
    if path.is_dir():
        found = next((path / name for name in LORA_FILES if (path / name).is_file()), None)
        if found is None:
            raise ConfigError(f"{setting}={given} is a folder without {' or '.join(LORA_FILES)}; give the adapter's "
                              f".safetensors file or the folder python -m ringdit.export lora=true wrote")
        second = path / "transformer_2" / found.name
        return [found, second] if experts > 1 and second.is_file() else [found]
    if not path.is_file():
        raise ConfigError(f"{setting}={given} does not exist; give a LoRA .safetensors file or the folder python -m "
                          f"ringdit.export lora=true wrote")
    if path.suffix != ".safetensors":
        raise ConfigError(f"{setting}={given} is not a .safetensors file (pickled formats are not loaded); convert it, "
                          f"or export the run with python -m ringdit.export lora=true")
    return [path]


def read_lora_file(path: Path, root, family: str | None, setting: str) -> dict[str, tuple[Tensor, Tensor, float]]:
    """The adapter in ``path`` for ``root`` (one transformer: ``ringdit.models.lora.adapted_modules``), by ``root``'s module
    names: each layer's ``(A (r, in), B (out, r), alpha / r)``. Read: diffusers' and ringdit's LoRA files
    (``transformer.<module>.lora_A.weight``, alpha in ``lora_adapter_metadata``), peft's (``base_model.model.`` or
    no prefix; alpha in the folder's ``adapter_config.json``) and ComfyUI's (the model's original names,
    ``lora_down`` / ``lora_up`` / ``alpha``: the inverse of ``comfyui_lora``; a fused original layer's adapter split
    into its diffusers parts, exactly: each part's rows of ``up`` with the whole ``down``). Every tensor is checked
    against the layer it adapts: a file of another model is refused naming ``setting`` and the first layer that
    does not fit."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as opened:
            metadata = opened.metadata() or {}
            tensors = {key: opened.get_tensor(key) for key in opened.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise ConfigError(f"{setting}={path} is not a readable safetensors file ({first_line(error)})") from None
    default_alpha = _file_alpha(path, metadata, setting)
    pieces: dict[str, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        name, kind = _split_key(key)
        if kind is None:
            other = next((label for part, label in OTHER_KINDS.items() if part in key), None)
            what = (f"{other} weights; infer.py lora= stacks plain LoRA files (lora_A / lora_B): fuse the adapter into "
                    f"its base with the tool that trained it (a ringdit run: python -m ringdit.export lora=true "
                    f"merge=true) and sample that") if other else \
                "not a LoRA weight (lora_A / lora_B, lora_down / lora_up, alpha)"
            raise ConfigError(f"{setting}={path} holds {key!r}: {what}")
        pieces.setdefault(name, {})[kind] = value
    modules = dict(root.named_modules())
    originals = _original_names(root, family) if any(name not in modules for name in pieces) else {}
    layers = {}
    for name, piece in sorted(pieces.items()):
        if "down" not in piece or "up" not in piece:
            missing = "lora_A / lora_down" if "down" not in piece else "lora_B / lora_up"
            raise ConfigError(f"{setting}={path}: the adapter of {name!r} has no {missing} weight")
        down, up = piece["down"], piece["up"]
        if not (down.is_floating_point() and up.is_floating_point()) or down.dim() != 2 or up.dim() != 2 \
                or not bool(torch.isfinite(down).all() and torch.isfinite(up).all()):
            raise ConfigError(f"{setting}={path}: the adapter of {name!r} is not two matrices of finite numbers")
        rank = down.shape[0]
        alpha = float(piece["alpha"]) if "alpha" in piece else default_alpha
        scale = alpha / rank if alpha is not None else 1.0  # no alpha: alpha = rank (diffusers', ComfyUI's 1)
        parts = [name] if name in modules else originals.get(name)
        if not parts:
            raise ConfigError(f"{setting}={path} adapts {name!r}, which is no linear layer of this "
                              f"{type(root).__name__} (a LoRA of another model?); give a LoRA trained on this model")
        row = 0
        for part in parts:  # a fused original layer: each part its rows of up
            layer = modules[part]
            linear = getattr(layer, "base_layer", layer)  # a layer already carrying a trained adapter
            rows = getattr(linear, "out_features", None)
            part_up = up[row:row + rows] if rows is not None else up
            row += rows or 0
            if not isinstance(linear, torch.nn.Linear) or down.shape[1] != linear.in_features \
                    or part_up.shape != (linear.out_features, rank):
                needs = f"(r, {linear.in_features}) and ({linear.out_features}, r)" if isinstance(
                    linear, torch.nn.Linear) else "a linear layer"
                raise ConfigError(f"{setting}={path}: its adapter of {name!r} has lora_A {tuple(down.shape)} and "
                                  f"lora_B {tuple(up.shape)}, but {part!r} needs {needs} (a LoRA of another model "
                                  f"or size?); give a LoRA trained on this model")
            layers[part] = (down, part_up, scale)
        if row and row != up.shape[0]:
            raise ConfigError(f"{setting}={path}: its adapter of {name!r} has {up.shape[0]} output rows, but the "
                              f"layers it stands for have {row} (a LoRA of another model or size?)")
    if not layers:
        raise ConfigError(f"{setting}={path} holds no LoRA weights")
    return layers


def _split_key(key: str) -> tuple[str, str | None]:
    """``(layer name without the format's prefix, down | up | alpha)``; kind None for what is no LoRA weight."""
    name = next((key[len(p):] for p in NAME_PREFIXES if key.startswith(p)), key)
    for kind, suffixes in (("down", DOWN_KEYS), ("up", UP_KEYS), ("alpha", (".alpha",))):
        for suffix in suffixes:
            if name.endswith(suffix):
                return name[:-len(suffix)], kind
    return name, None


def _file_alpha(path: Path, metadata: dict, setting: str) -> float | None:
    """The file's alpha for layers without an ``alpha`` tensor: diffusers' ``lora_adapter_metadata``, or peft's
    ``adapter_config.json`` beside it; None: alpha = rank."""
    config = None
    if "lora_adapter_metadata" in metadata:
        try:
            config = json.loads(metadata["lora_adapter_metadata"])
        except ValueError:
            raise ConfigError(f"{setting}={path}: its lora_adapter_metadata is not JSON") from None
    elif (path.parent / "adapter_config.json").is_file():
        config = read_json(path.parent / "adapter_config.json", f"{setting}={path}: adapter_config.json", kind=dict,
                           fix="give the adapter folder peft's save_pretrained wrote")
    if not isinstance(config, dict):
        return None
    alpha = config.get("transformer.lora_alpha", config.get("lora_alpha"))
    if alpha is None:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"{setting}={path}: lora_alpha={alpha!r} in its metadata is not a positive number")
    return float(alpha)


def _original_names(root, family: str | None) -> dict[str, list[str]]:
    """Each original layer name (ComfyUI's) of ``root``'s linear layers: the diffusers layers it stands for, in the
    fused layer's row order (one layer where the original is not fused)."""
    if not name_rules(family):
        return {}
    found: dict[str, tuple[Rule, dict[str, str]]] = {}
    for module, layer in root.named_modules():
        if ".lora_" in f".{module}" or module.endswith("base_layer") or \
                not isinstance(getattr(layer, "base_layer", layer), torch.nn.Linear):
            continue  # peft's own modules inside an adapted layer
        try:
            name, rule = original_layer(family, module)
        except ConfigError:
            continue
        found.setdefault(name, (rule, {}))[1][rule.part or module] = module
    return {name: [parts[part] for part in rule.parts if part in parts] if rule.parts else list(parts.values())
            for name, (rule, parts) in found.items()}


@dataclass(frozen=True)
class LoraFile:
    """One entry of ``infer.py lora=[{path, strength}, ...]``: an adapter file (one per expert: ``path`` for the
    first, ``path_2`` for a two-expert model's low-noise expert) stacked on the model at ``strength``."""

    setting: str                # lora[i], for errors
    paths: tuple[Path, ...]     # one per expert, the first expert's first
    strength: float


def lora_file_entries(entries, model) -> tuple[LoraFile, ...]:
    """``infer.py``'s ``lora`` setting (a list of ``{path, strength, path_2}``; a bare path: strength 1), each file
    read and checked against ``model`` (on the meta device is enough) before anything starts: one line naming the
    entry's setting and value for a missing file, a strength that is not a number, a file of another model."""
    from omegaconf import OmegaConf

    entries = OmegaConf.to_container(entries) if OmegaConf.is_config(entries) else entries
    if entries is None:
        return ()
    if isinstance(entries, (str, dict)):  # lora={path: ..., strength: ...} or lora=FILE: one adapter
        entries = [entries]
    if not isinstance(entries, (list, tuple)):
        raise ConfigError(f"lora must be a list of adapters, e.g. 'lora=[{{path: style.safetensors, strength: "
                          f"0.8}}]', got {entries!r}")
    roots, files = adapted_modules(model), []
    family = model.kind_name
    for i, entry in enumerate(entries):
        setting = f"lora[{i}]"
        entry = {"path": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict) or "path" not in entry or set(entry) - {"path", "path_2", "strength"}:
            raise ConfigError(f"{setting}={entry!r}: give {{path: FILE, strength: NUMBER}} (path_2: a two-expert "
                              f"model's low-noise expert's file)")
        strength = entry.get("strength", 1.0)
        require_number(f"{setting}.strength", strength)
        paths = lora_file_paths(entry["path"], len(roots), f"{setting}.path")
        if entry.get("path_2") is not None:
            if len(roots) < 2:
                raise ConfigError(f"{setting}.path_2={entry['path_2']}: this model has one transformer; drop path_2")
            paths = [paths[0], *lora_file_paths(entry["path_2"], 1, f"{setting}.path_2")]
        for index, path in enumerate(paths):
            read_lora_file(path, roots[index], family, f"{setting}.{'path' if index == 0 else 'path_2'}")
        files.append(LoraFile(setting, tuple(paths), float(strength)))
    return tuple(files)


def read_lora_stack(files: tuple[LoraFile, ...], model) -> list:
    """``files``' adapters for ``model`` as ``ringdit.models.lora.stack_adapters`` takes them: ``(layers per expert,
    strength)``."""
    roots = adapted_modules(model)
    family = model.kind_name
    return [([read_lora_file(path, roots[index], family, f"{file.setting}.{'path' if index == 0 else 'path_2'}")
              for index, path in enumerate(file.paths)], file.strength) for file in files]
