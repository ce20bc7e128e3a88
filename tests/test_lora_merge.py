"""``python -m ringdit.export ... lora=true merge=true``: a LoRA run's base with its adapter fused in at
``merge_strength``, written as a whole model (format=ringdit: one .safetensors; format=diffusers: a transformer /
pipeline folder). The fused model computes as the adapted one (peft's unmerged forward, its scale times the
strength) in fp64, for a DiT and a diffusers family; bad settings and bases are refused in one line with nothing
written, and each refusal's advice, followed, exports.

Checkpoints are built in this process (a Lightning checkpoint's layout) from seeded random fp64 weights: what is
tested is the merge, not training."""

from __future__ import annotations

import copy
import json
import os

import hydra
import pytest
import torch
from safetensors.torch import load_file, save_file

from ringdit.checkpoints.weights import read_weights
from ringdit.commands.cli import model_preset
from ringdit.common.dtypes import default_dtype
from ringdit.models.lora import add_lora, is_adapter_key, load_adapter
from tests.helpers import assert_same_numbers, save_tiny_wan

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RANK, ALPHA = 4, 6.0  # alpha / rank = 1.5


def float64():
    """Models built and exported in fp64 (the export keeps the dtype the model holds its weights in)."""
    return default_dtype(torch.float64)


def lightning_checkpoint(path, hparams: dict, weights: dict):
    """A ringdit Lightning checkpoint holding ``weights`` as its raw and EMA weights."""
    state = {f"{prefix}{key}": value for key, value in weights.items() for prefix in ("model.", "ema.module.")}
    torch.save({"state_dict": state, "hyper_parameters": {"ema_decay": 0.999, **hparams}}, path)
    return path


def random_adapters(adapted, seed: int) -> dict[str, torch.Tensor]:
    """Trained-looking adapters: random A and B (LoHa's and LoKr's factors larger: their update is a product of
    four, or of two Kronecker factors), and DoRA's magnitudes each row's own times 1 +- 0.2."""
    g = torch.Generator().manual_seed(seed)
    return {key: param.detach() * (1 + 0.2 * torch.randn(param.shape, generator=g, dtype=param.dtype))
            if ".lora_magnitude_vector." in key else (0.2 if ".lora_" in key else 0.7) *
            torch.randn(param.shape, generator=g, dtype=param.dtype)
            for key, param in adapted.named_parameters() if is_adapter_key(key)}


def export(capsys, *overrides) -> tuple[int, str, str]:
    from ringdit.export import main

    code = main(list(overrides))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


DIT = {"input_size": 8, "in_channels": 3, "hidden_size": 32, "depth": 2, "num_heads": 4, "num_classes": 10}


