"""LoRA fine-tuning with peft: low-rank adapters on the model's projections; everything else frozen.

    python train.py init_from=weights.safetensors lora.rank=16                  # DiT: attention + MLP projections
    python train.py experiment=wan_tiny lora.rank=16 lora.targets=[to_q,to_v]   # diffusers: module name suffixes
    python train.py model=wan_vace_tiny lora.rank=16 'lora.targets=[vace_blocks.*.attn1.to_q]'  # path patterns

A target is a suffix of module paths (``to_q``, ``attn1.to_q``: peft's rule), or a path pattern in which ``*`` stands
for one name of the path (a block's index: ``vace_blocks.*.attn1.to_q`` adapts the VACE blocks' and not the main
blocks'), also matched as a suffix (``target_pattern``).

Adapters are injected with ``peft.inject_adapter_in_model`` into the model itself (a DiT) or its diffusers
transformer (``model.transformer``, with diffusers' own ``add_adapter``), so the model keeps its class and forward;
a wrapped layer's weight becomes ``<layer>.base_layer.weight`` and its adapter ``<layer>.lora_A.default.weight`` /
``lora_B``. Checkpoints keep only the adapter weights and the empty prompt's embedding the run trained with (the base
comes from ``init_from`` / ``model.pretrained``);
``python -m ringdit.export ... lora=true`` writes the adapter in diffusers' LoRA format
(``pytorch_lora_weights.safetensors``, keys ``transformer.<module>.lora_A.weight``), which diffusers'
``load_lora_adapter`` / pipelines' ``load_lora_weights`` read.

The frozen base's projections -- every Linear / Conv layer that does not train, adapted or not: about 99% of the
weights of Wan or DiT-XL -- can be held in a narrower dtype than the adapters (``lora.base_dtype=bfloat16``, the
default on GPUs: half the memory of an fp32 base), as musubi-tuner and DiffSynth fine-tune on a bf16 base; the
adapters and their optimizer state stay fp32. Sampling from an adapter-only checkpoint builds the base from the
weights the run started from and loads the adapters onto it (``load_adapter``).

An fp8 base (``lora.base_dtype=float8_e4m3fn`` or ``float8_e5m2``): ``ringdit.models.fp8``.
"""

from __future__ import annotations

import difflib
import json
import re
import types
from pathlib import Path

import torch
from torch import nn

from ringdit.checkpoints.fit import first_misfit
from ringdit.checkpoints.sources import local_index, local_part
from ringdit.common.atomic import atomic_write
from ringdit.common.dtypes import dtype_named
from ringdit.common.errors import ConfigError, require_count, require_number
from ringdit.models.fp8 import FLOAT8, block_linears, hold_in_float8

Tensor = torch.Tensor

ADAPTER_NAME = "default"

# The layers whose frozen weights ``base_dtype`` casts: the model's projections (LoRA's own A and B are Linears too,
# but they train).
BASE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
BASE_DTYPES = ("float32", "bfloat16", "float16", *FLOAT8)  # what lora.base_dtype takes
# what lora.type takes: peft's LoRA; DoRA (peft's use_dora: each adapted weight's direction from W + B A, its
# per-output-row magnitude trained apart, lora_magnitude_vector); LoHa (the update a Hadamard product of two low-rank
# products, hada_*) and LoKr (a Kronecker product, lokr_*), peft's LyCORIS tuners
LORA_TYPES = ("lora", "dora", "loha", "lokr")
ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_magnitude_vector.", ".hada_", ".lokr_")  # in adapter weights' names


def lora_enabled(lora: dict | None) -> bool:
    return bool(lora) and (lora.get("rank") or 0) > 0


