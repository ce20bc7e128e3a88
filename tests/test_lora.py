"""LoRA (peft): only adapters train and are saved, under DDP and FSDP with ring attention; the exported adapter is
diffusers' LoRA format and diffusers' own loader reproduces ringdit's outputs with it (also sequence-parallel). A
frozen base held in bf16 (``lora.base_dtype``) computes as the fp32 one does, up to bf16's rounding, also sharded by
FSDP2 beside fp32 adapters; ``infer.py`` samples an adapter-only checkpoint on its base (the run's, or ``base=``) and
refuses, in one line, a base that is missing or does not fit."""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ringdit.models.lora import adapter_state, add_lora, export_lora, is_adapter_key, is_null_condition_key
from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from ringdit.checkpoints.weights import read_weights
from tests.distributed import run_ranks
from tests.helpers import (SGD, TINY, WAN, architecture, assert_refused, assert_same_numbers, fail_fast, logged_losses,
                           run, save_tiny_wan, served_video, tiny_dit)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.timeout(900)  # a test runs at most three trainings (under a minute on an idle 2-core machine)

LORA = ["lora.rank=4", "lora.alpha=8"]


def test_lora_targets_that_match_nothing_fail_before_spawning(tmp_path):
    proc, _ = fail_fast("train.py", *TINY, "trainer/strategy=fsdp", "ring_degree=2", *LORA, "lora.targets=[to_q]",
                        f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Error: lora.targets=['to_q'] match no linear layer of DiT" in proc.stderr
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


def test_flux2_lora_trains_only_its_adapters_single_stream_projection_included(tmp_path):
    """experiment=flux2_tiny with LoRA and the default targets: the optimizer holds the adapters and nothing else,
    the checkpoint only them (and the empty prompt's embedding), and they adapt every default target -- the single-stream blocks' fused
    to_qkv_mlp_proj (they have no to_q) with the image stream's projections -- and trained (B starts at zero)."""
    from tests.families import FLUX2

    run("train.py", tmp_path, *FLUX2, *LORA, f"data.cache_dir={tmp_path / 'data'}", env={"HF_HUB_OFFLINE": "1"})
    state, info = read_weights(tmp_path / "checkpoints" / "last.ckpt", prefer="model")
    assert state and all(is_adapter_key(key) or is_null_condition_key(key) for key in state), sorted(state)[:5]
    adapted = {re.sub(r"\.lora_[AB]\.default\.weight$", "", key) for key in adapter_state(state)}
    assert adapted == {"transformer.transformer_blocks.0.attn.to_q", "transformer.transformer_blocks.0.attn.to_k",
                       "transformer.transformer_blocks.0.attn.to_v", "transformer.transformer_blocks.0.attn.to_out.0",
                       "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj"}
    optimizer = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]
    assert sum(len(group["params"]) for group in optimizer["param_groups"]) == len(adapter_state(state))  # only they
    fused_b = state["transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_B.default.weight"]
    assert fused_b.abs().max() > 0
    assert info["lora"]["rank"] == 4


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



# ---- a frozen base held in bfloat16 (lora.base_dtype) -----------------------------------------------------------


def plain_model(kind):
    """A tiny seeded model of ``kind`` (the same weights each call) and a forward of it on fixed inputs."""
    g = torch.Generator().manual_seed(2)
    if kind == "dit":
        x, t, y = torch.randn(2, 3, 8, 8, generator=g), torch.tensor([0.3, 0.8]), torch.tensor([1, 5])
        return tiny_dit(), lambda model: model(x, t, y)
    from ringdit.models.diffusers import DiffusersTransformer

    torch.manual_seed(0)
    model = DiffusersTransformer("wan", config=architecture("wan_tiny"), input_size=(2, 8, 8), in_channels=4,
                                 text_len=7, text_dim=16)
    parallelize(model)
    x, t = torch.randn(2, 4, 2, 8, 8, generator=g), torch.tensor([30.0, 810.0])
    text = torch.randn(2, 7, 16, generator=g)
    return model, lambda model: model(x, t, {"text": text})


def fp32_and_bf16_base(kind):
    """The same adapted model twice: its base layers in fp32, and in bf16 (the fp32 values, rounded); trained-looking
    adapters (B is zero at init, which would hide the adapters' share of the output and of the gradients)."""
    reference, forward = plain_model(kind)
    add_lora(reference, rank=4, alpha=8)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, param in reference.named_parameters():
            if is_adapter_key(key):
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    low = add_lora(plain_model(kind)[0], rank=4, alpha=8, base_dtype="bfloat16")
    low.load_state_dict(reference.state_dict())  # copied into the bf16 storage: rounded
    return reference, low, forward


