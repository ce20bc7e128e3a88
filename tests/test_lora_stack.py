"""LoRA files applied at sampling (``infer.py lora=[{path, strength}, ...]``): diffusers / ringdit exports, peft's and
ComfyUI's files (the models' original layer names, fused layers split back into their parts) are read onto the
model's layers and stacked, each at its strength; the stacked model computes as the base whose weights hold the sum
of the strength-scaled updates, W + sum_i s_i (alpha_i / r_i) B_i A_i (written out here from LoRA's definition), in
fp64. infer.py refuses, in one line before anything starts, a missing file, a strength that is not a number, and a
LoRA of another model; its advice, followed, samples."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ringdit.checkpoints.lora_formats import comfyui_lora, lora_file_entries, read_lora_file, read_lora_stack
from ringdit.models.lora import adapted_modules, add_lora, export_lora, stack_adapters
from tests.helpers import architecture, assert_refused, assert_same_numbers, fail_fast, run, tiny_dit

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def random_lowrank(model, rank: int, targets, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """fp64 (A, B) for each Linear of ``model`` whose name ends with one of ``targets``, by module name."""
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(rank, layer.in_features, generator=g, dtype=torch.float64) / layer.in_features ** 0.5,
                   torch.randn(layer.out_features, rank, generator=g, dtype=torch.float64) / rank)
            for name, layer in model.named_modules()
            if isinstance(layer, torch.nn.Linear) and name.endswith(tuple(targets))}


def merged_copy(model, updates: list[tuple[dict, float]]):
    """``model`` with every update fused into its weights: W + sum_i scale_i B_i A_i (LoRA's definition)."""
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for layers, scale in updates:
            for name, (down, up) in layers.items():
                merged.get_submodule(name).weight += scale * up @ down
    return merged


def diffusers_file(layers, alpha, path, prefix="transformer."):
    """``layers`` as diffusers' LoRA file (alpha in lora_adapter_metadata, as diffusers and ringdit write it)."""
    tensors = {f"{prefix}{name}.lora_A.weight": down for name, (down, up) in layers.items()}
    tensors |= {f"{prefix}{name}.lora_B.weight": up for name, (down, up) in layers.items()}
    save_file(tensors, str(path), metadata={"format": "pt", "lora_adapter_metadata": json.dumps(
        {"transformer.lora_alpha": alpha, "transformer.r": next(iter(layers.values()))[0].shape[0]})})
    return path


def peft_folder(layers, rank, alpha, folder):
    """``layers`` as peft's ``save_pretrained`` writes an adapter: adapter_model.safetensors (keys
    ``base_model.model.<module>.lora_A.weight``) and adapter_config.json."""
    folder.mkdir()
    tensors = {f"base_model.model.{name}.lora_A.weight": down for name, (down, up) in layers.items()}
    tensors |= {f"base_model.model.{name}.lora_B.weight": up for name, (down, up) in layers.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha}))
    return folder


def stacked(model, entries):
    """A copy of ``model`` with ``entries`` (infer.py's lora setting) read, checked and stacked on it."""
    model = copy.deepcopy(model)
    files = lora_file_entries(entries, model)
    stack_adapters(adapted_modules(model), read_lora_stack(files, model))
    return model


def test_stacked_dit_adapters_compute_as_the_merged_sum(tmp_path):
    """A ringdit LoRA export (the folder) and a peft adapter folder on a DiT, at strengths 0.5 and -1.25."""
    model = tiny_dit().double().eval()
    first = random_lowrank(model, 4, ["qkv", "attn.proj"], seed=1)  # the attention's
    second = random_lowrank(model, 2, ["fc1", "qkv"], seed=2)  # another rank, partly the same layers
    state = {f"{name}.lora_{part}.default.weight": value for name, (down, up) in first.items()
             for part, value in (("A", down), ("B", up))}  # a LoRA checkpoint's adapter keys
    export_lora(state, {"alpha": 6}, tmp_path / "ringdit")  # what python -m ringdit.export lora=true writes
    peft_folder(second, rank=2, alpha=3, folder=tmp_path / "peft")
    ours = stacked(model, [{"path": str(tmp_path / "ringdit"), "strength": 0.5},
                           {"path": str(tmp_path / "peft"), "strength": -1.25}])
    reference = merged_copy(model, [(first, 0.5 * 6 / 4), (second, -1.25 * 3 / 2)])
    g = torch.Generator().manual_seed(3)
    x, t, y = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64), torch.tensor([30.0, 810.0]), \
        torch.tensor([1, 5])
    with torch.no_grad():
        got, expected, base = ours(x, t, y), reference(x, t, y), model(x, t, y)
    assert_same_numbers(got, expected, of_max=1e-12, where="stacked LoRA files vs the merged sum")
    assert (got - base).abs().max() > 1e-2  # the adapters matter


