"""Exports that other tools load (issue 38): ``format=diffusers`` writes a whole pipeline folder that
``DiffusionPipeline.from_pretrained`` loads and samples with, its transformers sharded by diffusers' own
``save_pretrained``; ``format=comfyui`` writes a LoRA with the models' original layer names that diffusers' own
readers (``<Pipeline>.lora_state_dict``: the conversions ComfyUI-format LoRAs go through) turn back into exactly the
update ringdit's adapters make, base + (alpha / rank) B A on every adapted layer; bad destinations and bases are refused
in one line with nothing overwritten.

Checkpoints are built in this process (a Lightning checkpoint's layout: ``state_dict`` + ``hyper_parameters``) from
seeded random weights: what is tested is the export, not training."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import architecture, assert_same_numbers, tiny_wan_pipeline

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = (3, 8, 8)  # latents (T, H, W)
TEXT = {"text_len": 7, "text_dim": 16}


def model_config(preset: str, **extra) -> dict:
    """A run's recorded model config for ``preset`` (what a checkpoint's hyper_parameters hold)."""
    from ringdit.commands.cli import model_preset

    config = {**model_preset(preset), "input_size": list(SHAPE), **TEXT, **extra}
    config["in_channels"] = config["config"].get("out_channels") or 4  # the latents' channels
    if "flux" in preset or "qwen" in preset:
        config["input_size"] = list(SHAPE[1:])
    if preset in ("flux_tiny", "flux2_tiny"):  # Flux packs 2x2 latent patches into its input channels, and takes a pooled text
        config |= {"in_channels": config["config"]["in_channels"] // 4,
                   "pooled_dim": config["config"].get("pooled_projection_dim")}
    return config


def save_checkpoint(path, model_cfg: dict, weights: dict, lora: dict | None = None):
    """A ringdit Lightning checkpoint holding ``weights`` (the model's keys) as its raw and EMA weights."""
    state = {f"model.{key}": value for key, value in weights.items()}
    state |= {f"ema.module.{key}": value for key, value in weights.items()}
    hparams = {"model": model_cfg, "ema_decay": 0.999, **({"lora": lora} if lora else {})}
    torch.save({"state_dict": state, "hyper_parameters": hparams}, path)
    return path


def export(capsys, *overrides) -> tuple[int, str, str]:
    from ringdit.export import main

    code = main(list(overrides))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- format=diffusers: a whole pipeline ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    """A tiny two-expert WanPipeline folder (VAE, T5 encoder, word-level tokenizer, UniPC scheduler, two experts) and
    a checkpoint of a run fine-tuned from it, with other (trained) weights than the folder's."""
    import diffusers

    root = tmp_path_factory.mktemp("a14b")
    config = architecture("wan22_a14b_tiny")
    torch.manual_seed(0)
    experts = [diffusers.WanTransformer3DModel.from_config(config) for _ in range(2)]
    pipeline = tiny_wan_pipeline(config, z_dim=4, experts=experts)
    pipeline.save_pretrained(root / "base")
    g = torch.Generator().manual_seed(1)
    trained = {f"{prefix}.{key}": value + 0.01 * torch.randn(value.shape, generator=g)
               for prefix, expert in (("transformer", experts[0]), ("transformer_2", experts[1]))
               for key, value in expert.state_dict().items()}
    model_cfg = model_config("wan22_a14b_tiny", pretrained=str(root / "base"), config=config)
    return {"root": root, "base": root / "base", "trained": trained,
            "ckpt": save_checkpoint(root / "last.ckpt", model_cfg, trained),
            "bare": save_checkpoint(root / "bare.ckpt", {**model_cfg, "pretrained": None}, trained)}


def test_a_pipeline_export_loads_with_diffusers_and_samples(a14b, tmp_path, capsys):
    """The base's components copied, each expert sharded (an index and more than one shard at a small
    max_shard_size) holding exactly the trained weights; DiffusionPipeline.from_pretrained loads it and samples."""
    import diffusers

    out = tmp_path / "pipeline"
    code, stdout, err = export(capsys, f"ckpt_path={a14b['ckpt']}", f"out={out}", "format=diffusers",
                               "max_shard_size=20KB")
    assert code == 0, err
    assert "note:" not in stdout  # a whole pipeline
    assert sorted(p.name for p in out.iterdir()) == ["model_index.json", "scheduler", "text_encoder", "tokenizer",
                                                     "transformer", "transformer_2", "vae"]
    assert json.loads((out / "model_index.json").read_text()) == \
        json.loads((a14b["base"] / "model_index.json").read_text())
    for part in ("transformer", "transformer_2"):
        index = json.loads((out / part / "diffusion_pytorch_model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1  # sharded by save_pretrained
    pipeline = diffusers.DiffusionPipeline.from_pretrained(out)
    assert type(pipeline).__name__ == "WanPipeline" and pipeline.config.boundary_ratio == 0.875
    for part in ("transformer", "transformer_2"):
        loaded = getattr(pipeline, part).state_dict()
        expected = {key[len(part) + 1:]: value for key, value in a14b["trained"].items()
                    if key.startswith(f"{part}.")}
        assert loaded.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key
    torch.manual_seed(0)
    latents = pipeline(prompt="a red fox running", negative_prompt="blue sky", height=16, width=16, num_frames=5,
                       num_inference_steps=2, guidance_scale=4.0, output_type="latent").frames
    assert latents.shape == (1, 4, 2, 2, 2) and torch.isfinite(latents).all()


def test_without_a_pipeline_folder_only_the_transformers_are_written(a14b, tmp_path, capsys):
    """A run built from an architecture preset records no pipeline: the transformer folders, and a note saying why;
    base= makes it a whole pipeline."""
    import diffusers

    out = tmp_path / "transformers"
    code, stdout, err = export(capsys, f"ckpt_path={a14b['bare']}", f"out={out}", "format=diffusers")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["transformer", "transformer_2"]
    assert "note: wrote the transformer folder(s) only (the run recorded no pipeline folder" in stdout
    assert "give base=<the diffusers pipeline folder>" in stdout
    low = diffusers.WanTransformer3DModel.from_pretrained(out, subfolder="transformer_2").state_dict()
    assert all(torch.equal(value, a14b["trained"][f"transformer_2.{key}"]) for key, value in low.items())
    code, stdout, err = export(capsys, f"ckpt_path={a14b['bare']}", f"out={tmp_path / 'whole'}", "format=diffusers",
                               f"base={a14b['base']}")
    assert code == 0 and (tmp_path / "whole" / "vae").is_dir() and "note:" not in stdout, err


# ---- refused: one line, exit 2, nothing overwritten ----------------------------------------------------------------


def test_bad_exports_are_refused_in_one_line_and_overwrite_replaces_whole(a14b, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep me")
    (tmp_path / "taken.safetensors").write_text("keep me too")
    (tmp_path / "not_a_pipeline").mkdir()
    ckpt = a14b["ckpt"]
    for overrides, message in (
        (["format=onnx"], r"format='onnx' is not one of ringdit, diffusers, comfyui"),
        (["format=diffusers", f"out={tmp_path / 'taken'}"],
         r"out=.*taken exists \(a folder\); format=diffusers would replace it: give a new out, or add overwrite=true"),
        ([f"out={tmp_path / 'taken.safetensors'}"], r"out=.*taken.safetensors exists \(a file\)"),
        (["lora=true", f"out={tmp_path / 'taken'}"], r"exists \(a folder\); lora=true would replace"),
        (["format=diffusers", f"out={tmp_path / 'p'}", f"base={tmp_path / 'not_a_pipeline'}"],
         r"base=.*not_a_pipeline is not a diffusers pipeline folder \(no model_index.json\); give base="),
        (["format=diffusers", f"out={tmp_path / 'p'}", f"base={tmp_path / 'missing'}"], r"base=.*missing is not a "
                                                                                           r"folder"),
        (["format=diffusers", f"out={tmp_path / 'p'}", "max_shard_size=big"], r"max_shard_size='big' is not a size"),
        (["format=diffusers", f"out={a14b['base']}", "overwrite=true"], r"is the base pipeline folder itself"),
        ([f"out={a14b['root']}", "format=diffusers", "overwrite=true"], r"holds the checkpoint .*last.ckpt"),
        (["overwrite=yes", f"out={tmp_path / 'x.safetensors'}"], r"overwrite must be true or false, got 'yes'"),
        (["format=comfyui", f"out={tmp_path / 'c'}"], r"the checkpoint holds no LoRA adapter weights"),
        (["lora=true", "format=ringdit"], r"a LoRA adapter exports as format=diffusers .* or format=comfyui"),
    ):
        code, _, err = export(capsys, f"ckpt_path={ckpt}", *overrides)
        lines = [line for line in err.splitlines() if line.startswith("Error: ")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert re.search(message, lines[0]), lines[0]
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep me"
    assert (tmp_path / "taken.safetensors").read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_pipeline", "taken", "taken.safetensors"]
    # overwrite=true replaces the folder whole: nothing of what was there stays
    code, _, err = export(capsys, f"ckpt_path={a14b['bare']}", f"out={tmp_path / 'taken'}", "format=diffusers",
                          "overwrite=true")
    assert code == 0 and sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["transformer", "transformer_2"]


# ---- format=comfyui: LoRA with the original layer names ------------------------------------------------------------

RANK, ALPHA = 4, 6.0  # alpha / rank = 1.5: a scale that is not 1, and not a power of two


def lora_checkpoint(path, preset: str, seed: int = 0, **config_changes):
    """A LoRA run's checkpoint for ``preset`` (default targets, random adapters) and its adapters by the model's keys
    (``transformer.blocks.0.attn1.to_q.lora_A.default.weight``); the model is built on meta (shapes only)."""
    from ringdit.models.lora import add_lora, is_adapter_key
    from ringdit.spec.model import build_on_meta

    model_cfg = model_config(preset)
    model_cfg["config"] = {**model_cfg["config"], **config_changes}
    if "joint_attention_dim" in model_cfg["config"]:  # Flux's and Flux.2's text width, the architecture's
        model_cfg |= {"text_dim": model_cfg["config"]["joint_attention_dim"],
                      "pooled_dim": model_cfg["config"].get("pooled_projection_dim")}
    model = add_lora(build_on_meta(model_cfg), rank=RANK, alpha=ALPHA)
    g = torch.Generator().manual_seed(seed)
    adapters = {key: torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5
                for key, param in model.named_parameters() if is_adapter_key(key)}
    if hasattr(model, "transformer_2"):  # add_lora adapts `transformer` only today: the low-noise expert's, alike
        adapters |= {key.replace("transformer.", "transformer_2.", 1): torch.randn(value.shape, generator=g) /
                     value.shape[-1] ** 0.5 for key, value in adapters.items()}
    return save_checkpoint(path, model_cfg, adapters, lora={"rank": RANK, "alpha": ALPHA}), adapters


def ringdit_updates(adapters: dict, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    """What ringdit's merged model adds to each adapted layer's weight: (alpha / rank) B A, by diffusers' name."""
    updates = {}
    for key, down in adapters.items():
        if key.startswith(prefix) and ".lora_A." in key:
            module = key[len(prefix):key.index(".lora_A.")]
            updates[module] = ALPHA / RANK * adapters[key.replace(".lora_A.", ".lora_B.")].double() @ down.double()
    return updates


def diffusers_updates(converted: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What diffusers adds to each layer on loading ``converted`` (a ``lora_state_dict``): B A, since its LoRA config
    for these files is alpha = rank (the converters fold the file's alpha into A and B); as the factors (B, A)."""
    converted = {key.removeprefix("transformer."): value for key, value in converted.items()}
    assert all(key.endswith((".lora_A.weight", ".lora_B.weight")) for key in converted), sorted(converted)[:4]
    return {key[:-len(".lora_A.weight")]: (converted[key.replace(".lora_A.", ".lora_B.")], value)
            for key, value in converted.items() if key.endswith(".lora_A.weight")}


def assert_same_updates(theirs: dict, ours: dict, where: str) -> float:
    """Every adapted layer gets ringdit's update; any other layer diffusers adapts (a fused layer's part without an
    adapter, Flux's proj_mlp) gets none. Returns the largest difference over the largest update."""
    assert set(ours) <= set(theirs), f"{where}: not read back: {sorted(set(ours) - set(theirs))[:4]}"
    worst = 0.0
    for module, update in theirs.items():
        if isinstance(update, tuple):  # (B, A)
            if module not in ours:  # a part without an adapter: B is zero
                assert not update[0].any(), f"{where} {module}: an update on a layer ringdit did not adapt"
                continue
            update = update[0].double() @ update[1].double()
        expected = ours[module]
        # fp32 adapters, scaled once by alpha / rank (in A or B), multiplied here in fp64: a few fp32 ulps apart
        error = ((update - expected).abs().max() / expected.abs().max()).item()
        assert error < 1e-6, f"{where} {module}: the update differs by {error:.2e} of its largest value"
        worst = max(worst, error)
    return worst


READERS = {"wan": ("wan_tiny", "WanPipeline"), "ltx_video": ("ltx_video_tiny", "LTXPipeline"),
           "qwenimage": ("qwenimage_tiny", "QwenImagePipeline"), "flux": ("flux_tiny", "FluxPipeline")}
# diffusers' Flux reader splits single blocks' linear1 at Flux.1's own widths (3072 x 3 + 12288): Flux is exported at
# its real width (one block of each kind; built on meta, only the adapters hold numbers)
FLUX_WIDTH = {"num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 1, "num_single_layers": 1}


@pytest.mark.parametrize("family", list(READERS))
def test_a_comfyui_lora_read_by_diffusers_is_ringdits_update(family, tmp_path, capsys):
    import diffusers

    preset, reader = READERS[family]
    ckpt, adapters = lora_checkpoint(tmp_path / "lora.ckpt", preset, **(FLUX_WIDTH if family == "flux" else {}))
    code, stdout, err = export(capsys, f"ckpt_path={ckpt}", f"out={tmp_path / 'style'}", "format=comfyui")
    assert code == 0, err
    assert [p.name for p in (tmp_path / "style").iterdir()] == ["style.safetensors"]
    exported = load_file(tmp_path / "style" / "style.safetensors")
    down, up = ("lora_A", "lora_B") if family == "ltx_video" else ("lora_down", "lora_up")
    assert all(key.startswith("diffusion_model.") and key.endswith((f".{down}.weight", f".{up}.weight", ".alpha"))
               for key in exported), sorted(exported)[:4]
    assert not any(key.startswith("diffusion_model.transformer_blocks") for key in exported) or \
        family in ("ltx_video", "qwenimage")  # Flux's are BFL's double_blocks / single_blocks
    converted = getattr(diffusers, reader).lora_state_dict(str(tmp_path / "style" / "style.safetensors"))
    converted = converted[0] if isinstance(converted, tuple) else converted
    worst = assert_same_updates(diffusers_updates(converted), ringdit_updates(adapters), family)
    print(f"{family}: {len(ringdit_updates(adapters))} layers, largest difference {worst:.2e} of the largest update")


def test_two_experts_export_high_and_low_noise_files_that_diffusers_merges(tmp_path, capsys):
    """Wan 2.2 A14B: one file per expert, named as the community's Wan 2.2 LoRAs (<name>_high_noise /
    <name>_low_noise); each, loaded and fused by diffusers into its expert, gives ringdit's merged weights."""
    import diffusers

    ckpt, adapters = lora_checkpoint(tmp_path / "lora.ckpt", "wan22_a14b_tiny", seed=3)
    code, _, err = export(capsys, f"ckpt_path={ckpt}", f"out={tmp_path / 'motion'}", "format=comfyui")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "motion").iterdir()) == ["motion_high_noise.safetensors",
                                                                      "motion_low_noise.safetensors"]
    for prefix, name in (("transformer.", "high_noise"), ("transformer_2.", "low_noise")):
        torch.manual_seed(0)
        expert = diffusers.WanTransformer3DModel.from_config(architecture("wan22_a14b_tiny"))
        base = {key: value.clone() for key, value in expert.state_dict().items()}
        converted = diffusers.WanPipeline.lora_state_dict(str(tmp_path / "motion" / f"motion_{name}.safetensors"))
        expert.load_lora_adapter(converted, prefix="transformer", adapter_name="ours")
        expert.fuse_lora(adapter_names=["ours"])
        expert.unload_lora()
        merged, updates = expert.state_dict(), ringdit_updates(adapters, prefix)
        assert updates
        for key, value in base.items():  # ringdit's merged model: base + (alpha / rank) B A, the rest as it was
            module = key.removesuffix(".weight")
            expected = value.double() + updates[module] if module in updates else value.double()
            assert_same_numbers(merged[key].double(), expected, of_max=1e-6, atol=1e-7, where=f"{name} {key}")


# HunyuanVideo 1.5: diffusers has no LoRA reader for it (HunyuanVideo15Pipeline loads no LoRA). The file is read back
# here as ComfyUI reads a LoRA -- layer += (alpha / rank) up @ down -- with the names of diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py, which splits the token refiner's fused self_attn_qkv in thirds.
HUNYUAN_NAMES = [  # (original layer, diffusers layers it holds, in its row order)
    (r"double_blocks\.(\d+)\.img_attn_([qkv])", lambda m: [f"transformer_blocks.{m[1]}.attn.to_{m[2]}"]),
    (r"double_blocks\.(\d+)\.img_attn_proj", lambda m: [f"transformer_blocks.{m[1]}.attn.to_out.0"]),
    (r"txt_in\.individual_token_refiner\.blocks\.(\d+)\.self_attn_qkv",
     lambda m: [f"context_embedder.token_refiner.refiner_blocks.{m[1]}.attn.to_{x}" for x in "qkv"]),
    (r"txt_in\.individual_token_refiner\.blocks\.(\d+)\.self_attn_proj",
     lambda m: [f"context_embedder.token_refiner.refiner_blocks.{m[1]}.attn.to_out.0"]),
]


def test_hunyuan_video15_comfyui_lora_is_ringdits_update(tmp_path, capsys):
    ckpt, adapters = lora_checkpoint(tmp_path / "lora.ckpt", "hunyuan_video15_tiny")
    code, _, err = export(capsys, f"ckpt_path={ckpt}", f"out={tmp_path / 'hy'}", "format=comfyui")
    assert code == 0, err
    exported = load_file(tmp_path / "hy" / "hy.safetensors")
    updates = {}
    for key in exported:
        if not key.endswith(".lora_down.weight"):
            continue
        layer = key[len("diffusion_model."):-len(".lora_down.weight")]
        down, up = exported[key].double(), exported[key.replace("lora_down", "lora_up")].double()
        whole = exported[key.replace("lora_down.weight", "alpha")].item() / down.shape[0] * up @ down
        parts = next(names(match) for pattern, names in HUNYUAN_NAMES if (match := re.fullmatch(pattern, layer)))
        for module, rows in zip(parts, whole.chunk(len(parts))):
            updates[module] = rows
    ours = ringdit_updates(adapters)
    assert any("token_refiner" in module for module in ours)  # the fused layer is exercised
    assert_same_updates(updates, ours, "hunyuan_video15")


def test_comfyui_refuses_what_it_cannot_name(tmp_path, capsys):
    """A family without ComfyUI names (Flux.2) and a layer ringdit has no original name for: one line each."""
    ckpt, _ = lora_checkpoint(tmp_path / "flux2.ckpt", "flux2_tiny")
    code, _, err = export(capsys, f"ckpt_path={ckpt}", f"out={tmp_path / 'a'}", "format=comfyui")
    assert code == 2 and "format=comfyui has no layer names for model.family=flux2" in err, err
    from ringdit.checkpoints.lora_formats import original_layer
    from ringdit.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"the adapter on patch_embedding has no ComfyUI name for model.family=wan"):
        original_layer("wan", "patch_embedding")
