"""``sampler=flow_euler / unipc / dpmpp``: diffusers' flow schedulers (``ringdit.diffusion.schedulers``) against the
diffusers pipelines themselves. For the same initial latents, prompt embeddings and scheduler, ``DiffusionModule
.generate`` (infer.py's and the previews' path) gives the latents ``WanPipeline``, ``WanImageToVideoPipeline`` (Wan
2.2 TI2V-5B's, ``expand_timesteps=True``), ``FluxPipeline``, ``LTXPipeline``, ``HunyuanVideo15Pipeline`` and
``HunyuanVideo15ImageToVideoPipeline`` give (``output_type="latent"``), with tiny random components, in fp64: on one
process, at ring 2, with CFG parallel, with step caching and with two experts. Bad sampler settings are refused before
spawning."""

from __future__ import annotations

import copy
import functools
import json
import os

import pytest
import torch

from tests.helpers import architecture, assert_refused, fail_fast, save_tiny_wan

pytest.importorskip("diffusers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 3  # UniPC / DPM-Solver++ are second order: steps 2 and 3 use the history of predictions
SEEDS = [3, 4]
# fp64 models. What differs between the two sides is the order of some sums (CFG's two halves in one batch here,
# two forwards in the pipelines; the ring's merges at ring 2): ~1e-16 of the largest value, measured <= 6e-16.
# 1e-10 is far below anything a wrong sigma, timestep, expert, guidance or multistep history would give (>= 1e-4).
OF_MAX = 1e-10


def _text(generator, length, width, mask=None):
    text = torch.randn(2, length, width, generator=generator, dtype=torch.float64)
    return text if mask is None else text * mask[..., None]


@functools.cache
def case(name: str):
    """(references, model (unparallelized, fp64), condition, negative, shape, objective, sampling, guidance): the
    diffusers transformer(s) and ringdit's model with the same weights, and the run's settings."""
    import diffusers

    from ringdit.models.diffusers import DiffusersTransformer

    g = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    if name in ("wan", "wan_experts", "wan_expand"):  # wan_expand: WanPipeline(expand_timesteps=True), TI2V-5B's T2V
        shape, config = (2, 4, 4), architecture("wan_tiny")
        experts = 2 if name == "wan_experts" else 1
        references = [diffusers.WanTransformer3DModel.from_config(config).double() for _ in range(experts)]
        model = DiffusersTransformer("wan", config=config, input_size=shape, in_channels=4, text_len=7, text_dim=16,
                                     boundary_ratio=0.875 if name == "wan_experts" else None)
        condition, negative = {"text": _text(g, 7, 16)}, {"text": _text(g, 7, 16)}
        objective = {"shift": 3.0}
        sampling = {"shift": 3.0, "cfg_scale": 5.0, "cfg_scale_2": 3.0 if name == "wan_experts" else None}
    elif name == "flux":
        shape, config = (8, 8), architecture("flux_tiny")
        references = [diffusers.FluxTransformer2DModel.from_config(config).double()]
        model = DiffusersTransformer("flux", config=config, input_size=shape, in_channels=1, text_len=5, text_dim=32,
                                     pooled_dim=32)
        condition = {"text": _text(g, 5, 32), "pooled": torch.randn(2, 32, generator=g, dtype=torch.float64)}
        negative, objective = None, {"shift": "resolution"}  # Flux's dynamic shift (exp(mu) of the token count)
        sampling = {"shift": "resolution", "cfg_scale": 1.0}
    elif name == "ltx":
        shape, config = (3, 3, 5), architecture("ltx_video_tiny")
        references = [diffusers.LTXVideoTransformer3DModel.from_config(config).double()]
        model = DiffusersTransformer("ltx_video", config=config, input_size=shape, in_channels=4, text_len=7,
                                     text_dim=16)
        mask = torch.tensor([[True] * 7, [True] * 3 + [False] * 4])
        condition = {"text": _text(g, 7, 16, mask), "text_mask": mask}
        negative = {"text": _text(g, 7, 16, mask), "text_mask": mask}
        objective = {"shift": "resolution", "resolution": {"base_tokens": 1024, "max_tokens": 4096,
                                                           "base_shift": 0.95, "max_shift": 2.05}}
        # the pipeline's default guidance; it rounds each half's prediction to float32 before combining them
        sampling = {"shift": "resolution", "shift_terminal": 0.1, "cfg_scale": 3.0}
    elif name == "wan22_ti2v":  # Wan 2.2 TI2V-5B's image-to-video: a given first latent frame, its tokens at time 0
        shape, config = (2, 4, 4), architecture("wan22_ti2v_tiny")
        references = [diffusers.WanTransformer3DModel.from_config(config).double()]
        model = DiffusersTransformer("wan22_ti2v", config=config, input_size=shape, in_channels=4, text_len=7,
                                     text_dim=16)
        condition = {"text": _text(g, 7, 16), "image_latents": ti2v_image_latents(shape)}
        negative = {"text": _text(g, 7, 16)}  # the image is in both halves of guidance, as the pipeline has it
        objective, sampling = {"shift": 3.0}, {"shift": 3.0, "cfg_scale": 5.0}
    else:  # hunyuan_video15, hunyuan_i2v (HunyuanVideo 1.5 I2V: the image's latents and mask on the channels)
        i2v = name == "hunyuan_i2v"
        shape, config = (2, 4, 4), architecture("hunyuan_video15_i2v_tiny" if i2v else "hunyuan_video15_tiny")
        if i2v:  # the I2V pipeline picks the sample size from the image and target_size: 64 px = 4 latent cells
            config["target_size"] = 64
        references = [diffusers.HunyuanVideo15Transformer3DModel.from_config(config).double()]
        model = DiffusersTransformer("hunyuan_video15_i2v" if i2v else "hunyuan_video15", config=config,
                                     input_size=shape, in_channels=4, text_len=5, text_dim=16)
        mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        condition, negative = {"text": _text(g, 5, 16, mask), "text_mask": mask}, {"text": _text(g, 5, 16, mask),
                                                                                   "text_mask": mask}
        if i2v:  # the image in both halves of guidance (the pipeline's negative prompt replaces the text only)
            condition.update(hunyuan_i2v_image_condition(shape))
        objective, sampling = {"shift": 5.0}, {"shift": 5.0, "cfg_scale": 3.0}
    model.transformer.load_state_dict(references[0].state_dict())
    if len(references) > 1:
        model.transformer_2.load_state_dict(references[1].state_dict())
    return references, model.double(), condition, negative, shape, objective, sampling


def ti2v_pipeline(transformer=None, scheduler=None):
    """WanImageToVideoPipeline as Wan 2.2 TI2V-5B's folder configures it (``expand_timesteps=True``), over a tiny
    random Wan VAE with 4 latent channels (its latents_mean / latents_std away from 0 / 1, so the normalisation
    counts)."""
    import diffusers

    torch.manual_seed(7)
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
                                     latents_std=[1.5, 0.8, 1.2, 1.0])
    return diffusers.WanImageToVideoPipeline(tokenizer=None, text_encoder=None, image_encoder=None,
                                             image_processor=None, transformer=transformer, vae=vae,
                                             scheduler=scheduler, expand_timesteps=True)


