"""HunyuanVideo 1.5 image-to-video (``model=hunyuan_video15_i2v*``; diffusers' ``HunyuanVideo15ImageToVideoPipeline``):
in fp64 the model equals the unmodified diffusers transformer under ring 2 and ring 2 x Ulysses 2, forward and every
parameter gradient, given [video ; first-frame latents ; mask] on the channels and SigLIP states beside the text;
``prepare task=i2v`` stores the image latents and SigLIP states the pipeline computes (and infer.py ``image=`` encodes
the same); prepare -> train.py -> infer.py ``image=`` on a tiny random pipeline folder; what a user can get wrong is
refused in one line. (Its samples equal the pipeline's: tests/test_diffusers_schedulers.py, ``hunyuan_i2v``.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from ringdit.models import parallelize  # noqa: E402
from ringdit.parallel import init_sequence_parallel  # noqa: E402
from tests.diffusers_helpers import forward_backward  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.families import assert_refused_before_spawning  # noqa: E402
from tests.helpers import (TEXT_LEN, architecture, assert_refused, assert_same_numbers, fail_fast,  # noqa: E402
                           first_frame, read_prepared, run, save_tiny_hunyuan_video15, write_video)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = (3, 3, 3)  # latents (T, H, W), 1x1x1 patches: 27 tokens, tail-padded at ring 2 and at ring 2 x Ulysses 2
IMAGE_TOKENS = 4  # SigLIP-like states (B, 4, 12): unmasked keys beside the 5 text tokens and the masked glyph token
# fp64 on both sides. What differs is the order of some sums (GEMMs of other shapes, the ring's merges), ~1e-16; but
# the processor rounds q and k to fp32 around RoPE on both sides, so a ~1e-16 difference can flip one fp32 rounding
# (~6e-8 of that element): measured 0 on one process, <= 1.5e-15 of the largest value under ring 2 (x Ulysses 2). 1e-10 is far below what a wrong mask, channel
# order, shard or gradient would give (>= 1e-3).
OF_MAX = 1e-10


def i2v_case(seed: int = 0, dims=None):
    """An unmodified diffusers reference and a ringdit model with its weights, both fp64, and the two calls: the
    reference gets the inputs as HunyuanVideo15ImageToVideoPipeline builds them (built here independently), ringdit
    gets (x, t, cond)."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    config = architecture("hunyuan_video15_i2v_tiny")
    torch.manual_seed(seed)
    reference = diffusers.HunyuanVideo15Transformer3DModel.from_config(config).double()
    model = DiffusersTransformer("hunyuan_video15_i2v", config=config, input_size=SHAPE, in_channels=4,
                                 text_len=5, text_dim=16).double()
    model.transformer.load_state_dict(reference.state_dict())
    parallelize(model, dims=dims)  # dims None: one process, attention still routed to ringdit
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64)
    t = torch.tensor([30.0, 810.0], dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])  # the second prompt padded
    text = torch.randn(2, 5, 16, generator=g, dtype=torch.float64) * mask[..., None]
    image_latents = torch.randn(2, 4, 1, *SHAPE[1:], generator=g, dtype=torch.float64)
    image_embeds = torch.randn(2, IMAGE_TOKENS, 12, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 4, *SHAPE, generator=g, dtype=torch.float64)
    # the pipeline's prepare_cond_latents_and_mask: the image's latents repeated over the frames, zeroed after the
    # first; the mask 1 on the first latent frame; latent_model_input = cat([latents, cond_latents, mask])
    cond_latents = image_latents.repeat(1, 1, SHAPE[0], 1, 1)
    cond_latents[:, :, 1:] = 0
    cond_mask = torch.zeros(2, 1, *SHAPE, dtype=torch.float64)
    cond_mask[:, :, 0] = 1.0

    def run_reference():  # no quoted text: one masked zero ByT5 token, as the pipeline's for such a prompt
        return reference(hidden_states=torch.cat([x, cond_latents, cond_mask], dim=1), timestep=t,
                         encoder_hidden_states=text, encoder_attention_mask=mask,
                         encoder_hidden_states_2=torch.zeros(2, 1, 8, dtype=torch.float64),
                         encoder_attention_mask_2=torch.zeros(2, 1, dtype=torch.bool), image_embeds=image_embeds,
                         return_dict=False)[0]

    cond = {"text": text, "text_mask": mask, "image_latents": image_latents, "image_embeds": image_embeds}
    return reference, model, run_reference, lambda: model(x, t, cond), dout