def projection_keys(model) -> set[str]:
    """The weights of the model's own Linear and Conv layers (not LoRA's A and B): what a bf16 base holds in bf16."""
    layers = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)
    return {f"{name}.{key}" for name, module in model.named_modules() if isinstance(module, layers)
            for key, _ in module.named_parameters(recurse=False) if not is_adapter_key(f"{name}.")}


@pytest.mark.parametrize("kind", ["dit", "wan"])
def test_a_bf16_base_holds_the_frozen_projections_in_bf16_and_computes_like_fp32(kind):
    """The frozen Linear / Conv weights (the adapted layers' base and the others) are bf16; the adapters and every
    other frozen weight (norms, embeddings, modulation tables) keep fp32. At precision 32 (fp32 activations, no
    autocast) the model runs and gives the fp32 model's output and adapter gradients within bf16's rounding, and
    only the adapters get gradients.

    Tolerances: the weights and the inputs of each cast layer are rounded to bf16 (8 significant bits: relative error
    <= 2^-9 each), the products summed in fp32 and the output cast back, so each layer is off by about one bf16 unit
    (2^-8 = 3.9e-3) of its output, and those errors partly cancel over the layers: 1.6e-2 (4 units) of the largest
    output (measured: 4.4e-3 DiT, 4.1e-3 Wan). A gradient meets each cast layer twice on its way back (the rounded
    weights, and the rounded activations its weight gradient is made of), over every layer after its adapter: 5e-2
    of the largest gradient (measured: 8.3e-3 DiT, 1.2e-2 Wan).
    """
    reference, low, forward = fp32_and_bf16_base(kind)
    cast = projection_keys(low)
    adapted = {key for key in cast if ".base_layer." in key}
    assert adapted and cast - adapted  # adapted layers' base, and projections no adapter targets (DiT: adaLN)
    for key, param in low.named_parameters():
        assert param.dtype == (torch.bfloat16 if key in cast else torch.float32), key
        assert param.requires_grad == is_adapter_key(key), key
    assert any(p.dtype == torch.float32 and not p.requires_grad for p in low.parameters())  # norms, embeddings
    for key, buffer in low.named_buffers():
        assert buffer.dtype == dict(reference.named_buffers())[key].dtype, key
    expected, output = forward(reference), forward(low)
    assert output.dtype == torch.float32
    assert (output - expected).abs().max() > 0  # the base did compute in bf16
    assert_same_numbers(output, expected, of_max=1.6e-2, where="bf16 base vs fp32 base")
    expected.square().mean().backward()
    output.square().mean().backward()
    ours = {key: param.grad for key, param in low.named_parameters() if param.grad is not None}
    theirs = {key: param.grad for key, param in reference.named_parameters() if is_adapter_key(key)}
    assert ours.keys() == theirs.keys()  # the adapters, and nothing frozen
    for key, grad in ours.items():
        assert grad.dtype == torch.float32 and grad.abs().max() > 0, key
        assert_same_numbers(grad, theirs[key], of_max=5e-2, where=key)


def test_a_bf16_base_runs_under_autocast_and_from_the_meta_device():
    """bf16-mixed (autocast) computes the base as autocast would without the cast: within bf16 compute's error
    (every matmul in bf16 here, not only the base's: 2e-2 of the largest output, measured 4.1e-3). Built on the meta
    device and then given memory and the fp32 weights, the model is the one cast after loading, exactly."""
    reference, low, forward = fp32_and_bf16_base("dit")
    expected = forward(reference)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = forward(low)
    assert_same_numbers(mixed.float(), expected, of_max=2e-2, where="autocast bf16 vs fp32")

    from ringdit.models import DiT

    with torch.device("meta"):
        on_meta = add_lora(DiT(input_size=8, patch_size=2, in_channels=3, hidden_size=64, depth=2, num_heads=4,
                               num_classes=10, learn_sigma=True), rank=4, alpha=8, base_dtype="bfloat16")  # tiny_dit's
    assert {key for key, p in on_meta.named_parameters() if p.dtype == torch.bfloat16} == projection_keys(on_meta)
    on_meta.to_empty(device="cpu")
    on_meta.load_state_dict(reference.state_dict())  # fp32 file values into the bf16 storage
    for key, param in on_meta.named_parameters():
        assert torch.equal(param, dict(low.named_parameters())[key]), key
    assert torch.equal(forward(on_meta), forward(low))