def ti2v_image():
    from PIL import Image

    pixels = torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(8)) * 255
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def ti2v_image_latents(shape) -> torch.Tensor:
    """(2, 4, 1, H, W): the image's normalised first-frame latents for a batch of 2, by the pipeline's own
    ``prepare_latents`` (as its call computes them; prepare's encoding is checked against it in test_i2v_sampling)."""
    pipe = ti2v_pipeline()
    frames, height, width = shape
    image = pipe.video_processor.preprocess(ti2v_image(), height=height * 8, width=width * 8)
    _, condition, _ = pipe.prepare_latents(image, 2, 4, height * 8, width * 8, (frames - 1) * 4 + 1, torch.float32,
                                           torch.device("cpu"))
    return condition.double()


def hunyuan_i2v_pipeline(transformer=None, scheduler=None, guidance_scale: float = 1.0):
    """HunyuanVideo15ImageToVideoPipeline over a tiny random HunyuanVideo 1.5 VAE (4 latent channels, 16x spatial, 4x
    temporal) and a tiny random SigLIP vision model (16 tokens of width 12, the tiny transformer's image_embed_dim);
    no text encoders (the test passes prompt embeddings)."""
    import diffusers
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(9)
    vae = diffusers.AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8,) * 5, layers_per_block=1,
                                                scaling_factor=0.8)
    encoder = SiglipVisionModel(SiglipVisionConfig(hidden_size=12, intermediate_size=24, num_hidden_layers=1,
                                                   num_attention_heads=2, image_size=32, patch_size=8)).eval()
    return diffusers.HunyuanVideo15ImageToVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=transformer, vae=vae, scheduler=scheduler, text_encoder_2=None,
        tokenizer_2=None, guider=ClassifierFreeGuidance(guidance_scale=guidance_scale), image_encoder=encoder,
        feature_extractor=SiglipImageProcessor(size={"height": 32, "width": 32}))


