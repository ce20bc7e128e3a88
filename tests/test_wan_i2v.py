"""Image-to-video Wan (issue 24): Wan 2.2 TI2V (the clean first latent frame, per-token timesteps, the loss over the
noised frames) and Wan 2.1 I2V ([video ; mask ; first-frame latents] on the channels, CLIP image embeddings as
cross-attention keys). The conditioning is what diffusers' WanImageToVideoPipeline feeds the transformer; under every
layout the model matches the unmodified diffusers model; train.py takes the same SGD steps on one process and a ring
of 2; what a user can get wrong is refused in one line before anything starts."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ringdit.models import parallelize
from ringdit.parallel import init_sequence_parallel
from tests.diffusers_helpers import (LAYOUTS, assert_matches_diffusers, forward_backward, per_token_timesteps,
                                     recorded_calls)
from tests.distributed import run_ranks
from tests.families import assert_refused_before_spawning, assert_sgd_steps_equal_one_process_and_ring2
from tests.helpers import WAN, architecture, assert_refused, fail_fast, run

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = (3, 6, 6)  # latents (T, H, W): 27 tokens of 1x2x2 patches, tail-padded on every layout
IMAGE_TEXT_LEN = 512  # with image keys, Wan's attention processor takes the last 512 keys as the text
PRESETS = {"wan_i2v": "wan_i2v_tiny", "wan22_ti2v": "wan22_ti2v_tiny"}


def image_case(family: str, seed: int = 0, dims=None):
    """An unmodified diffusers reference, a ringdit model with its weights, and the two calls: the reference gets the
    inputs built here independently (as the pipeline builds them), ringdit gets (x, t, cond)."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    config = architecture(PRESETS[family])
    torch.manual_seed(seed)
    reference = diffusers.WanTransformer3DModel.from_config(config)
    text_len = IMAGE_TEXT_LEN if family == "wan_i2v" else 7
    model = DiffusersTransformer(family, config=config, input_size=SHAPE, in_channels=4, text_len=text_len,
                                 text_dim=16)
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *SHAPE, generator=g)
    t = torch.tensor([30.0, 810.0])
    cond = {"text": torch.randn(2, text_len, 16, generator=g)}
    if family == "wan_i2v":  # CLIP-like image states (B, 4, image_dim) and the [first frame ; zeros] latents
        cond["image_condition"] = torch.randn(2, 4, *SHAPE, generator=g)
        cond["image_embeds"] = torch.randn(2, 4, config["image_dim"], generator=g)
        mask = torch.zeros(2, 4, *SHAPE)
        mask[:, :, 0] = 1  # the pipeline's mask: its first latent frame (4 pixel frames) given
        inputs = {"hidden_states": torch.cat([x, mask, cond["image_condition"]], dim=1), "timestep": t,
                  "encoder_hidden_states_image": cond["image_embeds"]}
    else:  # the first frame's latents replace the noisy ones; their tokens at timestep 0
        cond["image_latents"] = torch.randn(2, 4, 1, *SHAPE[1:], generator=g)
        inputs = {"hidden_states": torch.cat([cond["image_latents"], x[:, :, 1:]], dim=2),
                  "timestep": per_token_timesteps(SHAPE, t)}
    dout = torch.randn(2, 4, *SHAPE, generator=g)

    def run_reference():
        return reference(encoder_hidden_states=cond["text"], return_dict=False, **inputs)[0]

    return reference, model, run_reference, lambda: model(x, t, cond), dout


def check_image_layouts(rank, world):
    for ring, ulysses in LAYOUTS:
        dims = init_sequence_parallel(ring, ulysses)
        for family in PRESETS:
            reference, model, run_reference, run_model, dout = image_case(family, dims=dims)
            ref_out, ref_grads = forward_backward(run_reference, reference, dout)
            out, grads = forward_backward(run_model, model.transformer, dout)
            for grad in (g for g in grads.values() if g is not None):  # DDP's average over the dp x sp ranks
                dist.all_reduce(grad)
                grad /= world
            assert_matches_diffusers(out, grads, ref_out, ref_grads, f"{family}, ring {ring} x ulysses {ulysses}")


def test_image_to_video_matches_unmodified_diffusers_under_every_layout():
    """fp32 tolerances of tests/test_diffusers_models.py (the same reasoning): I2V with CLIP image keys (512 text
    keys + 4 image keys, local to each rank) and TI2V with per-token timesteps, 27 tokens padded on every layout."""
    run_ranks(check_image_layouts, 4)