def assert_matches_diffusers(out, grads, ref_out, ref_grads, where=""):
    """Within OF_MAX of the largest value, the output and each gradient. The token refiner's key biases get a zero
    gradient (softmax does not change when every key of a row moves by the same q.b: tests/test_hunyuan_video.py),
    so both sides hold rounding noise there: it must be that small next to the same projection's weight gradient."""
    grads, ref_grads = dict(grads), dict(ref_grads)
    for name in [name for name in ref_grads if name.startswith("context_embedder.") and name.endswith("to_k.bias")]:
        scale = ref_grads[name.replace(".bias", ".weight")].abs().max()
        for side in (grads, ref_grads):
            assert side.pop(name).abs().max() <= 1e-12 * scale, f"{where} {name}: a key bias gradient is not ~0"
    difference = (out - ref_out).abs().max() / ref_out.abs().max()
    worst = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items()
                if g is not None and g.abs().max() > 0)
    print(f"{where}: output {difference:.1e}, gradients <= {worst:.1e} of their largest value")
    assert_same_numbers(out, ref_out, of_max=OF_MAX, where=f"{where} output")
    assert_same_numbers(grads, ref_grads, of_max=OF_MAX, where=f"{where} gradient")
    assert ref_grads["image_embedder.linear_1.weight"].abs().max() > 0  # the image keys were read (and learn)
    assert ref_grads["x_embedder.proj.weight"][:, 4:].abs().max() > 0  # ... and the condition channels


def check_layouts(rank, world):
    for ring, ulysses in [(2, 1), (2, 2)]:  # on 4 ranks: 2 replicas of a ring of 2; one ring of 2 x Ulysses 2
        reference, model, run_reference, run_model, dout = i2v_case(dims=init_sequence_parallel(ring, ulysses))
        ref_out, ref_grads = forward_backward(run_reference, reference, dout)
        out, grads = forward_backward(run_model, model.transformer, dout)
        for grad in (g for g in grads.values() if g is not None):  # DDP's average over the dp x sp ranks
            dist.all_reduce(grad)
            grad /= world
        assert_matches_diffusers(out, grads, ref_out, ref_grads, f"ring {ring} x ulysses {ulysses}")


def test_i2v_matches_unmodified_diffusers_on_one_process_and_under_ring_and_usp():
    reference, model, run_reference, run_model, dout = i2v_case()
    ref_out, ref_grads = forward_backward(run_reference, reference, dout)
    out, grads = forward_backward(run_model, model.transformer, dout)
    assert_matches_diffusers(out, grads, ref_out, ref_grads, "one process")
    run_ranks(check_layouts, 4)


# ---- prepare, train.py, infer.py image= -----------------------------------------------------------------------------

VIDEO = {"size": 16, "frames": 5, "max_text_len": TEXT_LEN, "prompt_template": "hunyuan_video15"}  # 3x4x4


@pytest.fixture(scope="module")
def hunyuan_i2v(tmp_path_factory) -> Path:
    """A HunyuanVideo 1.5 I2V pipeline folder of tiny random models, its SigLIP image encoder included
    (``tests.helpers.save_tiny_hunyuan_video15``)."""
    return save_tiny_hunyuan_video15(tmp_path_factory.mktemp("hunyuan_i2v") / "HunyuanVideo-1.5-480p_i2v", image=True)