def hunyuan_i2v_image():
    """64 x 64 px: the size the pipeline picks for a square image at target_size 64, so it is not resized."""
    from PIL import Image

    pixels = torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(10)) * 255
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def hunyuan_i2v_image_condition(shape) -> dict[str, torch.Tensor]:
    """The image's ``image_latents`` (2, 4, 1, H, W) and SigLIP ``image_embeds`` (2, 16, 12) for a batch of 2, by the
    pipeline's own ``_get_image_latents`` / ``_get_image_embeds`` (as its call computes them; prepare's encoding is
    checked against them in tests/test_hunyuan_i2v.py)."""
    pipe = hunyuan_i2v_pipeline()
    _, height, width = shape
    with torch.no_grad():
        latents = pipe._get_image_latents(pipe.vae, pipe.video_processor, hunyuan_i2v_image(), height * 16,
                                          width * 16, torch.device("cpu"))  # (1, 4, 1, H, W)
        embeds = pipe._get_image_embeds(pipe.image_encoder, pipe.feature_extractor, hunyuan_i2v_image(),
                                        torch.device("cpu"))  # (1, 16, 12)
    return {"image_latents": latents.double().repeat(2, 1, 1, 1, 1), "image_embeds": embeds.double().repeat(2, 1, 1)}


# the pipelines' own schedulers, as the published scheduler_config.json files configure them
SCHEDULERS = {
    ("wan", "unipc"): ("UniPCMultistepScheduler", {"prediction_type": "flow_prediction", "use_flow_sigmas": True,
                                                   "flow_shift": 3.0, "solver_order": 2}),
    ("wan", "dpmpp"): ("DPMSolverMultistepScheduler", {"prediction_type": "flow_prediction", "use_flow_sigmas": True,
                                                       "flow_shift": 3.0}),
    ("wan", "flow_euler"): ("FlowMatchEulerDiscreteScheduler", {"shift": 3.0}),
    ("flux", "flow_euler"): ("FlowMatchEulerDiscreteScheduler", {
        "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
        "max_image_seq_len": 4096}),
    ("ltx", "flow_euler"): ("FlowMatchEulerDiscreteScheduler", {
        "use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
        "max_image_seq_len": 4096, "shift_terminal": 0.1}),
    ("hunyuan", "flow_euler"): ("FlowMatchEulerDiscreteScheduler", {"shift": 5.0}),
}


def pipeline_scheduler(name: str, sampler: str):
    import diffusers

    family = "wan" if name.startswith("wan") else "hunyuan" if name.startswith("hunyuan") else name
    class_name, config = SCHEDULERS[(family, sampler)]
    return getattr(diffusers, class_name)(**config)