@pytest.fixture(scope="module", params=["lora", "dora", "loha", "lokr"])
def dit_run(request, tmp_path_factory):
    """A DiT LoRA run's checkpoint (adapters only; lora.type=lora, dora: DoRA's magnitudes too, loha or lokr: peft's
    LyCORIS factors) on its base (init_from, a ringdit export), fp64."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"dit_merge_{kind}")
    config = {**model_preset("dit"), **DIT}
    with float64():
        torch.manual_seed(0)
        base = hydra.utils.instantiate(config)
        with torch.no_grad():  # adaLN-Zero's zeros would hide what the adapted blocks do
            for param in base.parameters():
                param.add_(0.05 * torch.randn_like(param))
        save_file({key: value.contiguous() for key, value in base.state_dict().items()},
                  str(root / "base.safetensors"), metadata={"model": json.dumps(config)})
        adapted = add_lora(copy.deepcopy(base), rank=RANK, alpha=ALPHA, type=kind)
        adapters = random_adapters(adapted, seed=1)
    lora = {"rank": RANK, "alpha": ALPHA, "base_dtype": "float32", "type": kind}  # as a CPU run records it
    ckpt = lightning_checkpoint(root / "lora.ckpt", {"model": config, "lora": lora,
                                                     "init_from": str(root / "base.safetensors")}, adapters)
    load_adapter(adapted, adapters)
    return root, ckpt, base.eval(), adapted.eval()


def dit_output(model):
    g = torch.Generator().manual_seed(2)
    x, t, y = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64), torch.tensor([30.0, 810.0]), \
        torch.tensor([1, 5])
    with torch.no_grad():
        return model.double()(x, t, y)  # .double(): the DiT's position table is fp32 whatever the default dtype


def test_a_merged_dit_export_computes_as_the_adapted_model(dit_run, tmp_path, capsys):
    root, ckpt, base, adapted = dit_run
    out = tmp_path / "merged.safetensors"
    with float64():
        code, stdout, err = export(capsys, f"ckpt_path={ckpt}", f"out={out}", "lora=true", "merge=true")
    assert code == 0, err
    assert "fused at strength 1" in stdout
    state, info = read_weights(out)
    assert not any(is_adapter_key(key) or ".base_layer." in key for key in state)
    assert {value.dtype for key, value in state.items() if key.endswith(".weight")} == {torch.float64}
    with float64():
        merged = hydra.utils.instantiate(info["model"])
    merged.load_state_dict(state, strict=True)  # a whole plain model: every key, none left over
    expected = dit_output(adapted)
    assert_same_numbers(dit_output(merged.eval()), expected, of_max=1e-13, where="merged export vs adapted DiT")
    assert (dit_output(base) - expected).abs().max() > 1e-2  # the adapter matters


def test_a_merged_diffusers_export_at_a_strength_computes_as_the_adapted_model(tmp_path, capsys):
    """A Wan LoRA run on model.pretrained, fused at merge_strength=0.7 into a diffusers transformer folder that
    diffusers' from_pretrained loads: it computes as the adapted model with each adapter's scale times 0.7."""
    import diffusers
    from peft.tuners.lora import LoraLayer

    from ringdit.models.build import build_model

    preset = model_preset("wan_tiny")
    config = {**preset, "input_size": [2, 8, 8], "in_channels": preset["config"].get("out_channels") or 4,
              "text_len": 7, "text_dim": 16, "pretrained": str(tmp_path / "wan")}
    lora = {"rank": RANK, "alpha": ALPHA, "base_dtype": "float32"}
    with float64():
        save_tiny_wan(tmp_path / "wan")  # the base: fp64 weights
        adapted, _ = build_model(config, lora={**lora, "base_dtype": None})  # the base as the folder holds it
        adapters = random_adapters(adapted, seed=3)
        ckpt = lightning_checkpoint(tmp_path / "lora.ckpt", {"model": config, "lora": lora}, adapters)
        code, stdout, err = export(capsys, f"ckpt_path={ckpt}", f"out={tmp_path / 'merged'}", "lora=true",
                                   "merge=true", "format=diffusers", "merge_strength=0.7")
    assert code == 0, err
    assert "note: wrote the transformer folder(s) only" in stdout  # the base is a transformer folder, no pipeline
    folder = tmp_path / "merged" / "transformer"
    loaded = diffusers.WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.float64)
    with float64():  # from_pretrained keeps a few small layers in fp32 (_keep_in_fp32_modules): the file's own fp64
        merged = diffusers.WanTransformer3DModel.from_config(loaded.config)
    merged.load_state_dict(load_file(folder / "diffusion_pytorch_model.safetensors"), strict=True)
    load_adapter(adapted, adapters)
    for layer in adapted.modules():
        if isinstance(layer, LoraLayer):
            layer.set_scale("default", 0.7)  # peft's scale alpha / r times 0.7, in its unmerged forward
    g = torch.Generator().manual_seed(4)
    x, t, text = torch.randn(2, config["in_channels"], 2, 8, 8, generator=g, dtype=torch.float64), \
        torch.tensor([30.0, 810.0]), torch.randn(2, 7, 16, generator=g, dtype=torch.float64)
    with torch.no_grad():
        expected = adapted.eval()(x, t, {"text": text})
        assert_same_numbers(merged(x, t, text, return_dict=False)[0], expected, of_max=1e-13,
                            where="merged diffusers export vs adapted Wan")
        # as diffusers loads it: its fp32 layers (time embedding, norms, modulation) round those weights to fp32
        assert_same_numbers(loaded(x, t, text, return_dict=False)[0], expected, of_max=1e-6,
                            where="the export as diffusers loads it")
        adapted.transformer.disable_adapters()  # peft's: the base alone differs
        assert (adapted(x, t, {"text": text}) - expected).abs().max() > 1e-3


def test_bad_merges_are_refused_in_one_line_and_their_advice_exports(dit_run, tmp_path, capsys):
    """A strength that is not a number, a format that is no model's, a checkpoint that is no LoRA run's, a base of
    another size: one line each, nothing written; each advice, followed, exports."""
    root, ckpt, base, _ = dit_run
    out = tmp_path / "merged.safetensors"
    common = [f"ckpt_path={ckpt}", f"out={out}", "lora=true", "merge=true"]
    with float64():
        code, _, err = export(capsys, *common, "merge_strength=nan")
        assert code == 2 and "Error: merge_strength must be a finite number, got nan" in err, err
        code, _, err = export(capsys, *common, "merge_strength=strong")
        assert code == 2 and "Error: merge_strength must be a finite number, got 'strong'" in err, err
        code, _, err = export(capsys, *common, "format=comfyui")
        assert code == 2 and "a merged LoRA is a whole model" in err and "drop merge=true" in err, err
        wider = {**model_preset("dit"), **DIT, "hidden_size": 48}
        save_file({key: value.contiguous() for key, value in hydra.utils.instantiate(wider).state_dict().items()},
                  str(tmp_path / "wider.safetensors"))
        code, _, err = export(capsys, *common, f"base={tmp_path / 'wider.safetensors'}")
        assert code == 2 and f"base={tmp_path / 'wider.safetensors'} does not fit the LoRA adapter" in err, err
        assert not out.exists() and not list(tmp_path.glob("*.tmp*"))
        code, stdout, err = export(capsys, *common, "merge_strength=0.5", f"base={root / 'base.safetensors'}")
        assert code == 0 and "fused at strength 0.5" in stdout, err
        kind = read_weights(ckpt)[1]["lora"]["type"]
        if kind in ("loha", "lokr"):  # diffusers' LoRA file holds no LyCORIS factors: the merge is the advice
            code, _, err = export(capsys, f"ckpt_path={ckpt}", f"out={tmp_path / 'adapter'}", "lora=true")
            assert code == 2 and f"trained lora.type={kind}, which diffusers' LoRA format does not hold" in err, err
            assert "lora=true merge=true" in err and not (tmp_path / "adapter").exists()

        whole = lightning_checkpoint(tmp_path / "whole.ckpt", {"model": {**model_preset("dit"), **DIT}},
                                     base.state_dict())
        code, _, err = export(capsys, f"ckpt_path={whole}", f"out={tmp_path / 'whole.safetensors'}", "lora=true",
                              "merge=true")
        assert code == 2 and "is no LoRA run's checkpoint" in err and "drop lora=true merge=true" in err, err
        code, _, err = export(capsys, f"ckpt_path={whole}", f"out={tmp_path / 'whole.safetensors'}")
        assert code == 0, err


def test_a_dora_model_built_on_the_meta_device_starts_as_its_base(dit_run):
    """build -> LoRA on meta -> materialize from the base file: DoRA's magnitudes are the base weight's row norms (as
    peft initialises them on a built model), LoHa / LoKr start with one factor zero, so the adapted model computes as
    the base."""
    from ringdit.models.build import build_model

    root, ckpt, base, adapted = dit_run
    settings = read_weights(ckpt)[1]["lora"]
    with float64():
        model, _ = build_model({**model_preset("dit"), **DIT}, init_from=str(root / "base.safetensors"),
                               lora={**settings, "base_dtype": None})
    magnitudes = {key: value for key, value in model.state_dict().items() if ".lora_magnitude_vector." in key}
    assert bool(magnitudes) == (settings["type"] == "dora")
    for key, magnitude in magnitudes.items():
        weight = base.get_parameter(key.split(".lora_magnitude_vector.")[0] + ".weight")
        assert_same_numbers(magnitude, torch.linalg.norm(weight, dim=1), of_max=1e-15, where=key)
    assert_same_numbers(dit_output(model.eval()), dit_output(base), of_max=1e-13, where="DoRA at init vs its base")


def test_a_dora_adapter_exported_for_diffusers_computes_there_as_in_ringdit(tmp_path):
    """lora.type=dora exported with lora=true: diffusers' load_lora_adapter reads the magnitudes (use_dora) and its
    Wan computes as ringdit's adapted one, in fp64."""
    import diffusers

    from ringdit.models.lora import adapter_state, export_lora
    from ringdit.models.diffusers import DiffusersTransformer
    from tests.helpers import architecture

    torch.manual_seed(0)
    with float64():
        model = DiffusersTransformer("wan", config=architecture("wan_tiny"), input_size=(2, 8, 8), in_channels=4,
                                     text_len=7, text_dim=16)
        reference = diffusers.WanTransformer3DModel.from_config(architecture("wan_tiny"))
    reference.load_state_dict(model.transformer.state_dict())
    add_lora(model, rank=RANK, alpha=ALPHA, type="dora")
    load_adapter(model, random_adapters(model, seed=5))
    path = export_lora(adapter_state(model.state_dict()), {"alpha": ALPHA}, tmp_path)
    assert any(key.endswith(".lora_magnitude_vector") for key in load_file(path))
    reference.load_lora_adapter(str(tmp_path), prefix="transformer", weight_name=path.name)
    g = torch.Generator().manual_seed(4)
    x, t, text = torch.randn(2, 4, 2, 8, 8, generator=g, dtype=torch.float64), torch.tensor([30.0, 810.0]), \
        torch.randn(2, 7, 16, generator=g, dtype=torch.float64)
    with torch.no_grad():
        expected = model.eval()(x, t, {"text": text})
        assert_same_numbers(reference(x, t, text, return_dict=False)[0], expected, of_max=1e-12,
                            where="diffusers with the DoRA export vs ringdit")
        reference.disable_lora()
        assert (reference(x, t, text, return_dict=False)[0] - expected).abs().max() > 1e-3