def test_prepare_train_and_sample_with_an_image(hunyuan_i2v, tmp_path):
    """prepare task=i2v: image_latents are the pipeline's _get_image_latents of the clip's first frame (as its bucket
    shows it), image_embeds its _get_image_embeds (SigLIP's last hidden state), and encode_image_condition (infer.py
    image=) gives the same rows; train.py takes 2 steps on them; infer.py samples from an image, and without one
    refuses prompts in one line."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessor, SiglipVisionModel

    from ringdit.media.encode_folder import encode_folder
    from ringdit.media.frames import fit
    from ringdit.media.image_condition import encode_image_condition

    clips = tmp_path / "clips"
    clips.mkdir()
    for name, seed, caption in (("a", 1, "a red fox running"), ("b", 2, "a blue cat"), ("c", 3, "green field"),
                                ("d", 4, "a red sky")):
        write_video(clips / f"{name}.mp4", 6, seed=seed, size=(24, 16))
        (clips / f"{name}.txt").write_text(caption)
    data = tmp_path / "data"
    report = encode_folder(str(clips), str(data), str(hunyuan_i2v), str(hunyuan_i2v), task="i2v",
                           image_encoder=str(hunyuan_i2v), progress=False, **VIDEO)
    assert report.samples == 4
    tensors, metadata = read_prepared(data / "shard-00000.safetensors")
    assert tensors["image_latents"].shape == (4, 4, 1, 4, 4) and tensors["image_embeds"].shape == (4, 16, 12)
    assert json.loads(metadata["image_encoder"])["class"] == "SiglipVisionModel"

    pipe = HunyuanVideo15ImageToVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=None, scheduler=None, text_encoder_2=None, tokenizer_2=None,
        guider=None, vae=AutoencoderKLHunyuanVideo15.from_pretrained(hunyuan_i2v / "vae").eval(),
        image_encoder=SiglipVisionModel.from_pretrained(hunyuan_i2v / "image_encoder").eval(),
        feature_extractor=SiglipImageProcessor.from_pretrained(hunyuan_i2v / "feature_extractor"))
    images = [fit(first_frame(clips / f"{name}.mp4"), 16, 16) for name in "abcd"]  # the bucket's crop, 16 x 16
    cpu = torch.device("cpu")
    with torch.no_grad():
        for row, image in enumerate(images):
            latents = pipe._get_image_latents(pipe.vae, pipe.video_processor, image, 16, 16, cpu)  # (1, 4, 1, 4, 4)
            embeds = pipe._get_image_embeds(pipe.image_encoder, pipe.feature_extractor, image, cpu)  # (1, 16, 12)
            torch.testing.assert_close(tensors["image_latents"][row], latents[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tensors["image_embeds"][row], embeds[0], rtol=1e-5, atol=1e-5)
    cond = encode_image_condition([first_frame(clips / f"{name}.mp4") for name in "abcd"],
                                  vae_folder=str(hunyuan_i2v / "vae"), frames=5, size=(16, 16),
                                  image_encoder=str(hunyuan_i2v))
    for key in ("image_latents", "image_embeds"):
        torch.testing.assert_close(cond[key], tensors[key], rtol=1e-5, atol=1e-5)

    run("train.py", tmp_path / "train", "model=hunyuan_video15_i2v_tiny", "data=text_latents", f"data.path={data}",
        "data.batch_size=2", "data.val_fraction=0.25", "trainer=cpu", "trainer.max_steps=2", "logger=csv",
        "~callbacks.sample_grid", env={"HF_HUB_OFFLINE": "1"})
    ckpt = tmp_path / "train" / "checkpoints" / "last.ckpt"
    images[0].save(tmp_path / "first.png")
    run("infer.py", tmp_path / "infer", f"ckpt_path={ckpt}", f"image={tmp_path / 'first.png'}", "num_samples=2",
        "diffusion.sampling.steps=2", "diffusion.sampling.cfg_scale=6", "prompts=['a red fox running']",
        env={"HF_HUB_OFFLINE": "1"})
    samples = np.load(tmp_path / "infer" / "samples.npz")
    assert samples["latents"].shape == (2, 4, 3, 4, 4) and np.isfinite(samples["latents"]).all()
    assert (tmp_path / "infer" / "sample-001.mp4").is_file()  # decoded by the data's VAE

    proc, seconds = fail_fast("infer.py", f"ckpt_path={ckpt}", "prompts=['a red fox']",
                              f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, r"is an image-to-video model \(model.family=hunyuan_video15_i2v\): give the first "
                         r"frame\(s\) with image=", seconds=seconds)


# ---- refusals -------------------------------------------------------------------------------------------------------

I2V = ["model=hunyuan_video15_i2v_tiny", "data=synthetic_text_latents", "data.num_samples=8"]
BAD_INPUTS = {
    "text-to-video data": ([], r"model.family=hunyuan_video15_i2v is image-to-video but the data has no "
                               r"'image_latents' \(the first frame's latents"),
    "no image embeddings": (["data.image=true"], r"model.config.image_embed_dim=12: the model takes image embeddings "
                                                r"but the data has no 'image_embeds'; prepare with image_encoder="),
    "a text-to-video architecture": (["data.image=true", "data.image_dim=12", "model.config.in_channels=8"],
                                     r"in_channels must be 2 \* out_channels \+ 1 = 9, got 8"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_i2v_training_input_is_refused_before_spawning(case, tmp_path):
    overrides, message = BAD_INPUTS[case]
    assert_refused_before_spawning(tmp_path, [*I2V, *overrides], message)


def test_image_embeddings_of_another_width_are_refused():
    """Image embeddings of another width than the model's image_embed_dim: one line, not an error deep in a norm."""
    _, model, _, _, _ = i2v_case()
    x, t = torch.zeros(1, 4, *SHAPE, dtype=torch.float64), torch.tensor([500.0], dtype=torch.float64)
    cond = {"text": torch.zeros(1, 5, 16, dtype=torch.float64), "text_mask": torch.ones(1, 5, dtype=torch.bool),
            "image_latents": torch.zeros(1, 4, 1, *SHAPE[1:], dtype=torch.float64),
            "image_embeds": torch.zeros(1, IMAGE_TOKENS, 16, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"image_embeds have shape \(1, 4, 16\); expected \(1, N, 12\)"):
        model(x, t, cond)