@functools.cache
def pipeline_samples(name: str, sampler: str) -> torch.Tensor:
    """The pipeline's latents (B, C, [T,] H, W) from ringdit's initial noise for SEEDS."""
    import diffusers

    from ringdit.diffusion import initial_noise
    from ringdit.models.diffusers.packing import pack_latents, unpack_latents
    from ringdit.models.diffusers.ltx_video import pack_video, unpack_video

    references, model, condition, negative, shape, _, sampling = case(name)
    noise = initial_noise((model.in_channels, *shape), SEEDS)
    scheduler = pipeline_scheduler(name, sampler)
    with torch.no_grad():
        if name == "wan22_ti2v":
            pipe = ti2v_pipeline(references[0], scheduler)
            return pipe(image=ti2v_image(), prompt_embeds=condition["text"], negative_prompt_embeds=negative["text"],
                        latents=noise, height=shape[1] * 8, width=shape[2] * 8, num_frames=(shape[0] - 1) * 4 + 1,
                        num_inference_steps=STEPS, guidance_scale=sampling["cfg_scale"], output_type="latent").frames
        if name.startswith("wan"):
            experts = {"transformer_2": references[1], "boundary_ratio": 0.875} if len(references) > 1 else {}
            pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, transformer=references[0], vae=None,
                                         scheduler=scheduler, expand_timesteps=name == "wan_expand", **experts)
            guidance_2 = {"guidance_scale_2": sampling["cfg_scale_2"]} if experts else {}
            return pipe(prompt_embeds=condition["text"], negative_prompt_embeds=negative["text"], latents=noise,
                        height=shape[1] * 8, width=shape[2] * 8, num_frames=(shape[0] - 1) * 4 + 1,
                        num_inference_steps=STEPS, guidance_scale=sampling["cfg_scale"], output_type="latent",
                        **guidance_2).frames
        if name == "flux":
            pipe = diffusers.FluxPipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
                                          text_encoder_2=None, tokenizer_2=None, transformer=references[0])
            packed = pipe(prompt_embeds=condition["text"], pooled_prompt_embeds=condition["pooled"],
                          latents=pack_latents(noise), height=shape[0] * 8, width=shape[1] * 8,
                          num_inference_steps=STEPS, output_type="latent").images
            return unpack_latents(packed, *shape)
        if name == "ltx":
            pipe = diffusers.LTXPipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
                                         transformer=references[0])
            packed = pipe(prompt_embeds=condition["text"], prompt_attention_mask=condition["text_mask"],
                          negative_prompt_embeds=negative["text"], negative_prompt_attention_mask=negative["text_mask"],
                          latents=pack_video(noise, 1, 1), height=shape[1] * 32, width=shape[2] * 32,
                          num_frames=(shape[0] - 1) * 8 + 1, num_inference_steps=STEPS,
                          guidance_scale=sampling["cfg_scale"], output_type="latent").frames
            return unpack_video(packed, shape, 1, 1)
        glyph, glyph_mask = torch.zeros(2, 1, 8, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.bool)  # none
        if name == "hunyuan_i2v":  # the pipeline encodes the image itself (VAE, SigLIP) and picks its size from it
            pipe = hunyuan_i2v_pipeline(references[0], scheduler, sampling["cfg_scale"])
            return pipe(image=hunyuan_i2v_image(), prompt_embeds=condition["text"],
                        prompt_embeds_mask=condition["text_mask"], negative_prompt_embeds=negative["text"],
                        negative_prompt_embeds_mask=negative["text_mask"], prompt_embeds_2=glyph,
                        prompt_embeds_mask_2=glyph_mask, negative_prompt_embeds_2=glyph,
                        negative_prompt_embeds_mask_2=glyph_mask, latents=noise, num_frames=(shape[0] - 1) * 4 + 1,
                        num_inference_steps=STEPS, output_type="latent").frames
        from diffusers.guiders import ClassifierFreeGuidance

        vae = diffusers.AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8,) * 5, layers_per_block=1)
        pipe = diffusers.HunyuanVideo15Pipeline(
            text_encoder=None, tokenizer=None, transformer=references[0], vae=vae, scheduler=scheduler,
            text_encoder_2=None, tokenizer_2=None, guider=ClassifierFreeGuidance(guidance_scale=sampling["cfg_scale"]))
        return pipe(prompt_embeds=condition["text"], prompt_embeds_mask=condition["text_mask"],
                    negative_prompt_embeds=negative["text"], negative_prompt_embeds_mask=negative["text_mask"],
                    prompt_embeds_2=glyph, prompt_embeds_mask_2=glyph_mask, negative_prompt_embeds_2=glyph,
                    negative_prompt_embeds_mask_2=glyph_mask, latents=noise, height=shape[1] * 16,
                    width=shape[2] * 16, num_frames=(shape[0] - 1) * 4 + 1, num_inference_steps=STEPS,
                    output_type="latent").frames