def check_fsdp_bf16_base(rank, world):
    """FSDP2 shards a model whose blocks mix bf16 frozen base weights and fp32 adapters in one ``fully_shard``
    group: the sharded forward and the adapters' gradients are the unsharded model's. FSDP2 asks only the weights
    that train for one dtype (the adapters'); it gathers the rest in their own dtypes. Every rank computes the same
    batch, so the reduce-scatter's average is the one-process gradient. With ``param_dtype=bfloat16``
    (MixedPrecisionPolicy) everything is gathered and computed in bf16, the gradients reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for param_dtype in (None, torch.bfloat16):
        _, unsharded, forward = fp32_and_bf16_base("dit")
        expected = forward(unsharded)
        expected.square().mean().backward()
        grads = {key: param.grad for key, param in unsharded.named_parameters() if param.grad is not None}
        _, model, _ = fp32_and_bf16_base("dit")
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        base = projection_keys(model)
        for key, param in model.named_parameters():
            assert hasattr(param, "device_mesh") and param.dtype == (torch.bfloat16 if key in base else torch.float32)
        output = forward(model)
        output.square().mean().backward()
        # param_dtype=None: the same numbers up to summation order (measured: bitwise equal); bf16 compute of every
        # matmul, as under autocast above (measured: 6.3e-3 of the largest output, 1.2e-2 of the largest gradient)
        close = {"rtol": 1e-5, "atol": 1e-6} if param_dtype is None else {"of_max": 2e-2}
        assert_same_numbers(output.float(), expected, **close, where=f"sharded forward, param_dtype={param_dtype}")
        ours = {key: param.grad.full_tensor() for key, param in model.named_parameters() if param.grad is not None}
        assert ours.keys() == grads.keys() and all(is_adapter_key(key) for key in ours)
        for key, grad in ours.items():
            assert grad.dtype == torch.float32, key
            assert_same_numbers(grad, grads[key], **({"of_max": 1e-5} if param_dtype is None else {"of_max": 5e-2}),
                                where=f"{key}, param_dtype={param_dtype}")
        frozen = {key: param.full_tensor().clone() for key, param in model.named_parameters() if key in base}
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
        for key, param in model.named_parameters():
            if key in base:
                assert torch.equal(param.full_tensor(), frozen[key]), key


def test_fsdp_shards_a_bf16_base_with_fp32_adapters():
    run_ranks(check_fsdp_bf16_base, 2)


# ---- sampling an adapter-only checkpoint on its base ------------------------------------------------------------


def sample(run_dir, ckpt, *overrides):
    """infer.py's images for ``ckpt`` (4 samples, 4 Heun steps)."""
    run("infer.py", run_dir, f"ckpt_path={ckpt}", "num_samples=4", "diffusion.sampling.steps=4", *overrides)
    return np.load(run_dir / "samples.npz")["images"].astype(np.int64)


def with_recorded_init_from(ckpt, init_from, out):
    """A copy of the training checkpoint ``ckpt`` whose run recorded another ``init_from`` (None: no base)."""
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["hyper_parameters"]["init_from"] = init_from
    torch.save(checkpoint, out)
    return out


