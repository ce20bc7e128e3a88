"""Optimizer state keyed two ways, and converted either way.

torch's ``Optimizer.state_dict`` numbers the parameters in param_groups order (0, 1, ...);
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (FSDP checkpoints) names them by their module
path. The param_groups' ``params`` lists give the order either way, so a checkpoint saved under one strategy
resumes under the other.
"""

from __future__ import annotations


def optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """torch's numbered optimizer state -> named; ``names[i]`` is the module path of the optimizer's i-th parameter."""
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                         for group in state["param_groups"]],
    }


def optimizer_state_by_index(state: dict) -> dict:
    """Named optimizer state -> torch's numbered one (parameters numbered in param_groups order)."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state.get("state", {}).items()},  # none saved: no state
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in state["param_groups"]],
    }
