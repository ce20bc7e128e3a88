"""The memory estimate (``ringdit.costs``): each term moves the way the setting says, train.py's config is read as
it runs (strategy, LoRA, EMA, activation checkpointing under either name), diffusers models are estimated, and
``python -m ringdit.plan`` lays out GPUs, recommends a layout and refuses bad input in one line."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest

import ringdit.training  # noqa: F401 - not first imported under capsys by a planner test (test_vocabulary.py)
from ringdit.parallel.layout import Layout
from ringdit.costs import GiB, ModelSize, Setup, estimate_memory, warn_if_memory_short
from tests.helpers import compose_train

# A DiT-XL-like model: sizes only, nothing is built.
XL = ModelSize(parameters=675_000_000, trainable_parameters=675_000_000, largest_parameter=8_000_000,
               root_parameters=6_000_000, block_parameters=24_000_000, hidden_size=1152, depth=28, num_heads=16,
               mlp_hidden=4608, tokens=4096)


# ---- the terms -------------------------------------------------------------------------------------------------


def test_memory_estimate_numbers():
    """Each term by its formula (the module docstring), for a small model under DDP in fp32."""
    small = ModelSize(parameters=50_000, trainable_parameters=50_000, largest_parameter=4_000, root_parameters=2_000,
                      block_parameters=24_000, hidden_size=32, depth=2, num_heads=4, mlp_hidden=128, tokens=16)
    one = estimate_memory(small, Layout(), Setup(batch_size=16))
    assert one.tokens_per_rank == 16
    assert (one.weights_bytes, one.gradient_bytes, one.optimizer_bytes, one.ema_bytes, one.bucket_bytes) == (
        50_000 * 4, 50_000 * 4, 50_000 * 8, 50_000 * 4, 50_000 * 4)  # fp32; AdamW's 2 moments; DDP's buckets
    assert one.gathered_bytes == 0 and one.host_bytes == 0
    # batch x tokens x (2 blocks of a full fine-tune's values + backward's 2 x F) x fp32, + one weight's gradient
    full_block = 10 * 32 + 2 * 128 + 4 * 32
    assert one.activation_bytes == 16 * 16 * (2 * full_block + 2 * 128) * 4 + 4_000 * 4
    assert one.attention_bytes == 6 * 16 * 16 * 32 * 4
    assert one.startup_bytes == 50_000 * 4 * 2 + 4_000 * 4  # the model, its EMA, one tensor in flight
    assert one.step_bytes == sum(one.terms()[t] for t in one.STEP_TERMS)
    assert one.peak_bytes == one.total_bytes == max(one.startup_bytes, one.step_bytes)
    ulysses = estimate_memory(small, Layout(ulysses_degree=2), Setup(batch_size=16))
    assert ulysses.attention_bytes == one.attention_bytes // 2
    # (S / ring)^2 fp32 scores
    quadratic = estimate_memory(small, Layout(attention_backend="math"), Setup(batch_size=16))
    assert quadratic.attention_bytes - one.attention_bytes == 2 * 16 * 4 * 16**2 * 4 * 2
    sampling = estimate_memory(small, Layout(), Setup(batch_size=16, training=False))  # one block's worth, nothing else
    assert sampling.step_bytes == 50_000 * 4 + 16 * 16 * (10 * 32 + 2 * 128) * 4 + one.attention_bytes
    # the weight's gradient stays fp32
    bf16 = estimate_memory(small, Layout(), Setup(batch_size=16, precision="bf16-mixed"))
    assert bf16.activation_bytes - 4_000 * 4 == (one.activation_bytes - 4_000 * 4) // 2
    assert bf16.weights_bytes == one.weights_bytes


def test_ring_halves_the_tokens_and_activations_per_rank():
    one = estimate_memory(XL, Layout())
    ring = estimate_memory(XL, Layout(ring_degree=2))
    assert ring.tokens_per_rank == one.tokens_per_rank // 2 == 2048
    in_flight = XL.largest_parameter * 4  # one weight's gradient: not per token
    assert ring.activation_bytes - in_flight == (one.activation_bytes - in_flight) // 2
    assert ring.attention_bytes == one.attention_bytes // 2
    assert ring.state_bytes == one.state_bytes  # DDP: every rank still holds the whole training state


def test_fsdp_at_world_4_holds_a_quarter_of_the_state():
    ddp = estimate_memory(XL, Layout(dp_degree=4))
    fsdp = estimate_memory(XL, Layout(dp_degree=4, strategy="fsdp"))
    for term in ("weights", "gradient", "optimizer", "ema"):
        assert getattr(fsdp, f"{term}_bytes") == getattr(ddp, f"{term}_bytes") // 4, term
    assert fsdp.bucket_bytes == 0 and ddp.bucket_bytes == XL.parameters * 4
    # two blocks gathered (current + prefetch) and the root, plus one block's unsharded gradient
    assert fsdp.gathered_bytes == (6_000_000 + 2 * 24_000_000) * 4 + 24_000_000 * 4
    # start-up: only this rank's shards (and its EMA shard), plus the largest tensor in fp32; DDP: the whole model
    assert fsdp.startup_bytes == (XL.parameters * 4 // 4) * 2 + 8_000_000 * 4
    assert ddp.startup_bytes == XL.parameters * 4 * 2 + 8_000_000 * 4
    # HSDP: shard over world / replicate_degree ranks
    hsdp = estimate_memory(XL, Layout(dp_degree=4, strategy="fsdp", replicate_degree=2))
    assert hsdp.weights_bytes == ddp.weights_bytes // 2
    # bf16 mixed precision: the gathered blocks in bf16, the sharded master state still fp32
    mixed = estimate_memory(XL, Layout(dp_degree=4, strategy="fsdp"), Setup(param_dtype="bfloat16"))
    assert mixed.gathered_bytes == (6_000_000 + 2 * 24_000_000) * 2 + 24_000_000 * 4
    assert mixed.state_bytes == fsdp.state_bytes
    # cpu_offload: the sharded state moves to host memory
    offload = estimate_memory(XL, Layout(dp_degree=4, strategy="fsdp", cpu_offload=True))
    assert offload.state_bytes == 0 and offload.host_bytes == fsdp.state_bytes
    assert offload.startup_bytes == 8_000_000 * 4


def test_lora_with_a_bf16_base_is_much_smaller_than_a_full_fine_tune():
    """DiT-XL's default targets (qkv, proj, fc1, fc2) at rank 16: their weights held in bf16, the rest of the base
    (adaLN modulation, embeddings) as built, only the adapters trained and averaged."""
    shapes = [(1152, 3456), (1152, 1152), (1152, 4608), (4608, 1152)]  # (in, out) of the adapted Linears per block
    adapters = 28 * sum(16 * (i + o) for i, o in shapes)
    base = 28 * sum(i * o + o for i, o in shapes)  # their weights and biases
    lora = replace(XL, lora_parameters=adapters, lora_base_parameters=base)
    full = estimate_memory(XL, Layout())
    lean = estimate_memory(lora, Layout(), Setup(lora_base_dtype="bfloat16"))
    assert lean.weights_bytes == (XL.parameters - base) * 4 + base * 2 + adapters * 4
    assert lean.gradient_bytes == adapters * 4 and lean.optimizer_bytes == adapters * 8  # only the adapters train
    assert lean.ema_bytes == adapters * 4 and lean.bucket_bytes == adapters * 4  # the EMA tracks only the adapters
    assert lean.state_bytes < 0.2 * full.state_bytes
    assert lean.startup_bytes < 0.4 * full.startup_bytes
    fp32_base = estimate_memory(lora, Layout(), Setup(lora_base_dtype="float32"))
    assert fp32_base.weights_bytes - lean.weights_bytes == base * 2


def test_dmd2_counts_the_student_the_critic_and_the_frozen_teacher():
    """distill=dmd2: two trained models (student and critic: weights, gradients, AdamW state, DDP's buckets), the
    student's EMA only, and a teacher that is weights only -- whole, without LoRA -- sharded like the others under
    FSDP; one model's activations (one backward at a time). Measured against a real run: docs/memory.md."""
    P, w = XL.parameters, 4
    for layout in (Layout(), Layout(strategy="fsdp", dp_degree=4)):
        n = layout.shard_degree
        one, dmd2 = estimate_memory(XL, layout), estimate_memory(XL, layout, Setup(distill="dmd2"))
        assert dmd2.weights_bytes == 3 * P * w // n
        assert (dmd2.gradient_bytes, dmd2.optimizer_bytes) == (2 * one.gradient_bytes, 2 * one.optimizer_bytes)
        assert dmd2.ema_bytes == one.ema_bytes and dmd2.bucket_bytes == 2 * one.bucket_bytes
        assert (dmd2.activation_bytes, dmd2.attention_bytes, dmd2.gathered_bytes) == \
            (one.activation_bytes, one.attention_bytes, one.gathered_bytes)
        assert dmd2.startup_bytes - one.startup_bytes == 2 * P * w // n
    adapters, base = 10_000_000, 600_000_000  # LoRA: the student and the critic adapted on a bf16 base
    lora = replace(XL, lora_parameters=adapters, lora_base_parameters=base)
    one = estimate_memory(lora, Layout(), Setup(lora_base_dtype="bfloat16"))
    dmd2 = estimate_memory(lora, Layout(), Setup(lora_base_dtype="bfloat16", distill="dmd2"))
    assert dmd2.weights_bytes == 2 * one.weights_bytes + P * w  # the teacher is built whole, in fp32
    assert dmd2.gradient_bytes == 2 * adapters * w and dmd2.ema_bytes == adapters * w
    # the GAN head: the critic update's two more forwards (real, generated) kept through blocks 0 ... 14 (the middle
    # of 28 and those before it), each block all it keeps, or its input when checkpointed
    D, per_block = XL.hidden_size, 14 * XL.hidden_size + 2 * XL.mlp_hidden
    for checkpointing, kept in ((False, per_block), (True, D)):
        dmd2 = estimate_memory(XL, Layout(), Setup(distill="dmd2", activation_checkpointing=checkpointing))
        gan = estimate_memory(XL, Layout(), Setup(distill="dmd2", gan_loss=True,
                                                  activation_checkpointing=checkpointing))
        assert gan.activation_bytes - dmd2.activation_bytes == 4096 * 2 * 15 * kept * 4
    last = estimate_memory(XL, Layout(), Setup(distill="dmd2", gan_loss=True, gan_block=-1))  # every block
    assert last.activation_bytes - estimate_memory(XL, Layout(), Setup(distill="dmd2")).activation_bytes == \
        4096 * 2 * 28 * per_block * 4
    # the regression loss: the student's update also keeps its forward of the 64 teacher pairs, every block
    regression = estimate_memory(XL, Layout(), Setup(distill="dmd2", regression_pairs=64))
    assert regression.activation_bytes - estimate_memory(XL, Layout(), Setup(distill="dmd2")).activation_bytes == \
        4096 * 64 * 28 * per_block * 4
    sampling = Setup(training=False, distill="dmd2")  # infer.py samples the student alone
    assert estimate_memory(XL, Layout(), sampling) == estimate_memory(XL, Layout(), Setup(training=False))


def test_train_config_and_the_planner_count_dmd2(tmp_path, capsys):
    from ringdit.costs import check_training_memory
    from ringdit.spec import build_on_meta, model_config

    data = {"channels": 1, "image_size": [8, 8], "num_classes": 10}
    estimates = {}
    for distill in ("none", "dmd2"):
        cfg = compose_train([f"distill={distill}"], tmp_path)
        model_cfg = model_config(cfg.model, data)
        layout = Layout.from_config(cfg, training=True)
        estimates[distill] = check_training_memory(cfg, layout, model_cfg, build_on_meta(model_cfg))
    assert estimates["dmd2"].weights_bytes == 3 * estimates["none"].weights_bytes
    assert estimates["dmd2"].optimizer_bytes == 2 * estimates["none"].optimizer_bytes
    code, out, err = plan(capsys, "model=dit_xl", "data.size=512", "gpus=4", "trainer/strategy=ddp", "show=1",
                          "model.activation_checkpointing=false", "optimizer_8bit=false", "model.activation_offload=false")
    code2, out2, err2 = plan(capsys, "model=dit_xl", "data.size=512", "gpus=4", "trainer/strategy=ddp", "show=1",
                             "model.activation_checkpointing=false", "optimizer_8bit=false", "model.activation_offload=false",
                             "distill=dmd2")
    assert code == code2 == 0, err + err2
    assert "distill=dmd2: the student and a critic train, the teacher is frozen" in out2 and "distill" not in out
    state = [float(re.search(r"^\s+4\s+1\s+1 ddp .*?\|\s+\S+\s+\S+\s+(\S+)", text, flags=re.M).group(1))
             for text in (out, out2)]
    assert state[1] > 1.9 * state[0]  # bf16-mixed: fp32 state; two models' of it and a third's weights


def test_the_memory_check_counts_the_pairs_an_update_runs(tmp_path):
    """``distill.regression_batch``: an update runs the student on that many of the pairs, not on all of them."""
    from ringdit.costs.check import regression_pairs_per_update, setup_from_config

    regression = ["distill=dmd2", "distill.regression_loss=true", "distill.regression_pairs=4096"]
    counts = {}
    for name, extra in {"all": [], "batch": ["distill.regression_batch=64"], "off": ["distill.regression_loss=false"]
                        }.items():
        cfg = compose_train([*regression, *extra], tmp_path)
        counts[name] = regression_pairs_per_update(cfg.distill)
        assert setup_from_config(cfg, Layout()).regression_pairs == counts[name]
    assert counts == {"all": 4096, "batch": 64, "off": 0}


def test_ema_off_removes_exactly_the_ema_term():
    for layout in (Layout(), Layout(strategy="fsdp", dp_degree=4)):
        on, off = estimate_memory(XL, layout), estimate_memory(XL, layout, Setup(ema=False))
        assert off.ema_bytes == 0 and on.ema_bytes > 0
        assert on.step_bytes - off.step_bytes == on.ema_bytes
        assert on.startup_bytes - off.startup_bytes == on.ema_bytes


def test_activation_checkpointing_keeps_only_the_block_inputs():
    plain = estimate_memory(XL, Layout())
    checkpointed = estimate_memory(XL, Layout(), Setup(activation_checkpointing=True))
    values, backward, in_flight = 14 * 1152 + 2 * 4608, 2 * 4608, 8_000_000 * 4  # a full fine-tune's block
    assert plain.activation_bytes == 4096 * (28 * values + backward) * 4 + in_flight
    # the 27 earlier blocks' inputs, the last block's activations (recomputed) and backward's working set
    assert checkpointed.activation_bytes == 4096 * (27 * 1152 + values + backward) * 4 + in_flight
    assert checkpointed.activation_bytes < plain.activation_bytes / 5


def test_backward_peaks_in_the_last_block_with_the_earlier_ones_kept():
    """The peak is backward's first block: it holds all of its activations while every earlier block keeps its input
    (checkpointed) or everything; the blocks a share checkpoints are spread evenly, the first one included."""
    size = replace(XL, depth=3, lora_parameters=1_000_000)  # LoRA: 10 x D + 2 x F a block
    block, D, backward = 10 * 1152 + 2 * 4608, 1152, 2 * 4608
    activations = {setting: estimate_memory(size, Layout(), Setup(activation_checkpointing=setting)).activation_bytes
                   // (4096 * 4)
                   for setting in (False, 0.5, True)}
    assert activations[False] == 3 * block + backward
    assert activations[0.5] == D + block + block + backward  # blocks 0 and 2 checkpointed; 0's input, 1's all, 2's all
    assert activations[True] == 2 * D + block + backward
    two = replace(size, depth=2)  # half of 2 blocks: the first; at the peak the same as checkpointing both
    assert estimate_memory(two, Layout(), Setup(activation_checkpointing=0.5)).activation_bytes == \
        estimate_memory(two, Layout(), Setup(activation_checkpointing=True)).activation_bytes \
        == 4096 * (D + block + backward) * 4


def test_a_full_fine_tune_keeps_what_its_weight_gradients_need():
    """Besides a LoRA step's activations, a full fine-tune keeps adaLN's normalized inputs and gated branch outputs
    (4 x D) and the inputs of the Linears LoRA's targets leave out, and under DDP computes a weight's gradient whole
    before adding it to .grad (FSDP counts its unsharded gradients in ``gathered``)."""
    size = replace(XL, depth=2, untargeted_linear_inputs=1152 + 4608)  # Wan-like: the feed-forward is not a target
    lora = replace(size, lora_parameters=1_000_000)
    block, D, F = 10 * 1152 + 2 * 4608, 1152, 4608
    assert estimate_memory(lora, Layout()).activation_bytes == 4096 * (2 * block + 2 * F) * 4
    full = estimate_memory(size, Layout()).activation_bytes
    assert full == 4096 * (2 * (block + 4 * D + D + F) + 2 * F) * 4 + XL.largest_parameter * 4
    fsdp = estimate_memory(size, Layout(strategy="fsdp", dp_degree=2)).activation_bytes
    assert fsdp == full - XL.largest_parameter * 4
    # nothing trains: no gradient's needs
    sampling = estimate_memory(size, Layout(), Setup(training=False)).activation_bytes
    assert sampling == 4096 * block * 4


# ---- train.py's config and models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["activation_checkpointing", "gradient_checkpointing"])
def test_train_config_is_read_as_it_runs(key, tmp_path):
    """model.activation_checkpointing (or its older name) shrinks the activations; the strategy, LoRA and EMA
    settings are the ones train.py runs with."""
    from ringdit.costs import check_training_memory
    from ringdit.spec import build_on_meta, model_config

    data = {"channels": 1, "image_size": [8, 8], "num_classes": 10}
    estimates = {}
    for on in (False, True):
        override = f"+model.{key}={str(on).lower()}" if key == "gradient_checkpointing" else f"model.{key}={on}"
        cfg = compose_train([override.lower()], tmp_path)
        model_cfg = model_config(cfg.model, data)
        layout = Layout.from_config(cfg, training=True)
        estimates[on] = check_training_memory(cfg, layout, model_cfg, build_on_meta(model_cfg))
    assert estimates[True].activation_bytes < estimates[False].activation_bytes
    cfg = compose_train(["trainer/strategy=fsdp", "ema_decay=null", "lora.rank=4"], tmp_path)
    model_cfg = model_config(cfg.model, data)
    sharded = check_training_memory(cfg, Layout.from_config(cfg, training=True), model_cfg, build_on_meta(model_cfg))
    assert sharded.ema_bytes == 0 and sharded.bucket_bytes == 0 and sharded.gathered_bytes > 0
    assert sharded.gradient_bytes < estimates[False].gradient_bytes / 10  # only the adapters train


def test_diffusers_models_are_estimated(tmp_path):
    """Wan's sizes come from its diffusers config; the adapters counted on meta are the ones peft adds."""
    import torch

    from ringdit.models.build import build_model
    from ringdit.models.lora import add_lora
    from ringdit.costs import check_training_memory, model_size
    from ringdit.spec import build_on_meta, model_config

    cfg = compose_train(["experiment=wan_tiny", "lora.rank=4"], tmp_path)
    data = {"conditioning": "text", "image_size": [3, 8, 8], "channels": 4, "text_len": 8, "text_dim": 16}
    model_cfg = model_config(cfg.model, data)
    meta = build_on_meta(model_cfg)
    estimate = check_training_memory(cfg, Layout.from_config(cfg, training=True), model_cfg, meta)
    assert estimate is not None and estimate.activation_bytes > 0
    size = model_size(model_cfg, meta, {"rank": 4})
    assert (size.hidden_size, size.depth, size.num_heads, size.mlp_hidden) == (2 * 12, 2, 2, 32)
    assert size.tokens == 3 * 4 * 4 and size.parameters == sum(p.numel() for p in meta.parameters())
    torch.manual_seed(0)
    real, _ = build_model(model_cfg)
    before = sum(p.numel() for p in real.parameters())
    add_lora(real, rank=4, base_dtype="bfloat16")
    assert size.lora_parameters == sum(p.numel() for p in real.parameters()) - before > 0
    # Wan's feed-forward is no LoRA target: a full fine-tune keeps its inputs, D into the up projection, F into the
    # down one (the attention projections are targets)
    assert size.untargeted_linear_inputs == 2 * 12 + 32
    # what lora.base_dtype casts: every frozen Linear / Conv weight, adapted or not
    assert size.lora_base_parameters == sum(p.numel() for p in real.parameters() if p.dtype == torch.bfloat16)


def test_the_warning_names_a_layout_that_fits(caplog):
    video = ModelSize(parameters=34_000_000, trainable_parameters=34_000_000, largest_parameter=1_000_000,
                      root_parameters=1_000_000, block_parameters=8_000_000, hidden_size=128, depth=4, num_heads=4,
                      mlp_hidden=512, tokens=262_144)
    caplog.set_level(logging.WARNING, logger="ringdit.costs")
    warn_if_memory_short(available=1000 * GiB, model=video, layout=Layout(), setup=Setup(batch_size=32))
    assert "memory:" not in caplog.text
    warn_if_memory_short(available=16 * GiB, model=video, layout=Layout(), setup=Setup(batch_size=32))
    assert re.search(r"memory: about \d+\.\d GiB per rank needed \(262144 tokens per rank .* but 16.0 GiB is "
                     r"available: .* ring_degree=32 \(32 ranks of this size\) would fit.*or set "
                     r"model.activation_checkpointing=true", caplog.text), caplog.text
    caplog.clear()  # a model whose replicated state alone does not fit: FSDP is what fits
    warn_if_memory_short(available=100 * GiB, model=replace(XL, parameters=14_000_000_000,
                                                            trainable_parameters=14_000_000_000, tokens=1024),
                         layout=Layout(dp_degree=8))
    assert "trainer/strategy=fsdp would fit" in caplog.text, caplog.text


# ---- python -m ringdit.plan ----------------------------------------------------------------------------------------


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    from ringdit.plan import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_lays_out_wan_14b_on_16_gpus(capsys):
    code, out, err = plan(capsys, "model=wan_14b", "data.frames=81", "data.size=[480,832]", "gpus=16",
                          "gpu_memory_gb=80")
    assert code == 0, err
    assert "14.29 B parameters" in out and "32760 tokens per sample (21 x 30 x 52" in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+) (ddp|fsdp)\s+(\S.*?)\s+\|", out, flags=re.M)
    assert len(rows) == len(set(rows)) == 2 * 12  # the 12 best that fit, the 12 nearest that do not
    assert all(int(dp) * int(ring) * int(ulysses) == 16 and 40 % int(ulysses) == 0 for dp, ring, ulysses, *_ in rows)
    # (dp, ring, ulysses): all 15 (ulysses up to the 40 heads), x 2 strategies x 5 checkpointing / offload x 2 optimizers
    fit, short = re.search(r"\.\.\. and (\d+) more that fit", out), re.search(r"\(12 nearest of (\d+)\)", out)
    assert int(fit.group(1)) + 12 + int(short.group(1)) == 15 * 2 * 5 * 2
    recommended = re.search(r"^Recommended: dp=(\d+) ring=(\d+) ulysses=(\d+) fsdp", out, flags=re.M)
    assert recommended and re.search(r"^Why: FSDP, as replicated \(DDP\) state would need", out, flags=re.M)