@pytest.fixture(scope="module")
def lora_run(tiny_checkpoint, tmp_path_factory):
    """A LoRA run on an exported base (its init_from), and its samples. The base's zero-initialised weights
    (adaLN-Zero's modulation, the final layer) are given trained-looking values: one step from zero, they would hide
    whatever the adapters in the blocks do to the output; so are the adapters."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ringdit.export import main

    root = tmp_path_factory.mktemp("lora_infer")
    assert main([f"ckpt_path={tiny_checkpoint}", f"out={root / 'exported.safetensors'}"]) == 0
    with safe_open(str(root / "exported.safetensors"), framework="pt") as f:
        metadata, state = f.metadata(), {key: f.get_tensor(key) for key in f.keys()}
    g = torch.Generator().manual_seed(0)
    for key, value in state.items():
        if value.abs().max() < 0.01:  # zero-initialised and one step away from it (as tests.helpers.tiny_dit does)
            state[key] = value + 0.05 * torch.randn(value.shape, generator=g)
    base = root / "base.safetensors"
    save_file(state, str(base), metadata=metadata)
    run("train.py", root / "lora", *TINY, *SGD, *LORA, "trainer.max_steps=2", f"init_from={base}")
    # two steps move B (zero at init) too little to change an 8-bit pixel: trained-looking adapters instead
    ckpt = root / "lora" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    for key, value in checkpoint["state_dict"].items():
        if is_adapter_key(key):
            checkpoint["state_dict"][key] = 0.3 * torch.randn(value.shape, generator=g)
    torch.save(checkpoint, ckpt)
    return SimpleNamespace(root=root, base=base, ckpt=ckpt, samples=sample(root / "samples", ckpt))


def merged_export(lora_run, out):
    """The LoRA run's model as one plain export: each adapted weight W + (alpha / rank) B A, written out here from
    the definition of LoRA, not by peft; the configs are the run's."""
    from safetensors.torch import save_file

    base, _ = read_weights(lora_run.base)
    adapters, info = read_weights(lora_run.ckpt)  # the EMA adapters, as infer.py samples by default
    scale = info["lora"]["alpha"] / info["lora"]["rank"]
    for key in list(base):
        a = adapters.get(key.replace(".weight", ".lora_A.default.weight"))
        if a is not None:
            base[key] = base[key] + scale * adapters[key.replace(".weight", ".lora_B.default.weight")] @ a
    configs = ("model", "data", "objective", "sampling")
    save_file(base, str(out), metadata={key: json.dumps(info[key]) for key in configs})
    return out


def test_infer_samples_an_adapter_only_checkpoint_on_the_base_its_run_recorded(lora_run, tmp_path):
    """ckpt_path=<LoRA run> samples the base the run started from (its recorded init_from) with the adapters: the
    same images as the merged model (W + scale B A) -- at most one grey level apart, where fp32 sums in another
    order round a pixel the other way -- and other images than the base alone."""
    assert read_weights(lora_run.ckpt)[1]["lora"]["base_dtype"] == "float32"  # lora.base_dtype=null on a CPU
    merged = sample(tmp_path / "merged", merged_export(lora_run, tmp_path / "merged.safetensors"))
    difference = np.abs(lora_run.samples - merged)
    assert difference.max() <= 1 and (difference > 0).mean() < 0.01, (difference.max(), (difference > 0).mean())
    base = sample(tmp_path / "base", lora_run.base)
    assert np.abs(lora_run.samples - base).mean() > 1.0  # the adapters do change the samples


def test_base_given_on_the_command_line_replaces_the_recorded_one(lora_run, tmp_path):
    """Its run's base moved away, the checkpoint is refused with one line saying so, and samples with base=."""
    moved = tmp_path / "moved.safetensors"
    shutil.copy(lora_run.base, moved)
    ckpt = with_recorded_init_from(lora_run.ckpt, str(tmp_path / "gone.safetensors"), tmp_path / "last.ckpt")
    proc, seconds = fail_fast("infer.py", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, text=f"the run's init_from={tmp_path / 'gone.safetensors'}, the base of the LoRA adapter in "
                              f"ckpt_path={ckpt}, cannot be read", seconds=seconds)
    assert "pass base=PATH" in proc.stderr
    np.testing.assert_array_equal(sample(tmp_path / "given", ckpt, f"base={moved}"), lora_run.samples)


def test_default_base_dtype_is_bfloat16_on_gpus_and_float32_on_cpus():
    from ringdit.spec.checkpoint import default_base_dtype

    assert (default_base_dtype("cuda"), default_base_dtype("cpu")) == ("bfloat16", "float32")


@pytest.mark.parametrize("value", ["int8", "fp12"])
def test_a_base_dtype_that_is_not_a_float_dtype_is_refused(value, tmp_path):
    proc, seconds = fail_fast("train.py", *TINY, *LORA, f"lora.base_dtype={value}", f"hydra.run.dir={tmp_path}")
    assert_refused(proc, text=f"lora.base_dtype='{value}' is not a dtype ringdit takes; use one of float32, bfloat16, "
                              f"float16, float8_e4m3fn, float8_e5m2 (null: bfloat16 on GPUs, float32 on CPUs)",
                   seconds=seconds, run_dir=tmp_path)