class Module:
    """A ``Sampler`` of the case's model on a given mesh (one process without ``dims``)."""

    @staticmethod
    def make(name: str, sampler: str, dims=None, scheduler_config=None):
        from ringdit.models import parallelize
        from ringdit.sampling import Sampler

        references, model, condition, negative, shape, objective, sampling = case(name)
        sampling = {**sampling, "sampler": sampler, "steps": STEPS, "scheduler_config": scheduler_config}
        model = parallelize(copy.deepcopy(model), dims=dims if dims is not None and dims.sp_degree > 1 else None)
        made = Sampler.for_run(model, {"_target_": "ringdit.diffusion.FlowMatching", **objective}, sampling,
                               {"image_size": list(shape), "latent_scale": 1.0, "conditioning": "text"}, dims=dims)
        return made, condition, negative, shape


def ringdit_samples(name: str, sampler: str, dims=None, scheduler_config=None, cache=None) -> torch.Tensor:
    made, condition, negative, shape = Module.make(name, sampler, dims, scheduler_config)
    with made.using(step_cache=cache) as cached:
        return cached.generate(condition, SEEDS, negative=negative, shape=shape)


def assert_equal_to_pipeline(samples, expected, where):
    assert samples.shape == expected.shape, where
    scale = expected.abs().max()
    difference = (samples.double() - expected.double()).abs().max()
    print(f"{where}: max |ringdit - pipeline| = {difference / scale:.2e} of the largest value")
    assert difference <= OF_MAX * scale, f"{where}: {difference / scale:.3g} of the largest value"


# ---- one process ----------------------------------------------------------------------------------------------------

ONE_PROCESS = [("wan", "unipc"), ("wan", "dpmpp"), ("wan", "flow_euler"), ("wan_experts", "unipc"),
               ("wan_expand", "unipc"), ("wan22_ti2v", "unipc"),
               ("flux", "flow_euler"), ("ltx", "flow_euler"), ("hunyuan", "flow_euler"), ("hunyuan_i2v", "flow_euler")]


@pytest.mark.parametrize("name, sampler", ONE_PROCESS, ids=[f"{n}-{s}" for n, s in ONE_PROCESS])
def test_samples_equal_the_pipelines(name, sampler, tmp_path):
    """Wan's UniPC comes from a pipeline folder's scheduler/scheduler_config.json (as the spec reads it); the others
    from the run's shift, shift=resolution (Flux, LTX's constants) and shift_terminal (LTX)."""
    folder_config = None
    if (name, sampler) == ("wan", "unipc"):
        from ringdit.spec.diffusion import resolve_scheduler

        pipeline_scheduler(name, sampler).save_config(tmp_path / "scheduler")
        settings = {"sampler": sampler}
        resolve_scheduler(settings, {"pretrained": str(tmp_path)})
        folder_config = settings["scheduler_config"]
        assert folder_config["_class_name"] == "UniPCMultistepScheduler" and folder_config["flow_shift"] == 3.0
    assert_equal_to_pipeline(ringdit_samples(name, sampler, scheduler_config=folder_config),
                             pipeline_samples(name, sampler), f"{name} {sampler}, one process")


