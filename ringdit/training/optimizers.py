"""Optimizers ringdit adds to torch's: AdamW with 8-bit states (``optimizer=adamw8bit``).

AdamW keeps two fp32 moments per trained weight: 8 bytes, twice the weight itself. ``adamw8bit`` keeps them in 8
bits with one fp32 scale per block of 256 values (about 2.03 bytes for both), through torchao's low-bit optimizers
(``torchao.optim.AdamW8bit``: blockwise dynamic quantization as bitsandbytes' and Dettmers et al. 2022). torchao,
not bitsandbytes: it runs on CPU and CUDA alike and on FSDP2's DTensors (its states are tensor subclasses that
DTensor shards like the parameter); bitsandbytes' 8-bit step is a custom op that DTensor refuses ("got mixed
torch.Tensor and DTensor"). A tensor smaller than 4096 values, or not a multiple of the block, keeps fp32 states
(torchao's rule): a tiny model saves little. Each parameter shape compiles its step once (torch.compile) on the first
step of a process: seconds per shape on a CPU.

Checkpoints hold the moments dequantized to plain fp32 tensors (``state_dict``) and quantize them again on loading
(``load_state_dict``; exact: a block's largest value defines its scale and maps to code 1.0 again), so a checkpoint
needs no torchao to read, resumes under any layout (DDP files, FSDP's resharded folders) and loads with
``torch.load(weights_only=True)``.

Install: ``pip install 'ringdit[lowbit]'`` (torchao). Without it ``optimizer=adamw8bit`` is refused before any
process starts (``check_optimizer_installed``).
"""

from __future__ import annotations

import importlib.util

import torch

from ringdit.common.errors import ConfigError

Tensor = torch.Tensor

# the optimizers here, by _target_, and the package each needs
LIBRARIES = {"ringdit.training.optimizers.adamw8bit": "torchao"}
# the optimizers conf/optimizer/ holds, by _target_: their states per trainable parameter (None: SGD's, 1 with
# momentum, else 0) and whether those are 8-bit -- what the memory estimate and the planner count
STATES = {"torch.optim.AdamW": (2, False), "ringdit.training.optimizers.adamw8bit": (2, True), "torch.optim.SGD": None}


def optimizer_states(optimizer: dict) -> tuple[int, bool] | None:
    """(states per trainable parameter, whether 8-bit) of the optimizer config ``optimizer`` (``_target_`` and its
    settings); None for an optimizer not in ``STATES``."""
    target = optimizer.get("_target_")
    if target not in STATES:
        return None
    return STATES[target] or ((1 if optimizer.get("momentum", 0) else 0), False)
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def library_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # sys.modules[name] is None: imports of it are blocked
        return False


def check_optimizer_installed(target: str | None) -> None:
    """A ConfigError when ``optimizer._target_`` is one of ours whose library is missing."""
    library = LIBRARIES.get(target or "")
    if library is not None and not library_installed(library):
        raise ConfigError(f"optimizer={target.rsplit('.', 1)[-1].lower()} needs {library}, which is not installed; "
                          f"pip install 'ringdit[lowbit]' (or {library}), or use optimizer=adamw")


def adamw8bit(params, **settings) -> torch.optim.Optimizer:
    """``torchao.optim.AdamW8bit`` whose checkpoints hold plain fp32 moments (the module docstring says why).
    ``settings``: torchao's (``lr``, ``betas``, ``eps``, ``weight_decay``, ``block_size`` ...)."""
    import torch._functorch.config
    from torchao.optim import AdamW8bit

    # AOT autograd's on-disk cache keys torchao's 8-bit state (a tensor subclass) without its inner scales' size, so
    # an FSDP shard can get a graph compiled for another shard shape ("expected size 16==128"); the FX graph cache is
    # keyed correctly and stays on
    torch._functorch.config.enable_autograd_cache = False
    if AdamW8bit not in _resumable:
        _resumable[AdamW8bit] = type("ResumableAdamW8bit", (AdamW8bit,), {
            "state_dict": _state_dict, "load_state_dict": _load_state_dict, "__module__": __name__})
    if "betas" in settings:  # Hydra hands a ListConfig, which torchao keeps in the param groups: a checkpoint
        settings["betas"] = tuple(settings["betas"])  # holding it would not load as plain weights
    return _resumable[AdamW8bit](params, **settings)


_resumable: dict[type, type] = {}  # torchao's class -> ours, made once


def _state_dict(self) -> dict:
    state = super(type(self), self).state_dict()
    state["state"] = {index: {key: _dequantized(value) if key in MOMENTS else value for key, value in entry.items()}
                      for index, entry in state["state"].items()}
    return state


def _load_state_dict(self, state_dict: dict) -> None:
    super(type(self), self).load_state_dict(state_dict)  # the moments come back as plain fp32 tensors
    with torch.no_grad():
        for param, entry in self.state.items():
            for key in MOMENTS:
                if key in entry and not _is_quantized(entry[key]):
                    quantized = self._new_buffer(param, key == "exp_avg")  # signed: the first moment
                    _local(quantized).copy_(_local(entry[key]))  # quantizes (or copies where torchao keeps fp32)
                    entry[key] = quantized


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _is_quantized(tensor: Tensor) -> bool:
    from torchao.optim.subclass_8bit import OptimState8bit

    return isinstance(_local(tensor), OptimState8bit)


def _dequantized(tensor: Tensor) -> Tensor:
    """A plain fp32 tensor (a DTensor of them, placed as ``tensor``) with the values of an 8-bit state."""
    local = _local(tensor)
    if not _is_quantized(tensor):
        return tensor
    plain = local.dequantize()
    if local is tensor:
        return plain
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(plain, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
                              stride=tensor.stride())