def test_stacked_wan_adapters_diffusers_and_comfyui_compute_as_the_merged_sum(tmp_path):
    """A diffusers LoRA file and a ComfyUI one (Wan's original names: self_attn.q, ffn.0, head.head, ...) on a Wan,
    stacked on a layer that already carries a trained adapter (an adapter-only checkpoint being sampled)."""
    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(0)
    model = DiffusersTransformer("wan", config=architecture("wan_tiny"), input_size=(2, 8, 8), in_channels=4,
                                 text_len=7, text_dim=16).double().eval()
    transformer = model.transformer
    first = random_lowrank(transformer, 4, ["to_q", "to_v"], seed=1)
    second = random_lowrank(transformer, 3, ["attn1.to_q", "ffn.net.0.proj", "ffn.net.2", "proj_out"], seed=2)
    diffusers_file(first, 8, tmp_path / "style.safetensors")
    out_features = {name: layer.out_features for name, layer in transformer.named_modules()
                    if isinstance(layer, torch.nn.Linear)}
    adapters = {f"{name}.lora_A.weight": down for name, (down, up) in second.items()}
    adapters |= {f"{name}.lora_B.weight": up for name, (down, up) in second.items()}
    comfy = comfyui_lora(adapters, 0.75, "wan", out_features)
    assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in comfy and \
        "diffusion_model.head.head.lora_up.weight" in comfy
    save_file(comfy, str(tmp_path / "comfy.safetensors"))
    entries = [{"path": str(tmp_path / "style.safetensors"), "strength": 0.8},
               {"path": str(tmp_path / "comfy.safetensors"), "strength": 1.5}]
    ours = stacked(model, entries)
    reference = merged_copy(transformer, [(first, 0.8 * 8 / 4), (second, 1.5 * 0.75)])
    g = torch.Generator().manual_seed(3)
    x, t, text = torch.randn(2, 4, 2, 8, 8, generator=g, dtype=torch.float64), torch.tensor([30.0, 810.0]), \
        torch.randn(2, 7, 16, generator=g, dtype=torch.float64)
    with torch.no_grad():
        got = ours(x, t, {"text": text})
        expected = reference(x, t, text, return_dict=False)[0]
    assert_same_numbers(got, expected, of_max=1e-12, where="stacked diffusers + ComfyUI files vs the merged sum")

    # on a model whose to_q already carries a (zero-initialised) peft adapter: the files go on top of it
    adapted = add_lora(copy.deepcopy(model), rank=2, alpha=2, targets=["to_q"])
    with torch.no_grad():
        assert_same_numbers(stacked(adapted, entries)(x, t, {"text": text}), expected, of_max=1e-12,
                            where="stacked on a peft-adapted model")


