"""The memory toolkit (issue 41): an fp8 frozen LoRA base, 8-bit AdamW states, selective and offloaded activation
checkpointing, and the memory estimate and planner that count them.

References: the bf16 / fp32 base for the fp8 one (its error is bounded by fp8's rounding), one process for FSDP and
ring (the same fp8 numbers, only placed differently), torch's AdamW for the 8-bit one, and the model without
checkpointing for the checkpointed one (the same gradients: recomputation repeats the same arithmetic).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ringdit.models.build import build_model
from ringdit.models.fp8 import ScaledFloat8Linear, float8_layers, keep_float8_out_of_ddp
from ringdit.models.lora import add_lora, hold_base_in, is_adapter_key
from ringdit.parallel.layout import Layout
from ringdit.costs import ModelSize, Setup, estimate_memory
from ringdit.models import parallelize
from tests.distributed import run_ranks
from tests.helpers import TINY, architecture, assert_refused, fail_fast

pytestmark = pytest.mark.timeout(300)

DIT = {"_target_": "ringdit.models.dit.DiT", "input_size": 8, "patch_size": 2, "in_channels": 4, "hidden_size": 32,
       "depth": 2, "num_heads": 2, "num_classes": 5, "learn_sigma": True}
FP8 = {"rank": 4, "alpha": 8, "base_dtype": "float8_e4m3fn"}


# ---- an fp8 base --------------------------------------------------------------------------------------------------


def tiny(kind: str):
    """A seeded tiny Wan or Flux (the same weights each call) and a forward of it on fixed inputs."""
    from ringdit.models.diffusers import DiffusersTransformer

    g = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    if kind == "wan":
        model = DiffusersTransformer("wan", config=architecture("wan_tiny"), input_size=(2, 8, 8), in_channels=4,
                                     text_len=7, text_dim=16)
        x, cond = torch.randn(2, 4, 2, 8, 8, generator=g), {"text": torch.randn(2, 7, 16, generator=g)}
    else:
        model = DiffusersTransformer("flux", config=architecture("flux_tiny"), input_size=(6, 10), in_channels=1,
                                     text_len=5, text_dim=32, pooled_dim=32)
        x = torch.randn(2, 1, 6, 10, generator=g)
        cond = {"text": torch.randn(2, 5, 32, generator=g), "pooled": torch.randn(2, 32, generator=g)}
    parallelize(model)
    t = torch.tensor([30.0, 810.0])
    return model, lambda m: m(x, t, cond)


def adapted(kind: str, base_dtype: str):
    """The tiny model with trained-looking adapters (B is zero at init, which would hide the adapters' gradients'
    dependence on the base) on a base held in ``base_dtype``."""
    model, forward = tiny(kind)
    add_lora(model, rank=4, alpha=8, base_dtype=base_dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if is_adapter_key(key):
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return model, forward


def output_and_grads(model, forward):
    output = forward(model)
    output.square().mean().backward()
    return output.detach(), {key: p.grad for key, p in model.named_parameters() if p.grad is not None}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_an_fp8_base_is_within_fp8_rounding_of_the_bf16_base(kind):
    """Every Linear of the blocks is fp8 with fp32 row scales, the rest of the base bf16, the adapters fp32; only the
    adapters get gradients. Output and adapter gradients against the bf16 base, as norm-relative errors.

    Why these bounds: e4m3 rounds each weight to 3 mantissa bits (relative error <= 2^-4, rms about 2^-4 / sqrt(3)
    = 3.6e-2 of a weight); a layer's output error averages that over its `in` products and is damped by the residual
    stream, which fp8 does not touch: measured 7.3e-3 (Wan) and 5.7e-3 (Flux) of the output's norm. A gradient meets
    every fp8 layer after its adapter, and at widths of 32 to 64 few terms average the rounding out: measured 6.9e-2
    and 5.7e-2 for the worst adapter. e5m2 keeps 2 mantissa bits: twice the error (measured 1.6e-2, 1.0e-2; 1.3e-1).
    Bounds: output 2e-2, gradients 1.5e-1 for e4m3, twice that for e5m2.
    """
    bf16_out, bf16_grads = output_and_grads(*adapted(kind, "bfloat16"))
    report = {}
    for name, bound in (("float8_e4m3fn", 1), ("float8_e5m2", 2)):
        model, forward = adapted(kind, name)
        layers = float8_layers(model)
        assert layers and all(layer.weight.dtype == getattr(torch, name) for layer in layers.values())
        for key, param in model.named_parameters():
            assert param.requires_grad == is_adapter_key(key), key
            if key.endswith("weight_scale"):
                assert param.dtype == torch.float32 and param.shape == (dict(model.named_parameters())[
                    key.removesuffix("_scale")].shape[0],), key
        out, grads = output_and_grads(model, forward)
        assert out.dtype == torch.float32 and grads.keys() == bf16_grads.keys()
        worst = max(relative(grads[key], bf16_grads[key]) for key in grads)
        report[name] = (relative(out, bf16_out), worst)
        assert report[name][0] < 2e-2 * bound, report
        assert worst < 1.5e-1 * bound, report
    print(f"{kind} vs the bf16 base (output, worst adapter gradient; norm-relative): {report}")


def test_an_fp8_base_quantizes_as_it_loads_as_a_loaded_fp32_base_quantizes(tmp_path):
    """Built on the meta device and materialized -- from a weights file, or from the seeded initial values -- each
    fp8 weight is read into a full-precision twin, one at a time, and quantized: bit for bit the fp8 values and
    scales of the fp32 model quantized after loading. Under bf16-mixed autocast the fp8 layers compute in bf16."""
    weights = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in build_model(DIT, seed=3)[0].state_dict().items()}, weights)
    for init_from in (None, str(weights)):
        reference, _ = build_model(DIT, lora={**FP8, "base_dtype": None}, seed=5, init_from=init_from)
        hold_base_in(reference, torch.float8_e4m3fn)  # quantized after loading
        model, _ = build_model(DIT, lora=FP8, seed=5, init_from=init_from)  # quantized as it loads
        expected = dict(reference.named_parameters())
        assert expected.keys() == dict(model.named_parameters()).keys()
        for key, param in model.named_parameters():
            assert param.dtype == expected[key].dtype and torch.equal(param.float(), expected[key].float()), key
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10.0, 500.0]), torch.tensor([1, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x, t, y).dtype == torch.bfloat16


def check_fp8_base_sharded_and_ring(rank: int, world: int) -> None:
    """FSDP over both ranks, which also split the sequence (ring 2): the fp8 weights and their row scales are
    sharded alike (each rank quantizes its own rows, bit for bit the one-process values), and output and adapter
    gradients are the one-process fp8 model's up to summation order. Then DDP wraps an fp8 model (gloo cannot
    broadcast fp8: the fp8 weights are left out, each rank holding them already) and averages the same gradients."""
    from torch.nn.parallel import DistributedDataParallel

    from ringdit.checkpoints.sources import local_index
    from ringdit.parallel import build_shard_mesh, init_sequence_parallel
    from ringdit.training.fsdp import shard_model

    g = torch.Generator().manual_seed(4)
    x, t, y = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10.0, 500.0]), torch.tensor([1, 2])
    one, _ = build_model(DIT, lora=FP8, seed=5)
    expected = one(x, t, y)
    expected.square().mean().backward()
    grads = {key: p.grad for key, p in one.named_parameters() if p.grad is not None}
    dims = init_sequence_parallel(ring_degree=world)
    model, _ = build_model(DIT, dims=dims, backend="math", lora=FP8, seed=5,
                           shard=functools.partial(shard_model, mesh=build_shard_mesh(world)))
    for key, param in model.named_parameters():
        assert hasattr(param, "to_local"), key
        reference = dict(one.named_parameters())[key]
        local = reference[local_index(param)]  # this rank's rows (gloo cannot gather fp8 to compare whole)
        assert param.dtype == reference.dtype and torch.equal(param.to_local().float(), local.float()), key
    output = model(x, t, y)
    output.square().mean().backward()
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    for key, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad.full_tensor(), grads[key], rtol=1e-4, atol=1e-6, msg=key)
    plain, _ = build_model(DIT, lora=FP8, seed=5)
    keep_float8_out_of_ddp(plain)
    ddp = DistributedDataParallel(plain)
    ddp(x, t, y).square().mean().backward()
    for key, param in plain.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, grads[key], rtol=1e-5, atol=1e-7, msg=key)
    dist.barrier()


def test_an_fp8_base_shards_under_fsdp_and_ring_and_runs_under_ddp():
    run_ranks(check_fp8_base_sharded_and_ring, 2)


# ---- selective and offloaded activation checkpointing --------------------------------------------------------------


def test_which_blocks_a_share_or_a_period_checkpoints():
    from ringdit.models.checkpointing import checkpointed_blocks

    assert checkpointed_blocks(6, True) == [True] * 6 and checkpointed_blocks(6, False) == [False] * 6
    assert checkpointed_blocks(6, 0.5) == checkpointed_blocks(6, "every_2") == [True, False] * 3
    assert checkpointed_blocks(6, "every_3") == [True, False, False] * 2
    assert sum(checkpointed_blocks(40, 0.3)) == 12 and sum(checkpointed_blocks(5, 0.5)) == 3  # ceil(f x L)


def dit_grads(setting, offload=False):
    """A tiny DiT's adapter-free gradients under ``setting``, and how often each block ran forward."""
    model, _ = build_model({**DIT, "depth": 4, "activation_checkpointing": setting, "activation_offload": offload},
                           seed=5)
    runs = [0] * 4
    for i, block in enumerate(model.blocks):
        block.attn.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    g = torch.Generator().manual_seed(4)
    x, t, y = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10.0, 500.0]), torch.tensor([1, 2])
    model(x, t, y).square().mean().backward()
    return {key: p.grad for key, p in model.named_parameters() if p.grad is not None}, runs