def test_step_caching_with_a_scheduler():
    """cache=fbcache at threshold 0 recomputes every step: the pipeline's samples, each step evaluated once."""
    from ringdit.caching import CacheSettings, StepCache

    cache = StepCache(CacheSettings("fbcache", 0.0))
    assert_equal_to_pipeline(ringdit_samples("wan", "unipc", cache=cache), pipeline_samples("wan", "unipc"),
                             "wan unipc, fbcache threshold 0")
    assert cache.counts.full == cache.counts.evaluations == STEPS


# ---- ring 2 and CFG parallel ----------------------------------------------------------------------------------------

RANKS = [("wan", "unipc"), ("wan_experts", "dpmpp"), ("wan22_ti2v", "unipc"), ("flux", "flow_euler"),
         ("ltx", "flow_euler"), ("hunyuan", "flow_euler"), ("hunyuan_i2v", "flow_euler")]


def check_layouts(rank, world, expected: dict):
    from ringdit.parallel import init_sequence_parallel

    ring = init_sequence_parallel(2, 1)
    for (name, sampler), samples in expected.items():
        assert_equal_to_pipeline(ringdit_samples(name, sampler, dims=ring), samples, f"{name} {sampler}, ring 2")
    # CFG parallel: the conditional and unconditional halves on the two ranks
    halves = init_sequence_parallel(1, 1, cfg_parallel=True)
    assert halves.cfg_group is not None
    for name, sampler in [("wan", "unipc"), ("wan_experts", "dpmpp"), ("wan22_ti2v", "unipc"),
                          ("hunyuan_i2v", "flow_euler")]:
        assert_equal_to_pipeline(ringdit_samples(name, sampler, dims=halves), expected[(name, sampler)],
                                 f"{name} {sampler}, CFG parallel")


def test_samples_equal_the_pipelines_at_ring_2_and_cfg_parallel():
    from tests.distributed import run_ranks

    expected = {key: pipeline_samples(*key) for key in RANKS}  # one process, here
    run_ranks(check_layouts, 2, expected)


def test_a_fresh_scheduler_per_call():
    """The multistep history does not leak from one generate call (one batch) into the next."""
    sampler, condition, negative, shape = Module.make("wan", "unipc")
    first = sampler.generate(condition, SEEDS, negative=negative, shape=shape)
    assert torch.equal(sampler.generate(condition, SEEDS, negative=negative, shape=shape), first)


# ---- bad input ------------------------------------------------------------------------------------------------------


def test_bad_sampler_settings_are_refused():
    from ringdit.common.errors import ConfigError
    from ringdit.spec.diffusion import check_sampling

    flow, ddpm = {"_target_": "ringdit.diffusion.FlowMatching"}, {"_target_": "ringdit.diffusion.DDPM"}
    with pytest.raises(ConfigError, match=r"sampler='unipcc' does not fit the FlowMatching objective; use one of "
                                          r"euler, heun, fewstep, flow_euler, unipc, dpmpp"):
        check_sampling({"_target_": "ringdit.models.DiT"}, flow, {"sampler": "unipcc"})
    with pytest.raises(ConfigError, match=r"sampler=unipc is diffusers' UniPCMultistepScheduler for flow-matching "
                                          r"models .* DDPM objective .* use one of ddim, ddpm"):
        check_sampling({"_target_": "ringdit.models.DiT"}, ddpm, {"sampler": "unipc"})


