"""``infer.py control=`` for Wan VACE (issue 56): the control clip is encoded with the data's VAE into the model's
``control`` input exactly as diffusers' ``WanVACEPipeline`` builds ``control_hidden_states`` from the same video
(``preprocess_conditions`` + ``prepare_video_latents`` + ``prepare_masks``, no mask: every pixel generated), and a clip
of another frame count or size -- or ``control=`` for a model without one -- is refused before anything starts."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ringdit.common.errors import ConfigError
from tests.helpers import architecture, read_mp4, write_video

pytest.importorskip("diffusers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZE, FRAMES = (16, 16), 5  # pixels (H, W): latents (2, 2, 2) with the tiny Wan VAE (8x spatial, 4x temporal)
CLOSE = dict(rtol=1e-5, atol=1e-5)  # fp32: the same VAE kernels on the same pixels
TRANSFORMER = "ringdit.models.diffusers.DiffusersTransformer"  # a model config's _target_, as every preset records it
VACE = {"_target_": TRANSFORMER, "family": "wan_vace", "config": {"vace_in_channels": 2 * 16 + 64}}  # 16 latents + mask
DATA = {"channels": 16, "vae": {"path": "vae"}}  # data prepared with a VAE (pixel sizes)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("control") / "control.mp4"
    write_video(path, FRAMES, seed=5, size=SIZE[::-1])
    return path


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    """A tiny random Wan VAE (conftest's ``models``' alone: 16 latent channels, 8x spatial, 4x temporal)."""
    from diffusers import AutoencoderKLWan

    folder = tmp_path_factory.mktemp("wan_vae")
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True]).save_pretrained(folder)
    return folder


def pipeline_control(vae_folder, clip) -> torch.Tensor:
    """WanVACEPipeline's control_hidden_states for ``clip`` (every frame, as decoded) at the samples' size."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanVACEPipeline, WanVACETransformer3DModel
    from PIL import Image

    transformer = WanVACETransformer3DModel.from_config({**architecture("wan_vace_tiny"), **VACE["config"]})
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=AutoencoderKLWan.from_pretrained(vae_folder),
                           scheduler=FlowMatchEulerDiscreteScheduler(), transformer=transformer)
    frames = [Image.fromarray(frame) for frame in read_mp4(clip)]
    cpu = torch.device("cpu")
    with torch.no_grad():  # as its __call__: step 5, "Prepare latent variables"
        video, mask, references = pipe.preprocess_conditions(frames, None, None, 1, *SIZE, FRAMES, torch.float32, cpu)
        latents = pipe.prepare_video_latents(video, mask, references, None, cpu)
        return torch.cat([latents, pipe.prepare_masks(mask, references, None)], dim=1)


def control_spec(clip, frames=FRAMES, size=SIZE, model=VACE, vae="vae", control=None, data=DATA):
    from ringdit.spec.control import ControlInput

    cfg = OmegaConf.create({"control": str(control or clip)})
    return ControlInput.from_config(cfg, model, data, ckpt_path="last.ckpt", vae=vae, user_size=(list(size), frames),
                                    given_prompts=True)