def test_a_lora_checkpoint_whose_run_recorded_no_base_is_refused(lora_run, tmp_path):
    ckpt = with_recorded_init_from(lora_run.ckpt, None, tmp_path / "last.ckpt")
    proc, seconds = fail_fast("infer.py", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, text=f"ckpt_path={ckpt} holds only LoRA adapters, and its run recorded no base model",
                   seconds=seconds)
    assert "pass base=" in proc.stderr


def test_a_base_that_does_not_fit_the_adapter_is_refused(lora_run, tmp_path):
    """Another model size (the first key that differs, with both shapes), or a file without the base's weights (the
    first key it lacks): one line naming the base and the checkpoint."""
    from hydra.utils import instantiate

    info = read_weights(lora_run.ckpt)[1]
    bigger = tmp_path / "bigger.pt"
    torch.save(instantiate({**info["model"], "hidden_size": 64}).state_dict(), bigger)
    cases = {bigger: r"final_layer\.adaLN_modulation\.1\.bias is \(128,\) in the base but \(64,\) in the model the "
                     r"adapter was trained on",
             lora_run.ckpt: r"the base lacks final_layer\.adaLN_modulation\.1\.bias, which the model the adapter was "
                            r"trained on has"}
    for base, problem in cases.items():
        proc, seconds = fail_fast("infer.py", f"ckpt_path={lora_run.ckpt}", f"base={base}",
                                  f"hydra.run.dir={tmp_path / 'run'}")
        fit = f"Error: base={base} does not fit the LoRA adapter in ckpt_path={lora_run.ckpt}: "
        assert_refused(proc, re.escape(fit) + problem, seconds=seconds)


def test_a_plain_export_of_a_lora_checkpoint_is_refused_and_merge_exports_it(lora_run, tmp_path, capsys):
    """The plain export is refused; its advice, lora=true merge=true, writes the base with the adapter fused in,
    which samples the LoRA checkpoint's images (at most one grey level apart: fp32 sums in another order)."""
    from ringdit.export import main

    assert main([f"ckpt_path={lora_run.ckpt}", f"out={tmp_path / 'w.safetensors'}"]) == 2
    assert "holds only the adapters, not a model; export the model with its adapter fused in with lora=true " \
           "merge=true" in capsys.readouterr().err
    assert not (tmp_path / "w.safetensors").exists()
    assert main([f"ckpt_path={lora_run.ckpt}", f"out={tmp_path / 'w.safetensors'}", "lora=true", "merge=true"]) == 0
    difference = np.abs(sample(tmp_path / "merged", tmp_path / "w.safetensors") - lora_run.samples)
    assert difference.max() <= 1 and (difference > 0).mean() < 0.01, (difference.max(), (difference > 0).mean())


def test_a_dora_run_trains_its_magnitudes_and_samples_as_its_merged_export(lora_run, tmp_path, capsys):
    """lora.type=dora on the LoRA run's base: the magnitudes train (they leave the base's row norms), the checkpoint
    samples on its base as its merged export (lora=true merge=true) does, at most one grey level apart."""
    from ringdit.export import main

    run("train.py", tmp_path / "dora", *TINY, *SGD, *LORA, "lora.type=dora", "trainer.max_steps=2",
        f"init_from={lora_run.base}")
    ckpt = tmp_path / "dora" / "checkpoints" / "last.ckpt"
    adapters, info = read_weights(ckpt, prefer="model")
    assert info["lora"]["type"] == "dora"
    base, _ = read_weights(lora_run.base)
    magnitudes = {key: value for key, value in adapters.items() if ".lora_magnitude_vector." in key}
    assert magnitudes
    moved = max((value - torch.linalg.norm(base[key.split(".lora_magnitude_vector.")[0] + ".weight"], dim=1)).abs()
                .max().item() for key, value in magnitudes.items())
    assert moved > 1e-6, moved  # trained, from the base's row norms
    checkpoint = torch.load(ckpt, weights_only=True)  # trained-looking adapters, as lora_run's (two steps move little)
    g = torch.Generator().manual_seed(1)
    for key, value in checkpoint["state_dict"].items():
        if ".lora_A." in key or ".lora_B." in key:
            checkpoint["state_dict"][key] = 0.3 * torch.randn(value.shape, generator=g)
    torch.save(checkpoint, ckpt)
    assert main([f"ckpt_path={ckpt}", f"out={tmp_path / 'merged.safetensors'}", "lora=true", "merge=true"]) == 0
    merged = sample(tmp_path / "merged", tmp_path / "merged.safetensors")
    difference = np.abs(sample(tmp_path / "sampled", ckpt) - merged)
    assert difference.max() <= 1 and (difference > 0).mean() < 0.01, (difference.max(), (difference > 0).mean())