def check_lora_settings(lora: dict | None) -> None:
    """The ``lora`` settings are ones that train something: a rank of 0 (off) or more, never a negative one that
    would quietly mean a full fine-tune; a scale alpha / rank that is not zero (adapters scaled by 0 learn nothing);
    a dropout probability below 1; targets as module-name suffixes or path patterns; a base dtype ringdit knows (or
    null)."""
    lora = lora or {}
    require_count("lora.rank", lora.get("rank", 0), minimum=0, hint="0 disables LoRA, > 0 is the adapters' rank")
    if not lora_enabled(lora):
        if str(lora.get("base_dtype")) in FLOAT8:
            raise ConfigError(f"lora.base_dtype={lora['base_dtype']} holds a frozen base in fp8, but lora.rank="
                              f"{lora.get('rank', 0)} is a full fine-tune, which cannot train fp8 weights; set "
                              f"lora.rank > 0 (e.g. lora.rank=16) or lora.base_dtype=null")
        return
    alpha = lora.get("alpha")
    require_number("lora.alpha", alpha, optional=True)
    if alpha is not None and alpha <= 0:
        raise ConfigError(f"lora.alpha must be > 0 (the adapters' output is scaled by alpha / rank, so {alpha!r} "
                          f"{'learns nothing' if alpha == 0 else 'flips their sign'}); use null for alpha = rank")
    require_number("lora.dropout", lora.get("dropout", 0.0), low=0, high=1)
    if lora.get("dropout", 0.0) == 1:
        raise ConfigError("lora.dropout=1 drops every input of the adapters, so nothing is learned; use a "
                          "probability below 1 (0 is usual)")
    resolve_base_dtype(lora.get("base_dtype"))
    kind = lora.get("type") or "lora"
    if kind not in LORA_TYPES:
        raise ConfigError(f"lora.type={kind!r} is not one of {', '.join(LORA_TYPES)}: peft's LoRA, DoRA (use_dora: "
                          f"a trained magnitude per output row of each adapted weight), LoHa, LoKr")
    if kind == "dora" and str(lora.get("base_dtype")) in FLOAT8:
        raise ConfigError(f"lora.type=dora divides each adapted weight by its row norms, which an fp8 base "
                          f"(lora.base_dtype={lora['base_dtype']}) does not hold (its rows are scaled apart); use "
                          f"lora.base_dtype=bfloat16, or lora.type=lora on the fp8 base")
    targets = lora.get("targets")
    names = [targets] if isinstance(targets, str) else targets
    if targets is not None and (not isinstance(names, (list, tuple)) or not names
                                or not all(isinstance(n, str) and n for n in names)):
        raise ConfigError(f"lora.targets must be null (the default projections) or module-name suffixes such as "
                          f"[to_q,to_v] or path patterns such as [vace_blocks.*.attn1.to_q], got {targets!r}")


def target_pattern(target: str) -> str:
    """The regular expression (``re.fullmatch`` over a module's path) of one ``lora.targets`` entry: its path as a
    suffix of the module's, each ``*`` one name of the path (or the rest of one: ``to_*``)."""
    return r"(?:.*\.)?" + r"[^.]+".join(re.escape(part) for part in target.split("*"))


def matches_targets(name: str, targets) -> bool:
    """Whether the module at path ``name`` is one ``targets`` select (suffixes, ``*`` patterns: ``target_pattern``)."""
    targets = [targets] if isinstance(targets, str) else targets
    return any(re.fullmatch(target_pattern(target), name) for target in targets)


def peft_targets(targets: list[str]) -> list[str] | str:
    """peft's ``target_modules`` for ``targets``: the list itself where all are suffixes (peft's own rule), else one
    regular expression that peft matches against each module's whole path."""
    if not any("*" in target for target in targets):
        return targets
    return "|".join(f"(?:{target_pattern(target)})" for target in targets)