def test_control_clip_is_encoded_as_the_vace_pipeline_does(vae_folder, clip):
    """infer's conditions of 3 samples: each the pipeline's 96 control channels of the clip ([latents of the
    inactive (zero) video ; of the video ; the 8x8 packed mask of ones]), (3, 96, 2, 2, 2)."""
    from ringdit.sampling.conditions import control_conditions

    expected = pipeline_control(vae_folder, clip)  # (1, 96, 2, 2, 2)
    assert expected.shape == (1, 96, 2, *(s // 8 for s in SIZE))
    spec = SimpleNamespace(control=control_spec(clip), output=SimpleNamespace(vae=str(vae_folder)))
    found = control_conditions(spec, 3)
    assert found.shape == (3, *expected.shape[1:])
    for sample in found:
        torch.testing.assert_close(sample, expected[0], **CLOSE)
    assert (found[:, 32:] == 1).all() and found[:, 16:32].abs().sum() > 0  # the mask channels; the video's latents


def test_a_control_clip_of_other_frames_or_size_is_refused(clip):
    """One line naming control=, the clip's frames and size and the samples'; its advice (sample at the clip's frames
    and size) is accepted."""
    with pytest.raises(ConfigError, match=r"control=.*has 5 frames of 16x16 .* the samples have 9 frames of 16x16.*"
                                          r"frames=5 size=\[16,16\]") as error:
        control_spec(clip, frames=9)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"control=.*has 5 frames of 16x16 .* samples have 5 frames of 64x32"):
        control_spec(clip, size=(32, 64))
    assert control_spec(clip).frames == FRAMES  # the advice: the clip's own frames and size


def test_control_needs_a_control_video_model_and_a_clip(clip, tmp_path):
    with pytest.raises(ConfigError, match=r"control=.* is not a control-video model \(model.family=wan:.*wan_vace"):
        control_spec(clip, model={"_target_": TRANSFORMER, "family": "wan", "config": {}})
    with pytest.raises(ConfigError, match=r"control=.*missing.mp4 does not exist"):
        control_spec(clip, control=tmp_path / "missing.mp4")
    with pytest.raises(ConfigError, match=r"vace_in_channels is 72"):
        control_spec(clip, model={"_target_": TRANSFORMER, "family": "wan_vace", "config": {"vace_in_channels": 72}})
    with pytest.raises(ConfigError, match=r"control=.*trained on data that record no VAE .*leave control=, prompts "):
        control_spec(clip, data={"channels": 16})
    with pytest.raises(ConfigError, match=r"control=.*no VAE folder is known; give vae="):
        control_spec(clip, vae=None)
    from ringdit.spec.control import ControlInput

    with pytest.raises(ConfigError, match=r"is a control-video model \(model.family=wan_vace\): give the control video "
                                          r"with control=<video file>"):
        ControlInput.from_config(OmegaConf.create({"control": None}), VACE, DATA, ckpt_path="last.ckpt", vae="vae",
                                 user_size=(list(SIZE), FRAMES), given_prompts=True)
    with pytest.raises(ConfigError, match=r"control=.* with a prompt_file of several sizes: one control clip fits one "
                                          r"size"):
        ControlInput.from_config(OmegaConf.create({"control": str(clip)}), VACE, DATA, ckpt_path="last.ckpt",
                                 vae="vae", user_size=(list(SIZE), FRAMES), given_prompts=True, prompt_sizes=2)


def test_the_server_refuses_a_control_video_model_trained_without_a_vae_before_it_starts():
    """A VACE model trained on latents made without a VAE (synthetic): no request's clip could be encoded as its
    control latents were, so the server refuses it at once; the advice (data prepared with vae= and control=) serves:
    ``test_the_server_samples_a_vace_checkpoint_with_a_control_clip_as_infer_does``."""
    from ringdit.serve import check_servable

    spec = SimpleNamespace(ckpt_path="last.ckpt", layout=SimpleNamespace(dp_degree=1, cfg_parallel=False),
                           data={"conditioning": "text"}, output=SimpleNamespace(vae="vae"),
                           conditioning=SimpleNamespace(text_encoder="t5"), model=SimpleNamespace(config=VACE))
    with pytest.raises(ConfigError, match=r"is a control-video model \(model.family=wan_vace\) trained on data that "
                                          r"record no VAE .*serve a model trained on data prepared with python -m "
                                          r"ringdit.prepare vae=<folder> control=<folder>") as error:
        check_servable(spec)
    assert "\n" not in str(error.value)
    check_servable(SimpleNamespace(**{**vars(spec), "data": {**DATA, "conditioning": "text"}}))  # prepared: served


@pytest.mark.timeout(600)
def test_the_server_samples_a_vace_checkpoint_with_a_control_clip_as_infer_does(models, tmp_path):
    """(clip, control clip, caption) triples prepared with control=, wan_vace_tiny trained on them by train.py (one
    step), then infer.py control=<a clip> prompts=[..] seed=11 samples; the server's POST /v1/videos with that clip as
    base64 in ``control`` gives infer.py's frames, exactly (the same encode_control, per job). A clip of other frames
    (as an uploaded file) or size, bytes that are no video, and no clip at all: each a 400 naming control."""
    import base64

    import httpx

    from ringdit.media.control_pixels import encode_control
    from ringdit.prepare import main as prepare
    from tests.helpers import run
    from tests.serving import AUTH, KEY, serving, video_frames

    clips, controls, data = tmp_path / "clips", tmp_path / "controls", tmp_path / "data"
    clips.mkdir()
    controls.mkdir()
    for i, caption in enumerate(["a red fox", "a blue cat", "a green field", "a blue sky"]):
        write_video(clips / f"{i}.mp4", FRAMES, seed=i, size=SIZE[::-1])
        write_video(controls / f"{i}.mp4", FRAMES, seed=10 + i, size=SIZE[::-1])
        (clips / f"{i}.txt").write_text(caption)
    prepare([f"input={clips}", f"out={data}", f"vae={models['wan']}", f"text_encoder={models['wan']}",
             f"size=[{SIZE[0]},{SIZE[1]}]", f"frames={FRAMES}", "max_text_len=8", f"control={controls}"])
    run("train.py", tmp_path / "run", "experiment=wan_tiny", "model=wan_vace_tiny", "model.config.in_channels=16",
        "model.config.out_channels=16", "model.config.vace_in_channels=96", "data=text_latents",
        f"data.path={data}", "data.batch_size=2", "data.val_fraction=0.5", "trainer.max_steps=1", "logger=csv",
        "scheduler=constant", "callbacks.model_checkpoint.every_n_train_steps=1", env={"HF_HUB_OFFLINE": "1"})
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    control = controls / "1.mp4"
    run("infer.py", tmp_path / "infer", f"ckpt_path={ckpt}", f"control={control}", "prompts=[a blue cat]",
        "num_samples=1", "diffusion.sampling.steps=2", "seed=11", env={"HF_HUB_OFFLINE": "1"})
    expected = video_frames(tmp_path / "infer" / "sample-000.mp4")  # decoded with the data's VAE, seed 11
    write_video(tmp_path / "long.mp4", FRAMES + 4, seed=3, size=SIZE[::-1])
    write_video(tmp_path / "wide.mp4", FRAMES, seed=3, size=(32, 16))
    body = {"prompt": "a blue cat", "seed": 11}
    with serving(tmp_path / "serve", f"ckpt_path={ckpt}", f"api_key={KEY}", "diffusion.sampling.steps=2") as server:
        given = base64.b64encode(control.read_bytes()).decode()
        job = httpx.post(server.url + "/v1/videos", headers=AUTH, json={**body, "control": given}).json()
        np.testing.assert_array_equal(video_frames(finished(server.url, job["id"])), expected)  # infer.py's, exactly
        # the job's own clip is what the ranks are given, encoded as infer.py encodes its file (the tiny random VAE
        # encodes any two clips within 0.08 of each other: too close to tell apart in the decoded uint8 pixels)
        other = base64.b64encode((controls / "0.mp4").read_bytes()).decode()
        job = httpx.post(server.url + "/v1/videos", headers=AUTH, json={**body, "n": 2, "control": other}).json()
        finished(server.url, job["id"])
        command = server.rank0.sample_command([server.queue.get(job["id"])], server.engine.sampler)
        encoded = encode_control(str(controls / "0.mp4"), vae=str(models["wan"] / "vae"), size=SIZE, frames=FRAMES,
                                 temporal=4)  # (1, 96, 2, 2, 2)
        torch.testing.assert_close(command["condition"]["control"], encoded.expand(2, -1, -1, -1, -1), rtol=0, atol=0)
        assert not torch.equal(encoded, encode_control(str(control), vae=str(models["wan"] / "vae"), size=SIZE,
                                                       frames=FRAMES, temporal=4))

        answer = httpx.post(server.url + "/v1/videos", headers=AUTH, data={k: str(v) for k, v in body.items()},
                            files={"control": ("long.mp4", (tmp_path / "long.mp4").read_bytes(), "video/mp4")})
        assert bad(answer) == "control has 9 frames of 16x16 but the samples have 5 frames of 16x16: a control clip " \
                              "is the samples' own frames and size; ask for frames=9 size=\"16x16\", or give a clip " \
                              "of 5 frames at 16x16"
        wide = base64.b64encode((tmp_path / "wide.mp4").read_bytes()).decode()
        answer = httpx.post(server.url + "/v1/videos", headers=AUTH, json={**body, "control": wide})
        assert "control has 5 frames of 32x16 but the samples have 5 frames of 16x16" in bad(answer)
        junk = base64.b64encode(b"not a video at all").decode()
        answer = httpx.post(server.url + "/v1/videos", headers=AUTH, json={**body, "control": junk})
        assert bad(answer).startswith("control is not a readable video")
        answer = httpx.post(server.url + "/v1/videos", headers=AUTH, json={**body, "control": "not base64!"})
        assert bad(answer) == "control is not base64"
        answer = httpx.post(server.url + "/v1/videos", headers=AUTH, data={**body, "seed": "11", "control": given},
                            files={"control": ("long.mp4", (tmp_path / "long.mp4").read_bytes(), "video/mp4")})
        assert bad(answer) == "control is given 2 times; give it once"
        answer = httpx.post(server.url + "/v1/videos", headers=AUTH, json=body)
        assert bad(answer).startswith("this model denoises under a control video (model.family=wan_vace): give the "
                                      "clip")


def finished(url: str, job_id: str) -> bytes:
    """The MP4 of a finished video job (asserting it completed)."""
    from tests.serving import AUTH, finished_video

    return finished_video(url, job_id, headers=AUTH)


def bad(answer) -> str:
    """The message of a 400 naming control, asserting it is one line."""
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "control" and "\n" not in error["message"], error
    return error["message"]


def test_a_control_clip_for_a_model_without_one_is_a_400_naming_control(clip):
    """The check POST /v1/videos runs (``ringdit.serve.validate.control_clip``) for a model that takes no control
    video: a 400 naming control; the advice (leave it out) passes."""
    from ringdit.serve.bodies import BadRequest
    from ringdit.serve.validate import control_clip

    server = SimpleNamespace(control_family=None, spec=SimpleNamespace(model=SimpleNamespace(config={"family": "wan"})))
    with pytest.raises(BadRequest) as error:
        control_clip(clip.read_bytes(), server, SIZE, FRAMES)
    assert (error.value.status, error.value.param) == (400, "control")
    assert error.value.message == "this model takes no control video (it is not a control-video model: " \
                                  "model.family=wan); leave control out"
    assert control_clip(None, server, SIZE, FRAMES) is None


# ---- python -m ringdit.prepare control=<folder>: the shards' control latents -----------------------------------------


def test_prepare_writes_each_clips_control_latents_as_infer_encodes_them(models, tmp_path):
    """Two clips with a control clip each (same names, in another folder): each shard row's ``control`` is its control
    clip encoded as infer.py control= encodes it (above: as WanVACEPipeline does), (96, 2, 2, 2)."""
    from safetensors.torch import load_file

    from ringdit.media.control_pixels import encode_control
    from ringdit.prepare import main as prepare

    clips, controls, out = tmp_path / "clips", tmp_path / "controls", tmp_path / "data"
    clips.mkdir()
    controls.mkdir()
    for i, caption in enumerate(["a red fox", "a blue cat"]):
        write_video(clips / f"{i}.mp4", FRAMES, seed=i, size=SIZE[::-1])
        write_video(controls / f"{i}.mp4", FRAMES, seed=10 + i, size=SIZE[::-1])
        (clips / f"{i}.txt").write_text(caption)
    prepare([f"input={clips}", f"out={out}", f"vae={models['wan']}", f"text_encoder={models['wan']}",
             f"size=[{SIZE[0]},{SIZE[1]}]", f"frames={FRAMES}", "max_text_len=8", f"control={controls}"])
    shard = load_file(next(out.glob("shard-*.safetensors")))
    assert shard["control"].shape == (2, 96, 2, 2, 2)
    for i in range(2):
        expected = encode_control(str(controls / f"{i}.mp4"), vae=str(models["wan"] / "vae"), size=SIZE,
                                  frames=FRAMES, temporal=4)
        torch.testing.assert_close(shard["control"][i:i + 1], expected, **CLOSE)
    from ringdit.media.shard_plan import check_resumed_task

    with pytest.raises(ConfigError, match=r"out=.* holds shards prepared with control videos .* but control is null"):
        check_resumed_task(out, "t2v", controlled=False)  # a resume without control= would mix the shards' keys
    check_resumed_task(out, "t2v", controlled=True)


def test_prepare_refuses_a_missing_or_mismatched_control_clip(tmp_path):
    """Before any model loads: one line naming control= and the clip."""
    from ringdit.media.control_pixels import find_controls
    from ringdit.media.folder import list_media

    clips, controls = tmp_path / "clips", tmp_path / "controls"
    clips.mkdir()
    controls.mkdir()
    write_video(clips / "0.mp4", FRAMES, size=SIZE[::-1])
    (clips / "0.txt").write_text("a fox")
    items = list_media(str(clips), "text")
    with pytest.raises(ConfigError, match=r"control=.* has no control video for 0.mp4"):
        find_controls(str(controls), items)
    write_video(controls / "0.mp4", FRAMES + 4, size=SIZE[::-1])
    with pytest.raises(ConfigError, match=r"control=.*0.mp4 has 9 frames of 16x16 but 0.mp4 has 5 frames of 16x16"):
        find_controls(str(controls), items)
    write_video(controls / "0.mp4", FRAMES, size=SIZE[::-1])  # the advice: the clip's frames and size
    assert find_controls(str(controls), items) == {clips / "0.mp4": controls / "0.mp4"}
    with pytest.raises(ConfigError, match=r"control=.*missing is not a folder"):
        find_controls(str(tmp_path / "missing"), items)


@pytest.mark.parametrize("setting", [{"size": [16, 16]}, {"frames": 5}])
def test_previews_of_a_control_video_model_refuse_their_own_size_and_the_advice_previews(setting, tmp_path):
    """The previews sample under the held-out clips' own control latents (the data's size): a grid size, frame count
    or prompt file of its own would hand the model controls of another grid, mid-run; refused at start instead."""
    from ringdit.training.callbacks import SampleGrid

    data_info = {"image_keys": ["control"], "channels": 16, "image_size": [2, 2, 2]}
    name, value = next(iter(setting.items()))
    with pytest.raises(ConfigError, match=rf"callbacks.sample_grid.{name}=.*: this model previews under the held-out "
                                          rf"clips' own control videos.*leave callbacks.sample_grid.{name} null"):
        SampleGrid(str(tmp_path), **setting).check_shape(data_info, (1, 2, 2))
    assert SampleGrid(str(tmp_path)).check_shape(data_info, (1, 2, 2)) is None  # the advice: the data's own size