def test_a_two_expert_export_folder_stacks_each_experts_file_on_its_expert(tmp_path):
    """Wan 2.2 A14B: a ringdit LoRA export folder (the high-noise expert's file, transformer_2/ the low-noise one's)
    adapts each expert with its own file; path_2 gives the second expert's file apart."""
    from ringdit.models.build import build_model
    from ringdit.commands.cli import model_preset

    config = {**model_preset("wan22_a14b_tiny"), "input_size": [2, 8, 8], "in_channels": 4, "text_len": 7,
              "text_dim": 16}
    config["in_channels"] = config["config"].get("in_channels") or 4
    model, _ = build_model(config)
    model.double()
    high = random_lowrank(model.transformer, 2, ["attn1.to_q"], seed=1)
    low = random_lowrank(model.transformer_2, 2, ["attn1.to_v"], seed=2)
    (tmp_path / "adapter" / "transformer_2").mkdir(parents=True)
    diffusers_file(high, 4, tmp_path / "adapter" / "pytorch_lora_weights.safetensors")
    diffusers_file(low, 2, tmp_path / "adapter" / "transformer_2" / "pytorch_lora_weights.safetensors")
    g = torch.Generator().manual_seed(3)
    x, t, text = torch.randn(2, config["in_channels"], 2, 8, 8, generator=g, dtype=torch.float64), \
        torch.tensor([30.0, 810.0]), torch.randn(2, 7, 16, generator=g, dtype=torch.float64)
    expected = [merged_copy(model.transformer, [(high, 0.5 * 4 / 2)]), merged_copy(model.transformer_2, [(low, 0.5)])]
    for entry in ({"path": str(tmp_path / "adapter"), "strength": 0.5},
                  {"path": str(tmp_path / "adapter" / "pytorch_lora_weights.safetensors"), "strength": 0.5,
                   "path_2": str(tmp_path / "adapter" / "transformer_2" / "pytorch_lora_weights.safetensors")}):
        ours = stacked(model, [entry])
        with torch.no_grad():
            for expert, reference in zip((ours.transformer, ours.transformer_2), expected):
                assert_same_numbers(expert(x, t, text, return_dict=False)[0],
                                    reference(x, t, text, return_dict=False)[0], of_max=1e-12, where=str(entry))


@pytest.mark.parametrize("family, preset", [("flux", "flux_tiny"), ("hunyuan_video15", "hunyuan_video15_tiny")])
def test_a_comfyui_file_with_fused_layers_reads_back_as_each_parts_update(family, preset, tmp_path):
    """Flux's img_attn.qkv / single blocks' linear1 and HunyuanVideo 1.5's token refiner qkv are one layer in the
    original: their adapter is split back into each diffusers part's rows, giving each part its own update."""
    import diffusers

    from ringdit.models.diffusers import get_family

    torch.manual_seed(0)
    with torch.device("meta"):  # the layers' names and sizes are all the reader needs
        transformer = getattr(diffusers, get_family(family).model_class).from_config(architecture(preset))
    linears = {name: layer for name, layer in transformer.named_modules() if isinstance(layer, torch.nn.Linear)}
    layers = random_lowrank(transformer, 2, [name for name in linears if "attn" in name or "proj_mlp" in name],
                            seed=4)
    adapters = {f"{name}.lora_A.weight": down for name, (down, up) in layers.items()}
    adapters |= {f"{name}.lora_B.weight": up for name, (down, up) in layers.items()}
    comfy = comfyui_lora(adapters, 1.5, family, {name: layer.out_features for name, layer in linears.items()})
    fused = [key for key in comfy if "qkv" in key or "linear1" in key]
    assert fused, sorted(comfy)[:6]
    save_file(comfy, str(tmp_path / "comfy.safetensors"))
    read = read_lora_file(tmp_path / "comfy.safetensors", transformer, family, "lora[0].path")
    assert set(layers) <= set(read)
    for name, (down, up, scale) in read.items():
        if name not in layers:  # a fused layer's part without an adapter: no update
            assert not up.any(), name
            continue
        expected = 1.5 * layers[name][1] @ layers[name][0]
        assert_same_numbers(scale * up.double() @ down.double(), expected, of_max=1e-12, where=name)