def check_patterns_select(targets, model: nn.Module, roots) -> None:
    """Each ``*`` pattern of ``targets`` selects a linear layer of ``roots`` (the adapted transformers of ``model``;
    peft refuses only targets that select nothing at all): else a ``ConfigError`` with the layers' paths most like it,
    their indices starred: patterns that would."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    names = [name for root in roots for name, module in root.named_modules() if isinstance(module, nn.Linear)]
    for target in targets:
        if "*" in target and not any(matches_targets(name, [target]) for name in names):
            starred = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in names))
            closest = difflib.get_close_matches(target, starred, n=4, cutoff=0)  # the paths most like the pattern
            raise ConfigError(f"lora.targets: {target} selects no linear layer of {type(model).__name__} (* stands for "
                              f"one name of a module's path); its layers' paths are such as {closest}")


def resolve_base_dtype(name) -> torch.dtype | None:
    """The dtype ``lora.base_dtype`` names (None: left as built; ``ringdit.spec.checkpoint`` resolves the config's
    null to the device's default before a run starts)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if str(name) in FLOAT8:
        return FLOAT8[str(name)]
    try:
        return dtype_named("lora.base_dtype", str(name))
    except ConfigError:
        raise ConfigError(f"lora.base_dtype={str(name)!r} is not a dtype ringdit takes; use one of "
                          f"{', '.join(BASE_DTYPES)} (null: bfloat16 on GPUs, float32 on CPUs)") from None


def lora_config(model: nn.Module, rank: int, alpha: float | None = None, targets=None, dropout: float = 0.0,
                type: str | None = "lora"):
    from peft import LoraConfig

    check_lora_settings({"rank": rank, "alpha": alpha, "targets": targets, "dropout": dropout, "type": type})
    if targets is None:
        targets = getattr(model, "lora_targets", None)  # each model kind's default projections
        if targets is None:
            raise ConfigError(f"lora.targets: no default targets for {type(model).__name__}; list the module names "
                              f"(suffixes) to adapt, e.g. lora.targets=[to_q,to_v]")
    targets = [targets] if isinstance(targets, str) else list(targets)
    if type in ("loha", "lokr"):  # peft's LyCORIS tuners: one factor starts at zero, so the model starts as the base
        from peft import LoHaConfig, LoKrConfig

        kind = LoHaConfig if type == "loha" else LoKrConfig
        return kind(r=rank, alpha=alpha if alpha is not None else rank, target_modules=peft_targets(targets),
                    rank_dropout=dropout,
                    init_weights=True)
    return LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=peft_targets(targets),
                      lora_dropout=dropout, init_lora_weights=True, use_dora=type == "dora")


def adapted_modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """What the adapters go into: each expert of a two-expert model (Wan 2.2 A14B: both transformers, each with its
    own adapters), a diffusers model's transformer, else the model itself."""
    return tuple(getattr(model, "expert_modules", ()) or ()) or (getattr(model, "transformer", model),)


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, targets=None, dropout: float = 0.0,
             base_dtype: str | torch.dtype | None = None, type: str | None = "lora") -> nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else; returns ``model``.

    ``base_dtype``: the dtype the frozen projections are held in (see ``hold_base_in``); None keeps them as built.
    ``type``: ``lora`` or ``dora`` (``LORA_TYPES``). Works on a model whose parameters are on the meta device (only
    the dtype they will have changes; a DoRA magnitude gets its value once the base is loaded:
    ``ringdit.models.materialize``).
    """

    config = lora_config(model, rank, alpha, targets, dropout, type)
    check_patterns_select(targets if targets is not None else model.lora_targets, model, adapted_modules(model))
    model.requires_grad_(False)
    for root in adapted_modules(model):
        _inject(root, config, model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    dtype = resolve_base_dtype(base_dtype)
    if dtype is not None:  # after the injection: peft would otherwise cast the new adapters to the base's dtype
        hold_base_in(model, dtype)
    return model


def _inject(root: nn.Module, config, model: nn.Module) -> None:
    """The adapters of ``config`` into ``root`` (one transformer of ``model``)."""
    from peft import inject_adapter_in_model

    try:
        if hasattr(root, "add_adapter"):  # diffusers: registers the config, so diffusers can save / fuse it
            root.add_adapter(config, adapter_name=ADAPTER_NAME)
        else:
            inject_adapter_in_model(config, root, adapter_name=ADAPTER_NAME)
    except ValueError:  # peft: "Target modules {...} not found in the base model"
        targets = config.target_modules
        raise unmatched_targets([targets] if isinstance(targets, str) else sorted(targets), model, [root]) from None


def unmatched_targets(targets: list[str], model: nn.Module, roots: list[nn.Module]) -> ConfigError:
    """The error for ``lora.targets`` that name no Linear layer of ``roots`` (the adapted transformers of
    ``model``), listing the suffixes that would."""
    linears = sorted({name.rsplit(".", 1)[-1] for root in roots for name, module in root.named_modules()
                      if isinstance(module, nn.Linear)})
    return ConfigError(f"lora.targets={targets} match no linear layer of {type(model).__name__}; name linear layers "
                       f"by their path suffix, e.g. {linears[:8]}")


def hold_base_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Hold the weights of every frozen Linear / Conv layer of ``model`` in ``dtype``: the adapted layers' base
    (peft's ``base_layer``) and the projections no adapter targets (a Wan FFN: without them a bf16 base would save a
    fifth of Wan 1.3B's weights, not half). Norms, embedding and modulation tables, position tables keep their dtype
    (they are small, and some are sensitive to rounding), and the adapters stay as they are (fp32: their updates and
    optimizer state are not rounded). Each cast layer computes in its own dtype (``_forward_in_own_dtype``).
    An fp8 ``dtype``: the blocks' Linear layers in fp8 with per-row scales (``hold_in_float8``), the rest in bf16.
    """
    if dtype in FLOAT8.values():
        in_blocks = block_linears(model)
        for layer in in_blocks:
            if not any(p.requires_grad for p in layer.parameters()):
                hold_in_float8(layer, dtype)
        dtype = torch.bfloat16
    for layer in model.modules():
        if isinstance(layer, BASE_LAYERS) and not any(p.requires_grad for p in layer.parameters()) \
                and layer.weight.dtype != dtype and not hasattr(layer, "weight_scale"):
            layer.to(dtype)
            # an instance attribute, not forward hooks: the output is cast back to the dtype the input had, which a
            # post-hook no longer sees once a pre-hook cast it; deepcopy rebinds the method to the copy (a meta check's
            # copy computes with its own weights)
            layer.forward = types.MethodType(_forward_in_own_dtype, layer)


