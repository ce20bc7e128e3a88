"""Each family's ``ParallelPlan`` against the ``_cp_plan`` its diffusers class declares (issue 58: the kind record owns
its plan, read from diffusers' ``_cp_plan`` where the class declares one, or a test that they agree).

Both say where the sequence is cut and where the prediction is gathered. They agree on every gather and on every cut
of the tokens ringdit splits; where they differ, it is by design and listed below with the reason:

- ringdit keeps the **text** whole on every rank (joint attention joins it to each rank's tokens; the ring and
  Ulysses passes carry only the image / video tokens), where diffusers cuts it with the tokens;
- a few families cut **positions** at their input (the coordinates) rather than at the rotary module's output, and
  cut a **per-token timestep** that diffusers' plan leaves whole (its pipelines give one timestep per sample there).
"""

from __future__ import annotations

import inspect

import diffusers
import pytest
import torch
from diffusers.models._modeling_parallel import ContextParallelOutput

from ringdit.commands.cli import CONF_DIR, model_preset
from ringdit.models.diffusers.families import FAMILIES

# the text stream's inputs, which ringdit keeps whole on every rank
TEXT_INPUTS = {"encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_mask", "txt_ids"}
# diffusers' entries ringdit has in another form, and ringdit's entries diffusers has not: (family, kind, module, key)
OTHER_FORM = {
    # LTX-Video / LTX-2: the per-token timestep (image-to-video conditioning, LTX-2's audio-video) is cut with its tokens
    ("ltx_video", "input", "", "timestep"),
    ("ltx2", "input", "", "timestep"),
    # LTX-2 cuts the video's coordinates at the model's input; the rotary module then computes each rank's own
    ("ltx2", "input", "", "video_coords"),
    ("ltx2", "output", "rope", 0),
    ("ltx2", "output", "rope", 1),
    # LTX-2's audio: a stream of its own that ringdit cuts over the ranks too (diffusers' plan leaves it whole on
    # every rank), so gathered where it is predicted
    ("ltx2", "gather", "audio_proj_out", None),
    # Qwen-Image: the rotary module's second output is the text's rotations (the text stays whole); its forward gets no
    # modulate_index (only the edit models' zero_cond_t passes one, and the edit family cuts it)
    ("qwenimage", "input", "transformer_blocks.*", "modulate_index"),
    ("qwenimage", "output", "pos_embed", 1),
    ("qwenimage_edit", "output", "pos_embed", 1),
}


def _tiny_preset(family: str) -> str | None:
    name = f"{family}_tiny"
    return name if (CONF_DIR / "model" / f"{name}.yaml").is_file() else None


def _declaring_families() -> list[str]:
    return [name for name, family in FAMILIES.items()
            if getattr(getattr(diffusers, family.model_class), "_cp_plan", None) and _tiny_preset(name)]


def _meta_model(name: str) -> torch.nn.Module:
    config = dict(model_preset(_tiny_preset(name))["config"])
    with torch.device("meta"):
        return getattr(diffusers, FAMILIES[name].model_class)(**config)


def _input_name(model: torch.nn.Module, path: str, key):
    """A module input's keyword name (a positional index read from its forward's signature)."""
    if isinstance(key, str):
        return key
    module = model.get_submodule(path.replace("*", "0")) if path else model
    return list(inspect.signature(module.forward).parameters)[key]


def _ours(name: str, model) -> tuple[dict, dict]:
    """The family's plan as {(kind, module, key): dim} cuts and {module: dim} gathers."""
    plan = FAMILIES[name].plan
    cuts = {}
    for path, inputs in plan.split_inputs.items():
        for key, dim in inputs.items():
            cuts[("input", path, _input_name(model, path, key))] = dim
    for path, outputs in plan.split_outputs.items():
        for key, dim in outputs.items():
            cuts[("output", path, key)] = dim
    gathers = {path: dims[None] for path, dims in plan.gather_outputs.items()}
    for stream in plan.streams.values():
        gathers.update({path: dims[None] for path, dims in stream.gather.items()})
    return cuts, gathers


def _diffusers(name: str, model) -> tuple[dict, dict]:
    """The class's ``_cp_plan`` as {(kind, module, key): (dim, the tensor's dims)} cuts and {module: dim} gathers."""
    cuts, gathers = {}, {}
    for path, entry in type(model)._cp_plan.items():
        if isinstance(entry, ContextParallelOutput):
            gathers[path] = entry.gather_dim
            continue
        for key, cut in entry.items():
            kind = "output" if cut.split_output else "input"
            cuts[(kind, path, key if cut.split_output else _input_name(model, path, key))] = (cut.split_dim,
                                                                                             cut.expected_dims)
    return cuts, gathers


@pytest.mark.parametrize("name", _declaring_families())
def test_the_plan_agrees_with_diffusers_cp_plan(name):
    model = _meta_model(name)
    ours, our_gathers = _ours(name, model)
    theirs, their_gathers = _diffusers(name, model)

    our_gathers = {path: dim for path, dim in our_gathers.items() if (name, "gather", path, None) not in OTHER_FORM}
    assert our_gathers == their_gathers, f"{name}: gathered at {our_gathers}, diffusers at {their_gathers}"
    for (kind, path, key), (dim, dims) in theirs.items():
        if kind == "input" and key in TEXT_INPUTS or (name, kind, path, key) in OTHER_FORM:
            assert (kind, path, key) not in ours or key not in TEXT_INPUTS, f"{name}: the text is cut at {path}"
            continue
        assert (kind, path, key) in ours, f"{name}: diffusers cuts {kind} {key!r} of {path!r}; the plan does not"
        assert ours[(kind, path, key)] % dims == dim, f"{name}: {kind} {key!r} of {path!r} cut along another dim"
    extra = {entry for entry in ours if entry not in theirs and (name, *entry) not in OTHER_FORM}
    assert not extra, f"{name}: the plan cuts {extra}, which diffusers' _cp_plan does not (list why in OTHER_FORM)"


def test_the_check_covers_the_families_that_declare_a_plan():
    """Every family whose class declares a ``_cp_plan`` is compared (a tiny preset each); the others' plans are
    proven against the unmodified models in their own tests."""
    declaring = {name for name, family in FAMILIES.items()
                 if getattr(getattr(diffusers, family.model_class), "_cp_plan", None)}
    assert declaring == set(_declaring_families()) and len(declaring) >= 8