@pytest.mark.parametrize("setting", [0.5, "every_2", True])
def test_checkpointing_a_share_of_the_blocks_recomputes_those_and_gives_the_same_gradients(setting):
    """Recomputation repeats the same arithmetic on the same inputs: bitwise the same gradients; the chosen blocks
    run forward twice (once more in backward), the others once."""
    expected, runs = dit_grads(False)
    assert runs == [1, 1, 1, 1]
    grads, runs = dit_grads(setting)
    assert runs == ([2, 2, 2, 2] if setting is True else [2, 1, 2, 1])
    for key, grad in expected.items():
        assert torch.equal(grads[key], grad), key


def test_offloading_moves_only_the_checkpointed_blocks_inputs_and_is_off_on_cpu(monkeypatch):
    """On CPU ranks offloading is off (the activations are in host memory already): nothing is packed. Run on CPU
    as on CUDA (``OFFLOAD_DEVICES``; unpinned), it packs exactly the checkpointed blocks' inputs -- the tokens and the
    conditioning of blocks 0 and 2 -- and the gradients are unchanged."""
    from ringdit.models import checkpointing

    packed = []

    class Counting(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory):
            super().__init__(pin_memory)
            pack = self.pack_hook
            self.pack_hook = lambda tensor: packed.append(tuple(tensor.shape)) or pack(tensor)

    monkeypatch.setattr(checkpointing, "save_on_cpu", Counting)
    expected, _ = dit_grads(False)
    dit_grads(0.5, offload=True)
    assert packed == []
    monkeypatch.setattr(checkpointing, "OFFLOAD_DEVICES", ("cuda", "cpu"))
    grads, runs = dit_grads(0.5, offload=True)
    assert runs == [2, 1, 2, 1] and sorted(packed) == sorted([(2, 16, 32), (2, 32)] * 2)
    for key, grad in expected.items():
        assert torch.equal(grads[key], grad), key