def _forward_in_own_dtype(self: nn.Module, x: Tensor, *args, **kwargs) -> Tensor:
    """A frozen layer held in a narrower dtype than the activations (a bf16 base in an fp32 run, as on CPU at
    precision 32): its input is cast to the weight's dtype -- a matmul needs both in one dtype -- and its output back
    to the input's. Not only for the next layers: peft adds the fp32 adapter's output to its base layer's and then
    casts the sum to the base output's dtype, so a bf16 output here would round the adapter's contribution (and the
    gradient reaching it) to bf16. Under autocast (bf16-mixed) or when the activations already have the weight's
    dtype (FSDP's param_dtype) the layer runs as it is: autocast does the casting itself."""
    own = type(self).forward
    if x.dtype == self.weight.dtype or torch.is_autocast_enabled(x.device.type):
        return own(self, x, *args, **kwargs)
    return own(self, x.to(self.weight.dtype), *args, **kwargs).to(x.dtype)


def is_adapter_key(key: str) -> bool:
    return any(part in key for part in ADAPTER_PARTS)


@torch.no_grad()
def init_dora_magnitudes(model: nn.Module) -> None:
    """Each DoRA layer's magnitude as peft initialises it: the row norms of its base weight (with B zero the
    adapted weight is W, so the adapted model starts as the base). For a model adapted on the meta device and filled
    afterwards; each rank computes its own rows (FSDP shards the weight's rows and the magnitude alike)."""
    for layer in model.modules():
        magnitudes = getattr(layer, "lora_magnitude_vector", None)
        if not magnitudes:
            continue
        weight = local_part(layer.get_base_layer().weight)  # (out rows of this rank, in)
        for magnitude in magnitudes.values():
            rows = weight.flatten(1).to(torch.promote_types(weight.dtype, torch.float32))  # a bf16 base: fp32 norms
            local_part(magnitude.weight).copy_(torch.linalg.norm(rows, dim=1))


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter weights of a (checkpoint) state dict."""
    return {key: value for key, value in state.items() if is_adapter_key(key)}


def null_condition_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s null-condition buffers: the empty prompt's embedding, which training set from its data
    (``set_null_condition``) and guidance steers away from. An adapter checkpoint keeps them beside the adapters:
    the base it is sampled on holds zeros there (a diffusers folder has no empty-prompt embedding) or another run's."""
    nulls = {id(buffer) for buffer in model.null_buffers().values()} if hasattr(model, "null_buffers") else set()
    return {name for name, buffer in model.named_buffers() if id(buffer) in nulls}