# ---- infer.py lora=[...] -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dit_lora(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint's DiT as an export whose zero-initialised weights (adaLN-Zero's modulation, the final layer:
    one step from zero they would hide what the blocks do) have trained-looking values (base.safetensors), a LoRA
    file for it (rank 4, alpha 8, random adapters) and the base with that adapter fused at strength 0.5, written
    here from LoRA's definition (merged.safetensors)."""
    import hydra

    from ringdit.checkpoints.weights import read_weights

    root = tmp_path_factory.mktemp("dit_lora")
    state, info = read_weights(tiny_checkpoint)
    g = torch.Generator().manual_seed(0)
    state = {key: value + 0.05 * torch.randn(value.shape, generator=g) if value.abs().max() < 0.01 else value
             for key, value in state.items()}
    configs = {key: json.dumps(info[key]) for key in ("model", "data", "objective", "sampling")}
    save_file(state, str(root / "base.safetensors"), metadata=configs)
    model = hydra.utils.instantiate(info["model"])
    layers = {name: (down.float(), up.float() * 20) for name, (down, up) in
              random_lowrank(model, 4, ["qkv", "fc1"], seed=5).items()}
    diffusers_file(layers, 8, root / "adapter.safetensors")
    merged = dict(state)
    for name, (down, up) in layers.items():
        merged[f"{name}.weight"] = state[f"{name}.weight"] + 0.5 * 8 / 4 * up @ down
    save_file(merged, str(root / "merged.safetensors"), metadata=configs)
    return root


def sample(run_dir, ckpt, *overrides):
    run("infer.py", run_dir, f"ckpt_path={ckpt}", "num_samples=4", "diffusion.sampling.steps=4", *overrides)
    return np.load(run_dir / "samples.npz")["images"].astype(np.int64)


def test_infer_stacks_a_lora_file_as_its_merged_model_samples(dit_lora, tmp_path):
    """infer.py lora=[{path, strength: 0.5}] samples the images of the model with 0.5 of the update fused in: at most
    one grey level apart (fp32 sums in another order), and other images than the base's."""
    ours = sample(tmp_path / "stacked", dit_lora / "base.safetensors",
                  f"lora=[{{path: {dit_lora / 'adapter.safetensors'}, strength: 0.5}}]")
    merged = sample(tmp_path / "merged", dit_lora / "merged.safetensors")
    difference = np.abs(ours - merged)
    assert difference.max() <= 1 and (difference > 0).mean() < 0.01, (difference.max(), (difference > 0).mean())
    assert np.abs(ours - sample(tmp_path / "base", dit_lora / "base.safetensors")).mean() > 1.0


def test_bad_lora_files_and_strengths_are_refused_in_one_line(dit_lora, tmp_path):
    """A missing file, a strength that is not a number, a LoRA of another model (its layers' sizes, or names the
    model does not have): one line naming the entry, before anything starts."""
    import diffusers

    adapter = dit_lora / "adapter.safetensors"
    wider = random_lowrank(tiny_dit(hidden_size=48), 4, ["qkv"], seed=6)  # the same names, another width
    diffusers_file(wider, 4, tmp_path / "wider.safetensors")
    wan = random_lowrank(diffusers.WanTransformer3DModel.from_config(architecture("wan_tiny")), 2, ["to_q"], seed=7)
    diffusers_file(wan, 2, tmp_path / "wan.safetensors")
    cases = {
        f"[{{path: {tmp_path / 'gone.safetensors'}, strength: 0.5}}]":
            f"lora[0].path={tmp_path / 'gone.safetensors'} does not exist",
        f"[{{path: {adapter}, strength: nan}}]": "lora[0].strength must be a finite number, got nan",
        f"[{{path: {adapter}}}, {{path: {adapter}, strength: strong}}]":
            "lora[1].strength must be a finite number, got 'strong'",
        f"[{{path: {tmp_path / 'wider.safetensors'}}}]":
            f"lora[0].path={tmp_path / 'wider.safetensors'}: its adapter of 'blocks.0.attn.qkv' has lora_A (4, 48)",
        f"[{{path: {tmp_path / 'wan.safetensors'}}}]":
            f"lora[0].path={tmp_path / 'wan.safetensors'} adapts 'blocks.0.attn1.to_q', which is no linear layer",
    }
    for value, text in cases.items():
        proc, seconds = fail_fast("infer.py", f"ckpt_path={dit_lora / 'base.safetensors'}", f"lora={value}",
                                  f"hydra.run.dir={tmp_path / 'refused'}")
        assert_refused(proc, text=text, seconds=seconds)
        assert not (tmp_path / "refused" / "samples.npz").exists()