@pytest.mark.parametrize("model, frames, tokens", [([], 81, "32760 tokens per sample (21 x 30 x 52"),
                                                   (["model=hunyuan_video15"], 121, "tokens per sample (31 x ")])
def test_plan_without_frames_lays_out_the_pipelines_clip(model, frames, tokens, capsys):
    """The bare command (the README's) plans Wan 14B's 81 frames, WanPipeline's num_frames, and says so."""
    code, out, err = plan(capsys, *model, "show=1")
    assert code == 0, err
    assert tokens in out and f"{frames} frames: the pipeline's clip; data.frames= to change it" in out


def test_plan_counts_the_latent_frame_cogvideox_pads_in_front(capsys):
    """81 frames are 21 latent frames, padded to 22 as prepare pads them (CogVideoX 1.5's temporal patch of 2)."""
    code, out, err = plan(capsys, "model=cogvideox15", "data.frames=81", "data.size=[768,1360]", "show=1")
    assert code == 0, err
    assert "44880 tokens per sample (11 x 48 x 85 of the input [22, 96, 170])" in out


def test_plan_of_a_tiny_model(capsys):
    code, out, err = plan(capsys, "model=dit_digits", "data.latent=false", "data.size=8", "gpus=2",
                          "data.batch_size=128", "ema_decay=null")
    assert code == 0, err
    assert "16 tokens per sample" in out and "no EMA" in out
    assert re.search(r"^Recommended: dp=2 ring=1 ulysses=1 ddp", out, flags=re.M), out


