"""Models built without their weights, and each rank given only its part of them.

``parameters_on_meta()`` builds a model whose parameters are shapes only (the meta device): nothing is allocated or
initialised, whatever the model's size. Buffers stay real: they hold what constructors compute and files do not
store (RoPE tables), and they are small. (accelerate's ``init_empty_weights(include_buffers=False)`` does the same.)

``materialize(model, ...)``, after the parallel plan, LoRA and FSDP's ``fully_shard`` were applied on the meta
device, allocates each parameter as this rank holds it -- an FSDP shard, or the whole tensor under DDP -- and fills
it from a weights file (``ringdit.checkpoints.sources``: only the slices this rank holds are read) or with its
initial value. The initial value of a parameter depends only on the run's seed and the name of the module that owns
it, never on the rank layout: each rank draws one module's full tensors at a time and keeps its slice, so FSDP over
any world size, DDP and one process start from the same weights, and no rank ever holds the whole model.

Initial values, in this order:
- LoRA adapters: ``lora_A`` as peft initialises it (a Linear's Kaiming-uniform), ``lora_B`` zero; DoRA's magnitude
  the base weight's row norms, once the base is filled; LoHa / LoKr as peft initialises them (one factor zero);
- the model's own rule, ``model.initial_value(name, shape, generator)`` (the DiT's is the original's init);
- the owning module's ``reset_parameters`` (Linear, Conv, LayerNorm, RMSNorm, ...), run on a CPU twin.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import zlib
from collections import defaultdict
from typing import Iterator

import torch
from torch import nn

from ringdit.checkpoints.fit import OPTIONAL_KEYS, check_compatible
from ringdit.checkpoints.sources import WeightSource, local_index, local_part
from ringdit.common.errors import ConfigError
from ringdit.common.seeding import Stream, seed_of
from ringdit.models.fp8 import float8_layers, load_float8_weight
from ringdit.models.lora import init_dora_magnitudes, is_adapter_key

Tensor = torch.Tensor

_building = threading.local()


def building_on_meta() -> bool:
    """Inside ``parameters_on_meta()``: models build from their architecture alone (their weights come later)."""
    return getattr(_building, "active", False)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside lives on the meta device; buffers are unchanged."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    _building.active = True
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        _building.active = False


# ---- giving each rank its part -----------------------------------------------------------------------------------


def materialize(model: nn.Module, device: torch.device, seed: int, source: WeightSource | None = None,
                transforms: dict | None = None, parameter_device: torch.device | None = None) -> None:
    """Allocate ``model``'s meta parameters on ``parameter_device`` (default ``device``; FSDP's CPU offload keeps
    them in CPU memory, the buffers on ``device``) as this rank holds them, and fill them: from ``source``
    where it holds the name (with the model's names; ``.base_layer`` of a LoRA-wrapped layer dropped), else with
    their initial values (seeded by ``seed``). ``transforms``: ``{name: f(full tensor) -> full tensor}`` for a
    tensor read whole and changed before it is sliced (a label table fitted to another class count)."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers(remove_duplicate=False)}
    model.to_empty(device=parameter_device or device)
    for module_name, module in model.named_modules():  # to_empty emptied the buffers too: their built values back
        for name in module._buffers:
            if module._buffers[name] is not None:
                module._buffers[name] = buffers[f"{module_name}.{name}".lstrip(".")].to(device)
    params = dict(model.named_parameters())
    float8 = _float8_weights(model, params)  # an fp8 base: filled at full precision, then quantized (below)
    loaded: dict[str, Tensor] = {}
    staged: dict[str, Tensor] = {}
    if source is not None:
        loaded = {file_name(name): param for name, param in params.items()
                  if not _is_adapter(name) and file_name(name).startswith(source.scope)}
        persistent = _persistent_buffers(model)
        loaded.update({name: buffer for name, buffer in model.named_buffers()
                       if name in persistent and name in source.shapes})  # a ringdit file's null prompt, ...
        check_source(loaded, source, transforms)
        loaded = {name: param for name, param in loaded.items()  # a file without them: their initial values
                  if name in source.shapes or not name.startswith(OPTIONAL_KEYS)}
        transformed = {name: loaded.pop(name) for name in list(loaded) if name in (transforms or {})}
        staged = {name: loaded.pop(name) for name in list(loaded) if name in float8}
        source.fill(loaded)
        with torch.no_grad():
            for name, target in transformed.items():
                full = transforms[name](source.read(name, ()))
                local_part(target).copy_(full[local_index(target)])
    initial = {name: param for name, param in params.items() if file_name(name) not in loaded
               and file_name(name) not in (transforms or {}) and file_name(name) not in staged}
    _fill_float8(model, {name: initial.pop(name) for name in list(initial) if file_name(name) in float8},
                 float8, seed, None)
    initialize(model, initial, seed)
    _fill_float8(model, staged, float8, seed, source)
    if any(".lora_magnitude_vector." in name for name in params):  # DoRA: from the base weights, now filled

        init_dora_magnitudes(model)


def _float8_weights(model: nn.Module, params: dict[str, Tensor]) -> dict:
    """``{file name: fp8 layer}`` of an fp8 base (``ringdit.models.lora``); their scales are dropped from ``params``: they
    are made with their weights."""
    layers = float8_layers(model)
    for name in layers:
        params.pop(name.removesuffix("weight") + "weight_scale")
    return {file_name(name): layer for name, layer in layers.items()}


def _fill_float8(model: nn.Module, targets: dict[str, Tensor], layers: dict, seed: int,
                 source: WeightSource | None) -> None:
    """Read (``source``) or initialise each fp8 weight of ``targets`` into an fp32 twin of this rank's part, one at a
    time, and quantize it into the layer (``ringdit.models.fp8.load_float8_weight``): no rank holds the whole base at full
    precision. The initial values are those of an fp32 model (the same generator per owning module)."""
    for name, target in targets.items():
        twin = torch.empty_like(target, dtype=torch.float32)  # a DTensor placed as the target under FSDP
        if source is not None:
            source.fill({file_name(name): twin})
        else:
            initialize(model, {name: twin}, seed)
        load_float8_weight(layers[file_name(name)], local_part(twin))


def file_name(name: str) -> str:
    """The name a weights file gives a model parameter: peft's LoRA wrapper moves a layer's weight to
    ``<layer>.base_layer.weight``; files written without LoRA call it ``<layer>.weight``."""
    return name.replace(".base_layer.", ".")


def check_source(targets: dict[str, Tensor], source: WeightSource, transformed: dict | None = None) -> None:
    """One error listing what ``source`` lacks, holds besides, or holds in another shape, before anything is read
    (a ``transformed`` tensor may have any shape: it is fitted before it loads)."""
    held = {name: shape for name, shape in source.shapes.items() if name.startswith(source.scope)}
    expected = {name: held.get(name, target.shape) if name in (transformed or {}) else target.shape
                for name, target in targets.items()}
    check_compatible(expected, held, source=source.path)


def _is_adapter(name: str) -> bool:
    return is_adapter_key(name)


# peft's LoHa / LoKr factors that start at zero (reset_adapter_parameters), so that the adapted model is the base;
# the other factors start Kaiming-uniform as peft draws them
ZERO_FACTORS = ("hada_w2_b", "lokr_w1", "lokr_w1_a")


def _persistent_buffers(model: nn.Module) -> set[str]:
    return {f"{prefix}.{name}".lstrip(".") for prefix, module in model.named_modules()
            for name in module._buffers if name not in module._non_persistent_buffers_set}


@torch.no_grad()
def initialize(model: nn.Module, params: dict[str, Tensor], seed: int) -> None:
    """Fill ``params`` (by name) with their initial values, one owning module's full tensors at a time."""
    by_owner: dict[str, list[str]] = defaultdict(list)
    for name in params:
        by_owner[name.rpartition(".")[0]].append(name)
    for owner_name, names in by_owner.items():
        generator = torch.Generator().manual_seed(seed_of(Stream.INIT, seed, zlib.crc32(owner_name.encode())))
        values = initial_values(model, owner_name, names, generator)
        for name in names:
            target = params[name]
            local_part(target).copy_(values[name][local_index(target)])


def initial_values(model: nn.Module, owner_name: str, names: list[str], generator: torch.Generator
                   ) -> dict[str, Tensor]:
    """The full initial tensors (fp32, CPU) of the parameters ``names`` of the module ``owner_name``."""
    owner = model.get_submodule(owner_name)
    shapes = {name: owner.get_parameter(name.rpartition(".")[2]).shape for name in names}
    if owner_name.rsplit(".", 2)[-2:-1] == ["lora_B"]:  # peft: B starts at zero, so the adapted model is the base
        return {name: torch.zeros(shape) for name, shape in shapes.items()}
    if owner_name.rsplit(".", 2)[-2:-1] == ["lora_magnitude_vector"]:  # DoRA: the base's row norms, set once the
        return {name: torch.zeros(shape) for name, shape in shapes.items()}  # base is filled (materialize)
    factor = owner_name.rsplit(".", 1)[-1]
    if factor.startswith(("hada_", "lokr_")):  # LoHa / LoKr: a ParameterDict of the adapters' factors
        if factor in ZERO_FACTORS:
            return {name: torch.zeros(shape) for name, shape in shapes.items()}
        return {name: nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=generator)
                for name, shape in shapes.items()}
    rule = getattr(model, "initial_value", None)
    if rule is not None and not _is_adapter(owner_name + "."):
        values = {name: rule(name, shape, generator) for name, shape in shapes.items()}
        if all(value is not None for value in values.values()):
            return values
    if hasattr(owner, "reset_parameters"):
        return {f"{owner_name}.{attr}".lstrip("."): value
                for attr, value in _reset_twin(owner, generator).items() if f"{owner_name}.{attr}".lstrip(".") in shapes}
    raise ConfigError(f"cannot initialise {names[0]} of {type(model).__name__} without building the whole model: "
                      f"its {type(owner).__name__} has no reset_parameters and the model no initial_value rule for "
                      f"it; start from weights (init_from=, model.pretrained=)")


def _reset_twin(owner: nn.Module, generator: torch.Generator) -> dict[str, Tensor]:
    """``owner.reset_parameters()`` run on a copy holding full fp32 CPU tensors, with the RNG seeded from
    ``generator``: the module's own initialisation, for one module's worth of memory."""
    twin = copy.copy(owner)  # the module's settings (in_features, eps, ...); its parameters replaced below
    twin._parameters = {attr: None if param is None else nn.Parameter(torch.empty(param.shape))
                        for attr, param in owner._parameters.items()}
    twin._modules = {}  # reset_parameters of a leaf module touches its own parameters only
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
        twin.reset_parameters()
    return {attr: param.detach() for attr, param in twin._parameters.items() if param is not None}
