"""Start-up without the whole model on any rank: ``build_model`` builds on the meta device, shards, and gives each rank
only its part of the weights -- read slice by slice from a diffusers folder with sharded safetensors, a ringdit
export, a checkpoint file or a sharded checkpoint folder, or drawn from the seeded per-module initial values.

Each test builds the same model on one process (the reference) and under FSDP on 2 or 4 gloo ranks, and compares the
sharded parameters, gathered, with the reference: exactly (the same values are read or drawn, only placed
differently), weights, EMA and buffers alike.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ringdit.models.build import build_model
from ringdit.parallel import build_shard_mesh
from ringdit.training.fsdp import shard_model
from tests.distributed import run_ranks
from tests.helpers import save_tiny_wan

pytestmark = pytest.mark.timeout(300)

DIT = {"_target_": "ringdit.models.dit.DiT", "input_size": 8, "patch_size": 2, "in_channels": 4, "hidden_size": 24,
       "depth": 3, "num_heads": 2, "num_classes": 5, "learn_sigma": True}


def wan(folder) -> dict:
    return {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan", "pretrained": str(folder),
            "input_size": [2, 4, 4], "in_channels": 4, "text_len": 7, "text_dim": 16}


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole (DTensor shards gathered)."""
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for name, value in model.state_dict().items()}


def build_sharded(rank: int, world: int, cases: list[tuple], save: tuple[str, str] | None = None) -> None:
    """Build each case ``(config, reference file, init_from, lora)`` under FSDP over ``world`` ranks and compare it,
    gathered, with the reference; ``save``: then write ``(weights, folder)`` as a sharded checkpoint. One spawn for
    all: starting ranks costs more than building tiny models."""
    mesh = build_shard_mesh(world)
    for config, reference_path, init_from, lora in cases:
        model, ema = build_model(config, init_from=init_from, lora=lora, ema_decay=0.99, seed=7,
                                 shard=functools.partial(shard_model, mesh=mesh))
        reference = torch.load(reference_path, weights_only=True)
        for name, param in model.named_parameters():
            assert hasattr(param, "to_local"), f"{name} is not sharded"
            assert param.to_local().shape[0] <= -(-param.shape[0] // world), f"{name}: more than this rank's rows"
        got = full_state(model)
        assert sorted(got) == sorted(reference)
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"{init_from}: {name}")
        for name, value in ema.averaged().items():  # made from the shards: each rank averages its own
            torch.testing.assert_close(value.full_tensor(), reference[name], rtol=0, atol=0, msg=f"ema {name}")
    if save is not None:
        save_sharded(world, *save)
    dist.barrier()


def save_sharded(world: int, weights: str, folder: str) -> None:
    """A ringdit sharded checkpoint folder of ``weights`` saved on ``world`` ranks, as the FSDP strategy writes it."""
    import torch.distributed.checkpoint as dcp

    model, _ = build_model(DIT, init_from=weights, shard=functools.partial(shard_model, mesh=build_shard_mesh(world)))
    dcp.save({"state_dict": {f"ema.module.{k}": v for k, v in model.state_dict().items()}}, checkpoint_id=folder)
    if dist.get_rank() == 0:
        torch.save({"hyper_parameters": {}}, f"{folder}/meta.pt")


def reference(config: dict, tmp_path, name: str, **kwargs) -> str:
    """The model built on one process, saved whole."""
    model, _ = build_model(config, seed=7, **kwargs)
    path = tmp_path / f"{name}.pt"
    torch.save(full_state(model), path)
    return str(path)


LORA = {"rank": 2, "targets": ["attn.qkv", "mlp.fc1"]}


def test_sharded_start_equals_one_process(tmp_path):
    """On 4 ranks, then on 2, every way a model starts gives each rank its rows of the one-process model, bit for bit:

    - random init (no weights file): each rank draws one module's tensors at a time and keeps its rows (also with
      LoRA adapters on the frozen base);
    - ``model.pretrained``: a diffusers folder whose weights are split over several safetensors files with an index
      (the result is diffusers' own ``from_pretrained``);
    - ``init_from``: a ringdit export (.safetensors), a checkpoint file (memory-mapped), and a sharded checkpoint
      folder written on 4 ranks and read on 2.
    """
    import diffusers

    state = save_tiny_wan(tmp_path)
    diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "transformer").save_pretrained(
        tmp_path / "split" / "transformer", max_shard_size="20KB")
    assert len(list((tmp_path / "split" / "transformer").glob("*.safetensors"))) > 2
    wan_config = wan(tmp_path / "split")
    wan_reference = reference(wan_config, tmp_path, "wan")
    expected = torch.load(wan_reference, weights_only=True)
    for key, value in state.items():
        torch.testing.assert_close(expected[f"transformer.{key}"], value, rtol=0, atol=0)

    weights, _ = build_model(DIT, seed=11)
    dit = {key: value.detach().clone() for key, value in weights.state_dict().items()}
    save_file(dit, tmp_path / "export.safetensors")
    torch.save({"state_dict": {f"ema.module.{k}": v for k, v in dit.items()}, "hyper_parameters": {}},
               tmp_path / "run.ckpt")
    loaded = reference(DIT, tmp_path, "loaded", init_from=str(tmp_path / "export.safetensors"))
    assert torch.equal(torch.load(loaded, weights_only=True)["blocks.0.attn.qkv.weight"], dit["blocks.0.attn.qkv.weight"])

    random_init = [(DIT, reference(DIT, tmp_path, "dit"), None, None),
                   (DIT, reference(DIT, tmp_path, "lora", lora=LORA), None, LORA)]
    run_ranks(build_sharded, 4, random_init, (str(tmp_path / "export.safetensors"), str(tmp_path / "sharded.ckpt")))
    run_ranks(build_sharded, 2, [*random_init, (wan_config, wan_reference, None, None),
                                 *[(DIT, loaded, str(tmp_path / name), None)
                                   for name in ("export.safetensors", "run.ckpt", "sharded.ckpt")]])


def test_the_ema_averages_what_trains_and_shares_the_rest():
    """Under LoRA the EMA copies only the adapters (the frozen base is the model's own tensors, so it costs nothing);
    its updates are the ramped lerp, and sampling with it swaps its weights in and back out exactly."""
    from ringdit.models.ema import ema_weight

    model, ema = build_model(DIT, lora=LORA, ema_decay=0.9)
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    assert set(ema.averaged()) == trained and all(".lora_" in name for name in trained)
    for name, param in model.named_parameters():
        if name not in trained:
            assert ema.module.get_parameter(name) is param, name  # shared, not copied
    assert sorted(ema.state_dict()) == sorted(["n_averaged", *(f"module.{k}" for k in model.state_dict())])

    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    ema.update_parameters(model)  # the first update copies
    with torch.no_grad():
        for name in trained:
            model.get_parameter(name).add_(1.0)
    ema.update_parameters(model)
    weight = ema_weight(0.9, 1)
    for name, average in ema.averaged().items():
        torch.testing.assert_close(average, before[name] + weight, rtol=0, atol=1e-6)
    averaged = {name: value.detach().clone() for name, value in ema.averaged().items()}
    with ema.applied_to(model):
        for name in trained:
            assert torch.equal(model.get_parameter(name), averaged[name])
    for name in trained:
        assert torch.equal(model.get_parameter(name), before[name] + 1.0)