def is_null_condition_key(key: str) -> bool:
    """A null-condition buffer's key in an adapter checkpoint (``null_condition_names``: ``null_text``, ...)."""
    return key.rsplit(".", 1)[-1].startswith("null_")


@torch.no_grad()
def load_null_condition(model: nn.Module, state: dict[str, Tensor]) -> bool:
    """Copy an adapter checkpoint's null-condition buffers (by the model's names) into ``model``; False when the
    model has some and ``state`` holds none of them (a checkpoint written before adapter checkpoints kept them)."""
    names = null_condition_names(model)
    buffers = dict(model.named_buffers())
    for name in names & state.keys():
        buffers[name].copy_(state[name].reshape(buffers[name].shape))
    return not names or bool(names & state.keys())


def check_adapter_fits(model: nn.Module, adapter: dict[str, Tensor], model_named: str = "the model") -> str | None:
    """Why ``adapter`` (adapter weights by the model's names) does not fit ``model`` (adapted with the same LoRA
    settings; on the meta device is enough), naming the first key that does not; None when it fits."""
    state = model.state_dict()
    nulls = {key: value for key, value in adapter.items() if is_null_condition_key(key)}  # none in older checkpoints
    return first_misfit({**adapter_state(state), **{key: state[key] for key in nulls if key in state}},
                        {**adapter_state(adapter), **nulls}, "the adapter", model_named)


@torch.no_grad()
def load_adapter(model: nn.Module, adapter: dict[str, Tensor]) -> None:
    """Copy the adapter weights ``adapter`` (by the model's names) into the adapted ``model``, which already holds
    its base weights; each rank of an FSDP model keeps its shard of each (``ringdit.checkpoints.sources``)."""
    problem = check_adapter_fits(model, adapter)
    if problem is not None:
        raise ConfigError(f"the LoRA adapter does not fit the model: {problem}")
    params = dict(model.named_parameters())
    for key, value in adapter.items():
        target = params[key]
        local_part(target).copy_(value[local_index(target)])


def diffusers_lora_state(state: dict[str, Tensor], prefix: str = "transformer.") -> dict[str, Tensor]:
    """Adapter weights of the model (keys ``transformer.blocks.0.attn1.to_q.lora_A.default.weight`` for a diffusers
    model, ``blocks.0.attn.qkv.lora_A.default.weight`` for a DiT) in diffusers' LoRA layout:
    ``transformer.<module>.lora_A.weight``."""
    out = {}
    for key, value in adapter_state(state).items():
        key = key.replace(f".{ADAPTER_NAME}.", ".")
        if key.endswith(".lora_magnitude_vector.weight"):  # DoRA's, as peft and diffusers name it
            key = key.removesuffix(".weight")
        out[key if key.startswith(prefix) else prefix + key] = value.detach().contiguous().clone()
    return out


def export_lora(state: dict[str, Tensor], lora: dict, out_dir: str | Path) -> Path:
    """Write ``state``'s adapter as diffusers' ``pytorch_lora_weights.safetensors`` in ``out_dir`` (with the peft
    config as diffusers' ``lora_adapter_metadata``); a two-expert model's low-noise expert's (``transformer_2.``) in
    ``out_dir/transformer_2/``, keyed ``transformer.`` as diffusers' ``load_into_transformer_2=True`` reads it."""
    experts = {"": {}, "transformer_2": {}}
    for key, value in adapter_state(state).items():
        low = key.startswith("transformer_2.")
        experts["transformer_2" if low else ""][key.removeprefix("transformer_2.") if low else key] = value
    if not experts[""] and not experts["transformer_2"]:
        raise ConfigError("the checkpoint holds no LoRA adapter weights (trained without lora.rank > 0?)")
    written = [_write_lora(adapters, lora, Path(out_dir) / subfolder) for subfolder, adapters in experts.items()
               if adapters]
    return written[0]