def test_a_diffusers_lora_samples_on_its_pretrained_folder_or_on_base(tmp_path):
    """A Wan LoRA run on model.pretrained: sampled on that folder (recorded), or on a diffusers folder given as base=
    when the recorded one is gone -- the same latents; a folder of another architecture is refused naming the first
    setting of the recorded architecture that differs (tests/test_hostile_inputs.py: one the adapters alone fit)."""
    import diffusers

    save_tiny_wan(tmp_path / "wan")
    run("train.py", tmp_path / "lora", *WAN, *LORA, "trainer.max_steps=2", f"model.pretrained={tmp_path / 'wan'}")
    ckpt = tmp_path / "lora" / "checkpoints" / "last.ckpt"
    recorded = sample_latents(tmp_path / "recorded", ckpt)
    shutil.move(tmp_path / "wan", tmp_path / "moved")
    proc, seconds = fail_fast("infer.py", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, text=f"the run's model.pretrained={tmp_path / 'wan'}, the base of the LoRA adapter in "
                              f"ckpt_path={ckpt}, cannot be built", seconds=seconds)
    np.testing.assert_array_equal(sample_latents(tmp_path / "given", ckpt, f"base={tmp_path / 'moved'}"), recorded)

    wider = {**architecture("wan_tiny"), "attention_head_dim": 16}
    diffusers.WanTransformer3DModel.from_config(wider).save_pretrained(tmp_path / "wider" / "transformer")
    proc, seconds = fail_fast("infer.py", f"ckpt_path={ckpt}", f"base={tmp_path / 'wider'}",
                              f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, rf"Error: base={tmp_path / 'wider'} does not fit the LoRA adapter in ckpt_path={ckpt}: "
                         rf"its architecture differs: attention_head_dim 16 \(trained on 12\)", seconds=seconds)


def sample_latents(run_dir, ckpt, *overrides):
    """infer.py's latents for a text model's ``ckpt`` (2 samples, 3 Euler steps, the data's held-out prompts)."""
    run("infer.py", run_dir, f"ckpt_path={ckpt}", "num_samples=2", "diffusion.sampling.steps=3", *overrides)
    return np.load(run_dir / "samples.npz")["latents"]


@pytest.mark.parametrize("family", ["hunyuan_video15", "ltx_video", "ltx2", "skyreels_v2", "minimax_h3"])
def test_lora_trains_only_adapters_of_the_video_families(family, tmp_path):
    """LoRA with the family's default targets (its attention projections, HunyuanVideo 1.5's token refiner's among
    them): the checkpoint and the optimizer hold the adapters and nothing else (the checkpoint also the empty prompt's
    embedding: the base has none), and they trained (B starts at 0)."""
    from tests.families import family_runs

    overrides, _ = family_runs(family)
    run("train.py", tmp_path, *overrides, *LORA, f"data.cache_dir={tmp_path / 'data'}", env={"HF_HUB_OFFLINE": "1"})
    state, _ = read_weights(tmp_path / "checkpoints" / "last.ckpt", prefer="model")
    assert state and all(is_adapter_key(key) or is_null_condition_key(key) for key in state), sorted(state)[:5]
    optimizer = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]
    assert sum(len(group["params"]) for group in optimizer["param_groups"]) == len(adapter_state(state))  # only they
    assert any(value.abs().max() > 0 for key, value in state.items() if ".lora_B." in key)