@pytest.mark.parametrize("argv, message", [
    (["gpus=0"], "gpus must be a positive integer, got 0; the GPUs to lay out, e.g. gpus=16"),
    (["gpus=-3"], "gpus must be a positive integer, got -3"),
    (["gpu_memory_gb=abc"], "gpu_memory_gb must be a number above 0, got 'abc'; e.g. gpu_memory_gb=80"),
    (["data.frames=0"], "data.frames must be a positive integer, got 0; the frames of a video sample, e.g. 81"),
    (["model=dit_video", "data.latent=false", "data.size=16"], "data.frames must be a positive integer, got None"),
    # the pipeline's clip is counted in pixel frames: no default for sizes that are the model's input already
    (["model=wan_14b", "data.latent=false", "data.size=[60,104]"], "data.frames must be a positive integer, got None"),
    (["data.frames=80"], "data.frames=80 is not a frame count wan's VAE takes: 1 + k x 4 (the VAE's temporal "
                         "compression 4); the nearest valid counts are 77 and 81"),
    # 85 frames are 22 latent frames, which CogVideoX's VAE would decode to 88; prepare refuses them too
    (["model=cogvideox15", "data.frames=85"], "data.frames=85 is not a frame count cogvideox15's VAE takes: 1 + k x 8"),
    (["model=wan_15b"], "model=wan_15b: no such option; did you mean model=wan_14b?"),
    (["model=dit_xl", "data.frames=16"], "data.frames=16 but model=dit_xl is an image model; leave data.frames null"),
    (["gpus=8", "trainer.strategy.replicate_degree=3"], "trainer.strategy.replicate_degree=3 does not divide gpus=8"),
    # the sweep of every key (wrong types, out of range, empty, huge): what once slipped through or named nothing
    (["data.size=1.5"], "data.size must be H, W in pixels (or one integer for a square), each from 1 to 16384, got 1.5"),
    (["data.size=10000000000000"], "data.size must be H, W in pixels (or one integer for a square), each from 1 to "
                                   "16384, got 10000000000000"),
    (["optimizer_8bit=1"], "optimizer_8bit must be one of null | true | false, got 1"),
    (["model.activation_offload=0"], "model.activation_offload must be one of null | true | false, got 0"),
    (["data.latent=0"], "data.latent must be one of true | false, got 0"),
    (["optimizer=sgd", "optimizer.momentum=abc"], "optimizer.momentum must be a finite number, got 'abc'"),
    (["optimizer=sgd", "optimizer.momentum=-1"], "optimizer.momentum must be in [0, inf], got -1"),
    (["gpus=1e30"], "gpus must be a positive integer, got 1e+30"),
    (["data.frames=81", "ring_degree=10000000000000"], "ring_degree=10000000000000 does not divide gpus=8; with the "
                                                        "others free, use ring_degree=1, 2, 4 or 8"),
])
def test_plan_refuses_bad_input_in_one_line(argv, message, capsys):
    code, out, err = plan(capsys, *argv)
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and not out