# ---- 8-bit AdamW -------------------------------------------------------------------------------------------------


def test_adamw8bit_keeps_8bit_states_tracks_adamw_and_resumes_from_plain_fp32_state(tmp_path):
    """One 64 x 64 weight (4096 values: torchao quantizes tensors of 4096 and more; one shape, one compile): its
    moments are 8-bit, the weights follow torch's AdamW to within the states' rounding, and a checkpoint holds plain
    fp32 moments (torch.load(weights_only=True) reads it) that resume the run: quantizing them again is exact but
    where a block's largest first moment is negative (the signed map holds +1 but not exactly -1), so the resumed
    run follows the uninterrupted one to within that rounding."""
    from torchao.optim.subclass_8bit import OptimState8bit

    from ringdit.training.optimizers import adamw8bit

    target = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))

    def run(optimizer_class, steps, weight=None, state=None):
        param = torch.nn.Parameter(torch.zeros(64, 64) if weight is None else weight.clone())
        optimizer = optimizer_class([param], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
        if state is not None:
            optimizer.load_state_dict(state)
        for _ in range(steps):
            optimizer.zero_grad()
            (param - target).square().sum().backward()
            optimizer.step()
        return param.detach(), optimizer

    eight, optimizer = run(adamw8bit, 6)
    assert isinstance(optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"], OptimState8bit)
    full, _ = run(torch.optim.AdamW, 6)
    # measured 4.4e-3 of the 6e-2 that 6 steps of lr 1e-2 move a weight at most: Adam's first steps divide by the
    # square root of a small second moment, where the 8-bit map is coarsest
    assert (eight - full).abs().max() < 1e-2
    half, optimizer = run(adamw8bit, 3)
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert all(type(value) is torch.Tensor for value in saved["state"][0].values())
    resumed, optimizer = run(adamw8bit, 3, half, saved)
    assert isinstance(optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"], OptimState8bit)
    assert (resumed - eight).abs().max() < 3e-3  # measured 1.1e-3, a quarter of 8-bit's own distance from AdamW


# ---- refused before anything starts --------------------------------------------------------------------------------


LORA = ["lora.rank=4"]


@pytest.mark.parametrize("overrides, message", [
    (["lora.base_dtype=float8_e4m3fn"], r"lora.base_dtype=float8_e4m3fn holds a frozen base in fp8, but lora.rank=0 "
                                         r"is a full fine-tune, which cannot train fp8 weights; set lora.rank > 0"),
    ([*LORA, "lora.base_dtype=float8"], r"lora.base_dtype='float8' is not a dtype ringdit takes; use one of .*"
                                         r"float8_e4m3fn, float8_e5m2"),
    (["model.activation_checkpointing=1.5"], r"model.activation_checkpointing must be true, false, a fraction of the "
                                              r"blocks in \[0, 1\] \(e.g. 0.5\) or every_N .*got 1.5"),
    (["model.activation_checkpointing=every_0"], r"model.activation_checkpointing must be .*got 'every_0'"),
])
def test_bad_memory_settings_are_refused_in_one_line(overrides, message, tmp_path):
    proc, seconds = fail_fast("train.py", *TINY, *overrides, f"hydra.run.dir={tmp_path}")
    assert_refused(proc, message, seconds=seconds, run_dir=tmp_path)


def test_adamw8bit_without_its_library_is_refused_in_one_line(monkeypatch, tmp_path):
    import ringdit.training.optimizers

    monkeypatch.setattr(ringdit.training.optimizers, "library_installed", lambda name: False)
    proc, seconds = fail_fast("train.py", *TINY, "optimizer=adamw8bit", f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text="optimizer=adamw8bit needs torchao, which is not installed; pip install "
                              "'ringdit[lowbit]' (or torchao), or use optimizer=adamw", seconds=seconds, run_dir=tmp_path)


# ---- the estimate and the planner count every option ----------------------------------------------------------------


@pytest.mark.parametrize("base", ["bfloat16", "float8_e4m3fn"])
def test_the_estimate_counts_the_base_bytes_exactly(base):
    """A replicated model's weights as built: fp8 weights (1 byte), their fp32 row scales, bf16 biases and other
    projections, fp32 norms, tables and adapters -- the estimate's bytes are the tensors' bytes."""
    from ringdit.costs import estimate_model_memory

    lora = {**FP8, "base_dtype": base}
    model, _ = build_model(DIT, lora=lora, seed=5)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert estimate_model_memory(DIT, lora=lora, lora_base_dtype=base, ema=False).weights_bytes == held


def test_the_estimate_counts_8bit_states_checkpointed_shares_and_offloaded_inputs():
    size = ModelSize(parameters=10**9, trainable_parameters=10**9, largest_parameter=10**7, root_parameters=10**7,
                     block_parameters=10**7, hidden_size=1024, depth=40, num_heads=16, mlp_hidden=4096, tokens=4096)
    plain = estimate_memory(size, Layout())
    assert estimate_memory(size, Layout(), Setup(optimizer_8bit=True)).optimizer_bytes == int(2 * 10**9 * (1 + 4 / 256))
    # a full fine-tune's block; backward's working set; one weight's gradient in flight
    per_block, backward, in_flight, tokens, a = 14 * 1024 + 2 * 4096, 2 * 4096, 10**7 * 4, 4096, 4
    assert plain.activation_bytes == tokens * (40 * per_block + backward) * a + in_flight
    half = estimate_memory(size, Layout(), Setup(activation_checkpointing=0.5))  # 20 blocks keep their input only
    # at the peak (the last block, not checkpointed): the 20 checkpointed blocks' inputs and 19 others before it
    assert half.activation_bytes == tokens * (20 * 1024 + 19 * per_block + per_block + backward) * a + in_flight
    offloaded = estimate_memory(size, Layout(), Setup(activation_checkpointing=0.5, activation_offload=True))
    assert offloaded.host_bytes == tokens * 20 * 1024 * a  # the 20 inputs, in host memory
    assert offloaded.activation_bytes == half.activation_bytes - tokens * 19 * 1024 * a  # one stays, in flight


def test_the_planner_takes_an_fp8_base_only_where_a_bf16_one_does_not_fit(capsys):
    """Wan 14B LoRA at 720p x 81 frames: on 8 x 80 GB the bf16 base fits and is recommended (exact numerics win a
    tie); on 2 x 24 GB only the fp8 base with every block checkpointed and offloaded does, and the plan says why."""
    from ringdit.plan import main

    common = ["model=wan_14b", "data.frames=81", "data.size=[720,1280]", "lora.rank=32", "show=2"]
    assert main([*common, "gpus=8", "gpu_memory_gb=80"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Recommended: dp=1 ring=8 ulysses=1 fsdp -- ", out, flags=re.M), out
    assert main([*common, "gpus=2", "gpu_memory_gb=24"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Recommended: dp=1 ring=2 ulysses=1 fsdp \+ckpt\+offload fp8-e4m3fn -- ", out, flags=re.M), out
    assert re.search(r"an fp8 base \(float8_e4m3fn\), as with a bf16 base the step would need \d+\.\d GiB", out), out


def test_an_fp8_layer_never_scales_its_weight_in_place():
    """Under FSDP's param_dtype=bfloat16 the gathered weight already has the compute dtype: the cast-up is a copy
    even then, so scaling it leaves the parameter as it was."""
    weight = torch.randn(4, 3).to(torch.bfloat16)
    before = weight.clone()
    out = ScaledFloat8Linear.apply(torch.ones(2, 3, dtype=torch.bfloat16), weight, torch.full((4,), 2.0), None,
                                   torch.bfloat16)
    assert torch.equal(weight, before) and torch.equal(out, 2 * before.sum(1).expand(2, 4))


def check_adamw8bit_under_fsdp(rank: int, world: int) -> None:
    """FSDP2 shards the 8-bit states with their parameters; the DCP-style state dict holds plain fp32 DTensors, and
    loading it quantizes them again into 8-bit DTensor states that continue the run."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ringdit.training.optimizers import _is_quantized, adamw8bit

    mesh = init_device_mesh("cpu", (world,))

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 64, bias=False))
        return fully_shard(model, mesh=mesh)

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))

    def steps(model, optimizer, n):
        for _ in range(n):
            optimizer.zero_grad()
            (model(x) - x).square().mean().backward()
            optimizer.step()

    first = make()
    optimizer = adamw8bit(first.parameters(), lr=1e-2)
    steps(first, optimizer, 2)
    state = get_optimizer_state_dict(first, optimizer)
    assert all(type(v.to_local()) is torch.Tensor for s in state["state"].values() for k, v in s.items() if k != "step")
    second = make()
    second.load_state_dict(first.state_dict())
    resumed = adamw8bit(second.parameters(), lr=1e-2)
    set_optimizer_state_dict(second, resumed, state)
    assert all(_is_quantized(s["exp_avg"]) for s in resumed.state.values())
    steps(first, optimizer, 2)
    steps(second, resumed, 2)
    for p, q in zip(first.parameters(), second.parameters()):  # measured 2.8e-3: see the one-process test
        assert (p.full_tensor() - q.full_tensor()).abs().max() < 1e-2


@pytest.mark.slow  # compiles torchao's step in each rank: about a minute on 2 cores
def test_adamw8bit_shards_and_resumes_under_fsdp():
    run_ranks(check_adamw8bit_under_fsdp, 2)