def test_a_lora_checkpoint_guides_away_from_the_empty_prompt_it_trained_with(models, tmp_path):
    """A LoRA run on a diffusers folder (which holds no empty-prompt embedding) over prepared data: its checkpoint keeps
    the data's empty prompt beside the adapters, and infer.py without negative_prompt= guides away from it -- the
    samples equal those given that embedding as negative_text_embeds=, as diffusers' pipelines encode "" for it; the
    server samples the checkpoint alike."""
    import diffusers
    from safetensors.torch import save_file

    from ringdit.data.text_latents import TextLatentsDataModule
    from ringdit.media.encode_folder import encode_folder
    from tests.helpers import TEXT_LEN, write_video

    base = tmp_path / "base"
    shutil.copytree(models["wan"], base)
    torch.manual_seed(0)
    diffusers.WanTransformer3DModel.from_config({**architecture("wan_tiny"), "in_channels": 16, "out_channels": 16}
                                                ).save_pretrained(base / "transformer")
    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(4):
        write_video(clips / f"{i}.mp4", 5, seed=i, size=(32, 32))
        (clips / f"{i}.txt").write_text("a red fox running")
    encode_folder(str(clips), str(tmp_path / "data"), str(base), str(base), size=32, frames=5, max_text_len=TEXT_LEN,
                  shard_size=4, progress=False)
    env = {"HF_HUB_OFFLINE": "1"}
    run("train.py", tmp_path / "lora", "experiment=wan_tiny", "data=text_latents", f"data.path={tmp_path / 'data'}",
        "model.config.in_channels=16", "model.config.out_channels=16", f"model.pretrained={base}", *LORA,
        "data.batch_size=2", "data.val_fraction=0.25", "trainer.max_steps=1", "logger=csv", "scheduler=constant",
        "callbacks.model_checkpoint.every_n_train_steps=1", "callbacks.sample_grid.steps=2",
        "callbacks.sample_grid.per_class=1", env=env)
    ckpt = tmp_path / "lora" / "checkpoints" / "last.ckpt"
    empty = TextLatentsDataModule(str(tmp_path / "data"), val_fraction=0.25, seed=0, check_values=False).null_condition()
    assert empty["text"].abs().max() > 0  # the encoded empty prompt is not the zeros a folder's base would give
    state, _ = read_weights(ckpt, prefer="ema")
    torch.testing.assert_close(state["null_text"], empty["text"][None], rtol=0, atol=0)
    save_file({"text": empty["text"][None].contiguous(), "text_mask": empty["text_mask"][None].contiguous()},
              str(tmp_path / "empty.safetensors"))
    sample = ["num_samples=1", "diffusion.sampling.steps=2", "prompts=['a red fox running']", "size=[32,32]",
              "frames=5", "diffusion.sampling.cfg_scale=5"]
    run("infer.py", tmp_path / "default", f"ckpt_path={ckpt}", *sample, env=env)
    run("infer.py", tmp_path / "given", f"ckpt_path={ckpt}", *sample,
        f"negative_text_embeds={tmp_path / 'empty.safetensors'}", env=env)
    default, given = (np.load(tmp_path / name / "samples.npz")["latents"] for name in ("default", "given"))
    np.testing.assert_array_equal(default, given)
    served = served_video(ckpt, tmp_path / "serve", "a red fox running", seed=0, steps=2, size=32, frames=5,
                          extra=["diffusion.sampling.cfg_scale=5"])
    assert served == (tmp_path / "default" / "sample-000.mp4").read_bytes()  # the server loads it alike



@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
def test_lora_types_train_alike_under_ddp_and_fsdp(kind, tmp_path):
    """lora.type=dora / loha / lokr at ring 2 under DDP and under FSDP (each rank its rows of the weights and of the
    adapters' factors; DoRA's magnitudes started from its own rows' norms): the same losses and trained adapters."""
    run("train.py", tmp_path / "base", *TINY, *SGD)
    base = tmp_path / "base" / "checkpoints" / "last.ckpt"
    for name, strategy in {"ddp": [], "fsdp": ["trainer/strategy=fsdp"]}.items():
        run("train.py", tmp_path / name, *TINY, *SGD, *LORA, f"lora.type={kind}", "ring_degree=2",
            f"init_from={base}", *strategy)
    ddp, fsdp = logged_losses(tmp_path / "ddp"), logged_losses(tmp_path / "fsdp")
    assert sorted(ddp) == sorted(fsdp) == [0, 1, 2]
    for step in ddp:
        assert fsdp[step] == pytest.approx(ddp[step], rel=1e-5), f"step {step}"
    adapters = {name: read_weights(tmp_path / name / "checkpoints" / "last.ckpt", prefer="model")[0]
                for name in ("ddp", "fsdp")}
    assert any({"dora": ".lora_magnitude_vector.", "loha": ".hada_", "lokr": ".lokr_"}[kind] in key
               for key in adapters["ddp"])
    assert adapters["ddp"].keys() == adapters["fsdp"].keys()
    for key, value in adapters["ddp"].items():
        assert_same_numbers(adapters["fsdp"][key], value, rtol=1e-5, atol=1e-7, where=key)