@pytest.mark.parametrize("model, size, fix", [
    (["model=dit_xl"], "[100,200]", "[96,192]"),  # the VAE's 8 x the patch's 2: 96 x 200 would not do either
    (["model=wan_14b", "data.frames=81"], "[480,830]", "[480,832]"),
    (["model=dit_digits", "data.latent=false"], "[1,2]", "[2,2]"),
])
def test_a_size_the_patch_does_not_divide_is_refused_with_one_that_works(model, size, fix, capsys):
    code, out, err = plan(capsys, *model, f"data.size={size}", "show=1")
    assert code == 2 and f"use data.size={fix}" in err, err
    code, out, err = plan(capsys, *model, f"data.size={fix}", "show=1")
    assert code == 0, err


def test_plan_of_a_huge_gpu_count_is_quick(capsys):
    """10**13 GPUs: their divisors are found in sqrt time, and the plan is one like any other."""
    import time

    start = time.perf_counter()
    code, out, err = plan(capsys, "model=dit_digits", "data.latent=false", "data.size=8", "show=1",
                          "gpus=10000000000000")
    assert code == 0 and "Recommended: dp=10000000000000 ring=1 ulysses=1" in out, err
    assert time.perf_counter() - start < 10


def test_plan_is_a_hydra_app_like_every_command(capsys, tmp_path, monkeypatch):
    """--help (the docstring, the settings with their comments), a misspelt key with a hint; nothing written."""
    import ringdit.plan

    monkeypatch.chdir(tmp_path)
    code, out, _ = plan(capsys, "--help")
    assert code == 0 and out.startswith(ringdit.plan.__doc__.strip().splitlines()[0])
    assert "gpu_memory_gb: 80     # memory of one GPU, GiB" in out
    code, _, err = plan(capsys, "gpu=4")
    assert code == 2 and err.startswith("Error: no setting named 'gpu'; did you mean gpus? (python -m ringdit.plan")
    assert list(tmp_path.iterdir()) == []
