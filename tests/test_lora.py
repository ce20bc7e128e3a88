"""LoRA (peft): only adapters train and are saved, under DDP and FSDP with ring attention; the exported adapter is
diffusers' LoRA format and diffusers' own loader reproduces ringdit's outputs with it (also sequence-parallel)."""

from __future__ import annotations

import os

import pytest
import torch

from ringdit.lora import adapter_state, add_lora, export_lora, is_adapter_key
from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from ringdit.checkpoints.weights import read_weights
from tests.distributed import run_ranks
from tests.helpers import SGD, TINY, architecture, assert_same_numbers, fail_fast, logged_losses, run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.timeout(900)  # three training runs (under a minute on an idle 2-core machine)

LORA = ["lora.rank=4", "lora.alpha=8"]


def test_lora_targets_that_match_nothing_fail_before_spawning(tmp_path):
    proc, _ = fail_fast("train.py", *TINY, "trainer/strategy=fsdp", "ring_degree=2", *LORA, "lora.targets=[to_q]",
                        f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Error: lora.targets=['to_q'] match no module of DiT" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_lora_trains_only_adapters_under_ddp_and_fsdp(tmp_path):
    """A trained base, then LoRA at ring 2 under DDP and under FSDP: the same losses and adapters; checkpoints hold
    the adapters only; the export is diffusers' LoRA file."""
    run("train.py", tmp_path / "base", *TINY, *SGD)
    base = tmp_path / "base" / "checkpoints" / "last.ckpt"
    for name, strategy in {"ddp": [], "fsdp": ["trainer/strategy=fsdp"]}.items():
        run("train.py", tmp_path / name, *TINY, *SGD, *LORA, "ring_degree=2", f"init_from={base}", *strategy)
    ddp, fsdp = logged_losses(tmp_path / "ddp"), logged_losses(tmp_path / "fsdp")
    assert sorted(ddp) == sorted(fsdp) == [0, 1, 2]
    for step in ddp:
        assert fsdp[step] == pytest.approx(ddp[step], rel=1e-5), f"step {step}"
    assert ddp[2] != pytest.approx(ddp[0], rel=1e-4)
    adapters = {}
    for name in ("ddp", "fsdp"):
        state, info = read_weights(tmp_path / name / "checkpoints" / "last.ckpt", prefer="model")
        assert state and all(is_adapter_key(key) for key in state), sorted(state)[:5]
        assert info["lora"]["rank"] == 4
        adapters[name] = state
    trained_b = [value for key, value in adapters["ddp"].items() if ".lora_B." in key]
    assert any(value.abs().max() > 0 for value in trained_b)  # B starts at zero: the adapters did train
    for key, value in adapters["ddp"].items():
        assert_same_numbers(adapters["fsdp"][key], value, rtol=1e-5, atol=1e-7, where=key)

    from ringdit.export import main

    assert main([f"ckpt_path={tmp_path / 'fsdp' / 'checkpoints' / 'last.ckpt'}", f"out={tmp_path / 'adapter'}",
                 "lora=true"]) == 0
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "adapter" / "pytorch_lora_weights.safetensors")
    assert exported.keys() == {"transformer." + key.replace(".default.", ".") for key in adapters["fsdp"]}


# ---- the diffusers side ------------------------------------------------------------------------------------------


def wan_lora_case(shape=(2, 8, 8), seed=0, dims=None):
    """A ringdit Wan with trained-looking (random) adapters, and inputs; the same on every rank."""
    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(seed)
    model = DiffusersTransformer("wan", config=architecture("wan_tiny"), input_size=shape, in_channels=4, text_len=7, text_dim=16)
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    add_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if is_adapter_key(key):
                param.normal_(0, 0.1)
    g = torch.Generator().manual_seed(seed + 1)
    x, t, text = torch.randn(2, 4, *shape, generator=g), torch.tensor([30.0, 810.0]), torch.randn(2, 7, 16, generator=g)
    return model, (x, t, text)


def diffusers_with_adapter(model, folder):
    """An unmodified diffusers Wan with ``model``'s base weights and the exported adapter loaded by diffusers."""
    import diffusers

    reference = diffusers.WanTransformer3DModel.from_config(architecture("wan_tiny"))
    base = {key.replace(".base_layer.", "."): value for key, value in model.transformer.state_dict().items()
            if not is_adapter_key(key)}
    reference.load_state_dict(base)
    reference.load_lora_adapter(str(folder), prefix="transformer", weight_name="pytorch_lora_weights.safetensors")
    return reference


def check_wan_lora_ring(rank, world, folder):
    model, (x, t, text) = wan_lora_case(dims=init_sequence_parallel(ring_degree=world))
    reference = diffusers_with_adapter(model, folder)
    with torch.no_grad():
        ours = model(x, t, {"text": text})
        theirs = reference(x, t, text, return_dict=False)[0]
    assert_same_numbers(ours, theirs, atol=1e-5, where="ringdit vs diffusers with the adapter")


def test_wan_lora_export_loads_with_diffusers(tmp_path):
    model, (x, t, text) = wan_lora_case()
    state = {f"model.{key}": value for key, value in model.state_dict().items()}  # a checkpoint's layout
    path = export_lora({k[len("model."):]: v for k, v in adapter_state(state).items()}, {"alpha": 8}, tmp_path)
    assert path.name == "pytorch_lora_weights.safetensors"
    reference = diffusers_with_adapter(model, tmp_path)
    with torch.no_grad():
        ours = model(x, t, {"text": text})
        theirs = reference(x, t, text, return_dict=False)[0]
    assert_same_numbers(ours, theirs, atol=1e-5, where="ringdit vs diffusers with the adapter")
    reference.disable_lora()
    with torch.no_grad():  # the adapter matters: without it the outputs differ
        assert (reference(x, t, text, return_dict=False)[0] - ours).abs().max() > 1e-3
    run_ranks(check_wan_lora_ring, 2, tmp_path)  # and ringdit's ring attention with the adapter: the same