def _write_lora(adapters: dict[str, Tensor], lora: dict, out_dir: Path) -> Path:
    from safetensors.torch import save_file

    tensors = diffusers_lora_state(adapters)
    modules = sorted({key[len("transformer."):].rsplit(".lora_", 1)[0] for key in tensors})
    rank = int(next(v for k, v in tensors.items() if ".lora_A." in k).shape[0])
    config = {"r": rank, "lora_alpha": lora.get("alpha") or rank, "target_modules": modules, "lora_dropout": 0.0,
              "bias": "none", "use_dora": any(key.endswith(".lora_magnitude_vector") for key in tensors)}
    metadata = {f"transformer.{key}": value for key, value in config.items()}  # diffusers keys it by component
    path = out_dir / "pytorch_lora_weights.safetensors"
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt",
                                               "lora_adapter_metadata": json.dumps(metadata, sort_keys=True)})
    return path


# ---- adapters fused into the base, or stacked on it ---------------------------------------------------------------


@torch.no_grad()
def merged_state(model: nn.Module, strength: float = 1.0) -> dict[str, Tensor]:
    """The weights of the adapted ``model`` with its adapters fused at ``strength``, by the plain model's names (no
    ``base_layer``, no adapter weights): what the model without adapters loads, and computes as the adapted one did
    (``python -m ringdit.export ... lora=true merge=true``). peft's own ``merge`` fuses each layer (``W + strength *
    alpha / r * B A`` for LoRA), so every adapter kind peft merges is fused as peft computes it. ``model`` is changed
    (its layers hold the fused weights)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in model.modules():
        if isinstance(layer, BaseTunerLayer) and ADAPTER_NAME in getattr(layer, "scaling", {ADAPTER_NAME: 1}):
            if strength != 1:
                layer.set_scale(ADAPTER_NAME, strength)  # alpha / r times strength
            layer.merge(adapter_names=[ADAPTER_NAME])
    return {key.replace(".base_layer.", "."): value for key, value in model.state_dict().items()
            if not is_adapter_key(key)}


LowRank = tuple[Tensor, Tensor, float]  # one layer's adapter: down A (r, in), up B (out, r), its scale alpha / r


def stack_adapters(roots: tuple[nn.Module, ...], adapters, device=None) -> list:
    """Make ``roots`` (``adapted_modules(model)``: one transformer per expert) compute as their base merged with
    every adapter of ``adapters`` at its strength: each adapted layer's output gets ``sum_i s_i scale_i (x A_i^T)
    B_i^T`` added by one forward hook, which is ``x (W + sum_i s_i scale_i B_i A_i)^T`` up to the order of the sums.
    ``adapters``: ``(layers, strength)`` pairs, ``layers`` one ``{module name: LowRank}`` per expert (the first
    expert's first; fewer than the experts: the rest get none). The base weights are left alone -- any dtype (an
    fp8 or bf16 base), sharded by FSDP or not -- and a layer that already carries a trained peft adapter gets these
    on top. Returns the hooks' handles (``handle.remove()`` takes an adapter stack off again).
    ``infer.py lora=[...]`` and the server's ``loras=[...]`` requests call it."""
    terms: dict[tuple[int, str], list[LowRank]] = {}
    for experts, strength in adapters:
        for index, layers in enumerate(experts):
            for name, (down, up, scale) in layers.items():
                terms.setdefault((index, name), []).append((down.to(device), up.to(device), float(strength) * scale))
    return [roots[index].get_submodule(name).register_forward_hook(_adding(layer_terms))
            for (index, name), layer_terms in terms.items()]


def _adding(terms: list[LowRank]):
    def hook(module: nn.Module, args, output: Tensor) -> Tensor:
        x = args[0]  # (..., in)
        for down, up, scale in terms:
            output = output + scale * nn.functional.linear(nn.functional.linear(x, down.to(x.dtype)), up.to(x.dtype))
        return output  # (..., out)
    return hook