@pytest.mark.parametrize("text, message", [
    ("{not json", r"scheduler_config.json .*is not valid JSON"),
    ("[1, 2]", r"holds a JSON array, not an object"),
    (json.dumps({"_class_name": "UniPCMultistepScheduler", "use_flow_sigmas": False, "prediction_type": "epsilon"}),
     r"use_flow_sigmas=False, prediction_type='epsilon' steps a DDPM schedule.*use_flow_sigmas=true"),
    (json.dumps({"_class_name": "UniPCMultistepScheduler", "timestep_spacing": "sideways", **SCHEDULERS[("wan", "unipc")][1]}),
     r"does not build a working UniPCMultistepScheduler \(sideways is not supported"),
])
def test_a_broken_scheduler_config_is_refused_before_spawning(text, message, tmp_path):
    save_tiny_wan(tmp_path)
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(text)
    proc, seconds = fail_fast("train.py", "experiment=wan_tiny", f"model.pretrained={tmp_path}",
                              "diffusion.sampling.sampler=unipc", f"hydra.run.dir={tmp_path / 'run'}")
    assert_refused(proc, message, seconds=seconds, run_dir=tmp_path / "run")


@pytest.mark.parametrize("overrides, message", [
    (["diffusion=ddpm", "diffusion.sampling.sampler=dpmpp"], r"diffusion.sampling.sampler=dpmpp is diffusers' "
                                                             r"DPMSolverMultistepScheduler for flow-matching models"),
    (["experiment=wan_tiny", "diffusion.sampling.sampler=unipcc"], r"sampler='unipcc' does not fit"),
    (["experiment=wan_tiny", "diffusion.sampling.shift=-2"], r"diffusion.sampling.shift=-2 is not a shift: give a "
                                                             r"number > 0 \(Wan: 3 at 480p"),
    (["experiment=wan_tiny", "diffusion.sampling.shift=nan"], r"diffusion.sampling.shift=nan is not a shift"),
    (["experiment=wan_tiny", "diffusion.sampling.shift=abc"], r"diffusion.sampling.shift='abc' is not a shift"),
])
def test_bad_samplers_are_refused_before_spawning(overrides, message, tmp_path):
    proc, seconds = fail_fast("train.py", *overrides, f"hydra.run.dir={tmp_path}")
    assert_refused(proc, message, seconds=seconds, run_dir=tmp_path)


@pytest.mark.parametrize("sampler", ["flow_euler", "unipc", "dpmpp"])
def test_the_runs_shift_reaches_a_pipeline_folders_scheduler(sampler):
    """diffusion.sampling.shift is laid over a pipeline folder's scheduler config (Wan's UniPC at flow_shift 3), for
    its own class and the others: the schedule is that of the pipeline's scheduler at the run's shift (Wan: 3 at
    480p, 5 at 720p), and not the folder's; None keeps the folder's. A dynamically shifting folder (Flux's) given a
    number shifts by that number."""
    import diffusers

    from ringdit.diffusion.schedulers import build_scheduler, scheduler_config

    class_name, settings = SCHEDULERS[("wan", "unipc")]
    folder = {"_class_name": class_name, **settings}

    def sigmas(config: dict) -> list[float]:
        scheduler = build_scheduler(sampler, config)
        scheduler.set_timesteps(STEPS)
        return scheduler.sigmas.tolist()

    reference = SCHEDULERS[("wan", sampler)]
    key = "shift" if sampler == "flow_euler" else "flow_shift"
    at_five = getattr(diffusers, reference[0])(**{**reference[1], key: 5.0})
    at_five.set_timesteps(STEPS)
    assert sigmas(scheduler_config(sampler, folder, shift=5.0)) == at_five.sigmas.tolist()
    assert sigmas(scheduler_config(sampler, folder)) == sigmas(scheduler_config(sampler, folder, shift=3.0))
    assert sigmas(scheduler_config(sampler, folder, shift=5.0)) != sigmas(scheduler_config(sampler, folder))
    if sampler == "flow_euler":
        flux = {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULERS[("flux", "flow_euler")][1]}
        assert scheduler_config(sampler, flux, shift=5.0) == {**SCHEDULERS[("flux", "flow_euler")][1],
                                                              "use_dynamic_shifting": False, "shift": 5.0}
        assert scheduler_config(sampler, flux, shift="resolution")["use_dynamic_shifting"] is True