@pytest.mark.parametrize("family", list(PRESETS))
def test_image_to_video_one_process_equals_diffusers(family):
    reference, model, run_reference, run_model, dout = image_case(family)
    ref_out, ref_grads = forward_backward(run_reference, reference, dout)
    out, grads = forward_backward(run_model, model.transformer, dout)
    assert_matches_diffusers(out, grads, ref_out, ref_grads)
    # the image keys' own weights learn: they got a gradient (I2V), and the reference's equal ours (above)
    if family == "wan_i2v":
        assert grads["condition_embedder.image_embedder.ff.net.0.proj.weight"].abs().max() > 0


# ---- the conditioning, as diffusers' WanImageToVideoPipeline builds it ----------------------------------------------


def tiny_pipeline(transformer, expand_timesteps: bool):
    """WanImageToVideoPipeline with a tiny random Wan VAE (4 latent channels, 8x spatial, 4x temporal) and no text
    encoder (the test passes prompt embeddings)."""
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                     latents_std=[1.5, 0.5, 2.0, 1.0])
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return diffusers.WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler,
                                             transformer=transformer, expand_timesteps=expand_timesteps)


@pytest.mark.parametrize("family", list(PRESETS))
def test_conditioning_is_what_the_diffusers_pipeline_feeds_the_transformer(family):
    """Two guided steps of the pipeline at 9 frames of 32 x 32 (latents 3 x 4 x 4): at each transformer call ringdit's
    model, given the latents, model time and the image keys, hands the transformer the same input channels (I2V: the
    mask), first frame (TI2V), per-token timesteps and image embeddings; both halves of guidance keep the image;
    TI2V's finished sample carries the image latents as its first frame, as the pipeline's last blend does."""
    from PIL import Image

    from ringdit.diffusion.samplers import _cat_conditions
    from ringdit.models.diffusers import DiffusersTransformer

    i2v = family == "wan_i2v"
    ours = DiffusersTransformer(family, config=architecture(PRESETS[family]),
                                text_len=IMAGE_TEXT_LEN if i2v else 8, text_dim=16)
    pipe = tiny_pipeline(ours.transformer, expand_timesteps=not i2v)
    g = torch.Generator().manual_seed(1)
    text, negative = torch.randn(2, 1, ours.null_text.shape[1], 16, generator=g)
    embeds = torch.randn(1, 4, 16, generator=g)
    pipe.encode_image = lambda image, device: embeds  # CLIP is prepare's (tests/test_prepare_i2v.py)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    calls = recorded_calls(ours.transformer)
    before_blend = []
    result = pipe(image=image, prompt_embeds=text, negative_prompt_embeds=negative, height=32, width=32, num_frames=9,
                  num_inference_steps=2, guidance_scale=2.0, output_type="latent",
                  callback_on_step_end=lambda p, i, t, kwargs: before_blend.append(kwargs["latents"]) or kwargs)
    pipeline_calls = list(calls)
    assert len(pipeline_calls) == 4  # 2 steps x (conditional, unconditional)
    for call in pipeline_calls:
        hidden, timestep = call["hidden_states"], call["timestep"]
        calls.clear()
        if i2v:  # (1, 4 + 4 + 4, 3, 4, 4): [latents ; mask ; the image's latent condition]
            x, cond = hidden[:, :4], {"image_condition": hidden[:, 8:], "image_embeds": embeds}
            t = timestep  # (1,)
            assert torch.equal(call["encoder_hidden_states_image"], embeds)  # the unconditional half too
        else:  # (1, 4, 3, 4, 4) with the image latents as its first frame; (1, 12) timesteps, 0 on its 4 tokens
            x = hidden.clone()
            x[:, :, 0] = torch.randn(x[:, :, 0].shape, generator=g)  # what a sampler holds there: anything
            cond = {"image_latents": hidden[:, :, :1]}
            t = timestep.amax(dim=1)
            assert (timestep[:, :4] == 0).all() and (timestep[:, 4:] > 0).all()
        ours(x, t, {"text": call["encoder_hidden_states"], **cond})
        assert torch.equal(calls[0]["hidden_states"], hidden)
        assert torch.equal(calls[0]["timestep"], timestep)
        if i2v:
            assert torch.equal(calls[0]["encoder_hidden_states_image"], embeds)
    # classifier-free guidance's unconditional half: the null (empty prompt) text, the same image
    cond = ours.model_condition({"text": text, **cond})
    both = _cat_conditions(cond, ours.model_condition(ours.null_condition(1)))
    assert torch.equal(both["text"][1:], ours.null_text)
    for key in cond.keys() - {"text"}:
        assert torch.equal(both[key][:1], both[key][1:])
    if not i2v:
        assert torch.equal(ours.with_condition_frames(before_blend[-1], cond), result.frames)
        assert ours.loss_weights(result.frames).flatten().tolist() == [0.0, 1.0, 1.0]


def test_the_i2v_mask_channels_are_the_pipelines():
    """The 4 mask channels at another frame count (21 latent frames, Wan's 81 video frames): the pipeline's steps."""
    from ringdit.models.diffusers.image_to_video import channel_mask

    pipe = tiny_pipeline(None, expand_timesteps=False)
    image = torch.rand(1, 3, 16, 16) * 2 - 1
    _, condition = pipe.prepare_latents(image, 1, 4, 16, 16, 81, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert torch.equal(channel_mask(condition[:, 4:].shape), condition[:, :4])


# ---- through train.py and infer.py ----------------------------------------------------------------------------------

TI2V = [*WAN, "model.family=wan22_ti2v", "data.image=true"]


def test_ti2v_sgd_steps_equal_one_process_and_ring2_and_samples_keep_the_first_frame(tmp_path):
    """The same 3 SGD steps on one process and ring 2 (tests/families.py), then held-out samples: each one's first
    frame is its held-out video's image latents; image= on it is checked before anything starts."""
    from PIL import Image

    from ringdit.data.text_latents import TextLatentsDataModule

    assert_sgd_steps_equal_one_process_and_ring2(tmp_path, TI2V, steps=3)
    ckpt = tmp_path / "ring1" / "checkpoints" / "last.ckpt"
    run("infer.py", tmp_path / "infer", f"ckpt_path={ckpt}", "num_samples=3", "diffusion.sampling.steps=2",
        "diffusion.sampling.cfg_scale=4")
    samples = np.load(tmp_path / "infer" / "samples.npz")["latents"]  # (3, 4, 3, 8, 8)
    data = next((tmp_path / "data").glob("synthetic-*image*.safetensors"))
    held_out, _ = TextLatentsDataModule(str(data), val_fraction=0.05, seed=0).held_out(3)
    np.testing.assert_array_equal(samples[:, :, :1], held_out["image_latents"].numpy())
    assert not np.allclose(samples[:, :, 1:], 0)

    Image.new("RGB", (16, 8)).save(tmp_path / "wide.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    for overrides, message in (
        ([f"text_embeds={data}"], r"is an image-to-video model .* give the first frame\(s\) with image="),
        ([f"image={tmp_path / 'broken.png'}"], r"broken.png is not a readable image"),
        ([f"image={tmp_path / 'wide.png'}"], r"wide.png is 16x8 \(W x H\) but the samples are 8x8: a different "
                                             r"aspect ratio; crop the image"),
        ([f"image={tmp_path / 'none'}"], r"none does not exist"),
    ):
        proc, seconds = fail_fast("infer.py", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'refused'}", *overrides)
        assert_refused(proc, message, seconds=seconds)


BAD_IMAGE_TRAINING = {
    "TI2V data without first frames": (
        ["model.family=wan22_ti2v"], r"model.family=wan22_ti2v is image-to-video but the data has no 'image_latents'"),
    "I2V on a text-to-video architecture": (["model.family=wan_i2v", "data.image=true"],
                                            r"in_channels must be 2 \* out_channels \+ 4 = 12, got 4"),
    "I2V without CLIP embeddings": (["model.family=wan_i2v", "model.config.in_channels=12", "data.image=true",
                                     "+model.config.image_dim=16", "+model.config.added_kv_proj_dim=24"],
                                    r"model.config.image_dim=16: .* the data has no 'image_embeds'"),
    "I2V with short captions": (["model.family=wan_i2v", "model.config.in_channels=12", "data.image=true",
                                 "data.image_dim=16", "+model.config.image_dim=16",
                                 "+model.config.added_kv_proj_dim=24"],
                                r"the data's captions are 8 tokens; encode them padded to 512"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGE_TRAINING))
def test_image_to_video_bad_training_input_is_refused_before_spawning(case, tmp_path):
    overrides, message = BAD_IMAGE_TRAINING[case]
    assert_refused_before_spawning(tmp_path, [*WAN, *overrides], message)


def test_image_on_a_text_to_video_model_is_refused(tmp_path):
    run("train.py", tmp_path / "t2v", *WAN, "trainer.max_steps=1", f"data.cache_dir={tmp_path / 'data'}")
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "first.png")
    proc, seconds = fail_fast("infer.py", f"ckpt_path={tmp_path / 't2v' / 'checkpoints' / 'last.ckpt'}",
                              f"image={tmp_path / 'first.png'}", f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, r"is not an image-to-video model \(model.family=wan: it takes no image\)", seconds=seconds)
