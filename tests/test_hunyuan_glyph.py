"""HunyuanVideo 1.5's second text encoder, its ByT5 over a prompt's quoted text (``glyph_encoder``): what
``python -m ringdit.prepare`` stores and what the transformer then receives, against diffusers' own
``HunyuanVideo15Pipeline`` on a tiny random pipeline folder (vae/, Qwen2.5-VL text_encoder/ + tokenizer/, ByT5
text_encoder_2/ + tokenizer_2/); prepare -> train.py (one process = a ring of 2) -> infer.py with quoted prompts; and
the settings and data it refuses in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


from ringdit.common.errors import ConfigError
from ringdit.media.encode_folder import encode_folder
from ringdit.media.text import TextEncoder
from tests.helpers import TEXT_LEN, architecture, sampling_encoding, save_tiny_hunyuan_video15, write_video

GLYPH_DIM = 8  # the tiny ByT5's width (tests.helpers.save_tiny_hunyuan_video15): hunyuan_video15_tiny's text_embed_2_dim
GLYPH_LEN = 256  # the pipeline's glyph tokens
# straight and curly quotes, a repeated text (taken once), and captions that quote nothing
CAPTIONS = ['a red fox "running"', "a blue cat", 'a sky \u201cgreen field\u201d "red" "red"', "green field"]
PROMPT = 'a red fox "OPEN 24h" running'
# 5-frame clips at 16 px: 3 x 4 x 4 latents
VIDEO = {"size": 16, "frames": 5, "max_text_len": TEXT_LEN, "prompt_template": "hunyuan_video15"}


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory) -> Path:
    """A HunyuanVideo 1.5 pipeline folder of tiny random models with its glyph encoder (width ``GLYPH_DIM``):
    ``tests.helpers.save_tiny_hunyuan_video15``."""
    return save_tiny_hunyuan_video15(tmp_path_factory.mktemp("hunyuan") / "HunyuanVideo-1.5", glyph=True)


@pytest.fixture(scope="module")
def glyph_data(hunyuan, tmp_path_factory) -> Path:
    """8 captioned 5-frame clips (the captions cycled) prepared with the glyph encoder, 4 a shard."""
    root = tmp_path_factory.mktemp("glyph_data")
    clips = root / "clips"
    clips.mkdir()
    for i in range(8):
        write_video(clips / f"{i}.mp4", 5, seed=i, size=(32, 24))
        (clips / f"{i}.txt").write_text(CAPTIONS[i % len(CAPTIONS)])
    report = encode_folder(str(clips), str(root / "data"), str(hunyuan), str(hunyuan), glyph_encoder=str(hunyuan),
                           shard_size=4, progress=False, **VIDEO)
    assert report.samples == 8 and report.shards_written == 2
    return root / "data"


def hunyuan_pipeline(root: Path, transformer=None):
    """HunyuanVideo15Pipeline over the fixture's folders, loaded as a user's pipeline loads them (its Qwen prompt
    length cut to the tiny model's TEXT_LEN; its ByT5 length is its own 256)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
    )
    from transformers import AutoTokenizer, Qwen2_5_VLTextModel, T5EncoderModel

    pipe = HunyuanVideo15Pipeline(
        text_encoder=Qwen2_5_VLTextModel.from_pretrained(root / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"), transformer=transformer,
        vae=AutoencoderKLHunyuanVideo15.from_pretrained(root / "vae").eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=T5EncoderModel.from_pretrained(root / "text_encoder_2").eval(),
        tokenizer_2=AutoTokenizer.from_pretrained(root / "tokenizer_2"), guider=ClassifierFreeGuidance(6.0))
    pipe.tokenizer_max_length = TEXT_LEN
    assert pipe.tokenizer_2_max_length == GLYPH_LEN
    return pipe


def read_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from tests.helpers import read_prepared

    return read_prepared(path)


def test_glyph_text_is_the_pipelines(hunyuan, glyph_data):
    """glyph_text / glyph_text_mask = HunyuanVideo15Pipeline.encode_prompt's prompt_embeds_2 / prompt_embeds_mask_2
    (its quote extraction, ByT5's 256 bytes, every state kept) for captions with and without quoted text, the empty
    prompt's as null_glyph_*; text as before (zero after the real tokens); the shard records the glyph encoder, and
    Codecs.encode with the recorded settings (infer.py.s prompts) gives the same."""
    tensors, metadata = read_shard(glyph_data / "shard-00000.safetensors")
    captions = json.loads(metadata["captions"])
    assert captions == CAPTIONS
    pipe, cpu = hunyuan_pipeline(hunyuan), torch.device("cpu")
    with torch.no_grad():
        text, text_mask, glyph, glyph_mask = pipe.encode_prompt(captions, cpu, torch.float32, len(captions))
        _, _, null_glyph, null_glyph_mask = pipe.encode_prompt("", cpu, torch.float32)
    assert glyph.shape == (4, GLYPH_LEN, GLYPH_DIM)
    # 'Text "running". ' + </s>: 17 bytes; 'Text "green field". Text "red". ' + </s>: 33; nothing quoted: none
    assert glyph_mask.sum(dim=1).tolist() == [17, 0, 33, 0] and null_glyph_mask.sum() == 0
    assert glyph[0, -1].abs().max() > 0  # the pipeline keeps the padding's states: so does prepare
    torch.testing.assert_close(tensors["glyph_text"], glyph, rtol=1e-6, atol=1e-6)  # same model, fp32
    assert torch.equal(tensors["glyph_text_mask"], glyph_mask.bool())
    torch.testing.assert_close(tensors["null_glyph_text"], null_glyph, rtol=0, atol=0)  # zeros
    assert torch.equal(tensors["null_glyph_text_mask"], null_glyph_mask.bool())
    assert torch.equal(tensors["text_mask"], text_mask.bool())
    torch.testing.assert_close(tensors["text"], text * text_mask[..., None], rtol=1e-6, atol=1e-6)

    described = json.loads(metadata["text_encoder"])
    assert described["glyph_encoder"] == {
        "class": "T5EncoderModel", "path": str((hunyuan / "text_encoder_2").resolve()),
        "tokenizer": str((hunyuan / "tokenizer_2").resolve()), "max_len": GLYPH_LEN, "dim": GLYPH_DIM}
    cond, negative = sampling_encoding(described, captions, text_len=TEXT_LEN, text_dim=16)
    torch.testing.assert_close(cond["glyph_text"], tensors["glyph_text"], rtol=1e-6, atol=1e-6)
    assert torch.equal(cond["glyph_text_mask"], tensors["glyph_text_mask"])
    assert torch.equal(negative["glyph_text"], tensors["null_glyph_text"])


def test_the_transformer_gets_what_the_pipeline_feeds_it(hunyuan):
    """Two guided steps of the real pipeline for a quoted prompt: at each transformer call, ringdit's model given the
    latents, model time and ringdit's encoding of the prompt (the conditional half) or its null condition (the
    unconditional half, the empty prompt's) hands the transformer the pipeline's glyph states and masks, its text on
    the real tokens, and predicts what the pipeline's own call does; the training condition drop swaps the glyph text
    for the null one with the text."""
    from ringdit.models.diffusers import DiffusersTransformer
    from tests.diffusers_helpers import recorded_calls

    encoder = TextEncoder(hunyuan, max_len=TEXT_LEN, prompt_template="hunyuan_video15", glyph_encoder=hunyuan)
    cond, null = encoder([PROMPT]), encoder([""])
    torch.manual_seed(2)
    ours = DiffusersTransformer("hunyuan_video15", config=architecture("hunyuan_video15_tiny"), text_len=TEXT_LEN,
                                text_dim=16, glyph_len=GLYPH_LEN, glyph_dim=GLYPH_DIM).eval()
    assert ours.condition_keys == ("text", "text_mask", "glyph_text", "glyph_text_mask")
    ours.set_null_condition({key: value[0] for key, value in null.items()})
    calls = recorded_calls(ours.transformer)
    with torch.no_grad():
        hunyuan_pipeline(hunyuan, ours.transformer)(prompt=PROMPT, height=16, width=16, num_frames=5,
                                                    num_inference_steps=2, output_type="latent",
                                                    generator=torch.Generator().manual_seed(3))
    pipeline_calls = list(calls)
    assert len(pipeline_calls) == 4  # 2 steps x (conditional, unconditional)
    halves = (ours.model_condition(cond), ours.model_condition(ours.null_condition(1)))
    for i, call in enumerate(pipeline_calls):
        calls.clear()
        with torch.no_grad():
            out = ours(call["hidden_states"][:, :4], call["timestep"], halves[i % 2])  # (1, 4, 3, 4, 4)
            expected = ours.transformer(**call, return_dict=False)[0]
        given = calls[0]
        assert torch.equal(given["hidden_states"], call["hidden_states"])
        assert torch.equal(given["timestep"], call["timestep"])
        glyph_mask, text_mask = call["encoder_attention_mask_2"].bool(), call["encoder_attention_mask"].bool()
        assert glyph_mask.sum() == (0 if i % 2 else len('Text "OPEN 24h". ') + 1)  # + </s>; the null: none
        assert torch.equal(given["encoder_attention_mask_2"], glyph_mask)
        torch.testing.assert_close(given["encoder_hidden_states_2"], call["encoder_hidden_states_2"], rtol=1e-6,
                                   atol=1e-6)
        assert torch.equal(given["encoder_attention_mask"], text_mask)
        torch.testing.assert_close(given["encoder_hidden_states"], call["encoder_hidden_states"] * text_mask[..., None],
                                   rtol=1e-6, atol=1e-6)  # the pipeline's states on the real tokens
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    dropped = ours.drop_condition(halves[0], torch.tensor([True]))
    for key in ("glyph_text", "glyph_text_mask", "text"):
        assert torch.equal(dropped[key], halves[1][key]), key


# ---- prepare -> train.py (one process and a ring of 2) -> infer.py ------------------------------------------------

TRAIN = ["experiment=hunyuan_video15_tiny", "data=text_latents", "data.batch_size=2", "data.val_fraction=0.25",
         "trainer.max_steps=3", "logger=csv", "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5",
         "callbacks.model_checkpoint.every_n_train_steps=3", "trainer.val_check_interval=3",
         "callbacks.sample_grid.steps=2", "callbacks.sample_grid.per_class=1"]  # a short preview, decoded by the VAE


@pytest.mark.timeout(900)  # two training runs and a sampling run, each a new process importing diffusers
def test_prepare_train_on_a_ring_and_sample_with_glyph_text(hunyuan, glyph_data, tmp_path):
    """The prepared glyph text trains the same SGD steps on one process and a ring of 2 (the joined text, 1 + 256 + 8
    tokens, sharded after the video); the model keeps the empty prompt's glyph text as its null condition; infer.py
    encodes quoted prompts with the data's glyph encoder, and refuses prompt embeddings without glyph text."""
    from tests.families import assert_sgd_steps_equal_one_process_and_ring2
    from tests.helpers import assert_refused, fail_fast, model_weights, run

    assert_sgd_steps_equal_one_process_and_ring2(tmp_path, [*TRAIN, f"data.path={glyph_data}"], steps=3,
                                                 synthetic=False)
    assert list((tmp_path / "ring2" / "samples").glob("step_0000003*"))  # the preview, decoded with the VAE
    weights = model_weights(tmp_path / "ring1")
    assert weights["model.null_glyph_text"].shape == (1, GLYPH_LEN, GLYPH_DIM)
    assert not weights["model.null_glyph_text_mask"].any()
    ckpt = tmp_path / "ring1" / "checkpoints" / "last.ckpt"
    out = tmp_path / "infer"
    run("infer.py", out, f"ckpt_path={ckpt}", "num_samples=2", "diffusion.sampling.steps=2",
        "diffusion.sampling.cfg_scale=6",
        """prompts=['a red fox "OPEN" running','a blue cat']""", "negative_prompt='a \u201csky\u201d'",
        env={"HF_HUB_OFFLINE": "1"})
    import numpy as np

    samples = np.load(out / "samples.npz")
    assert samples["latents"].shape == (2, 4, 3, 4, 4)
    assert list(samples["captions"]) == ['a red fox "OPEN" running', "a blue cat"]

    from safetensors.torch import save_file

    save_file({"text": torch.zeros(1, TEXT_LEN, 16)}, str(tmp_path / "no_glyph.safetensors"))
    proc, _ = fail_fast("infer.py", f"ckpt_path={ckpt}", f"text_embeds={tmp_path / 'no_glyph.safetensors'}",
                        f"hydra.run.dir={tmp_path / 'refused'}")
    assert_refused(proc, r"text_embeds: the model was trained with glyph text \(256, 8\) .* but the prompt "
                         r"embeddings have none; encode them as the data were \(prepare's glyph_encoder\)")


# ---- refusals -------------------------------------------------------------------------------------------------------


def test_glyph_settings_and_data_are_refused_in_one_line(hunyuan, glyph_data, tmp_path, capsys):
    """Prepare: a glyph encoder without HunyuanVideo 1.5's template or with another, another part of the pipeline as
    the glyph encoder, a folder that is not there, a tokenizer that is not ByT5's, a tokenizer alone (a re-run that
    adds a glyph_encoder re-encodes only the text); train.py: glyph data for a family that reads none, glyph text of another width; the
    reader: glyph text without its mask, shards with and without it. Each one ConfigError line, before any work."""
    from ringdit.models.diffusers import DiffusersTransformer
    from ringdit.prepare import main
    from tests.helpers import prepare_train

    clips = tmp_path / "clips"
    clips.mkdir()
    write_video(clips / "a.mp4", 5, seed=1, size=(32, 24))
    (clips / "a.txt").write_text(CAPTIONS[0])
    out = tmp_path / "out"

    def prepare(**kwargs):
        settings = VIDEO | {"glyph_encoder": str(hunyuan), "progress": False} | kwargs
        return encode_folder(str(clips), str(out), str(hunyuan), str(hunyuan), **settings)

    cases = [
        ({"prompt_template": None}, (r"glyph_encoder=.* encodes a prompt's quoted text as HunyuanVideo 1.5's "
                                     r"pipeline does \(its ByT5\), but prompt_template=null; pass prompt_template="
                                     r"hunyuan_video15 with its Qwen2.5-VL text_encoder, or drop glyph_encoder")),
        ({"prompt_template": "flux2"}, r"glyph_encoder=.* but prompt_template=flux2; pass prompt_template=hunyuan_video15"),
        ({"glyph_encoder": str(hunyuan / "text_encoder")},
         r"glyph_encoder=.*text_encoder: .* holds Qwen2_5_VLTextModel, not the T5EncoderModel \(ByT5\)"),
        ({"glyph_encoder": str(hunyuan / "vae")}, (r"glyph_encoder=.*vae: .* holds no transformers model \(its "
                                                   r"config.json has no model_type\), not the T5EncoderModel")),
        ({"glyph_encoder": str(tmp_path / "nowhere")}, r"glyph_encoder=.*nowhere does not exist"),
        ({"glyph_tokenizer": str(hunyuan / "tokenizer")},
         (r"glyph_tokenizer=.*tokenizer is \w+, not the ByT5Tokenizer HunyuanVideo 1.5's glyph encoder reads; pass its "
          r"pipeline's tokenizer_2/ folder")),
        ({"glyph_encoder": None, "glyph_tokenizer": str(hunyuan / "tokenizer_2")},
         r"glyph_tokenizer=.* is the tokenizer of glyph_encoder, which is not set"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            prepare(**kwargs)
        assert not any(out.glob("shard-*")), kwargs
    prepare(glyph_encoder=None)  # shards without glyph text, then a re-run with it: another text encoder, whose
    latents = (out / "shard-00000.safetensors").read_bytes()  # text files are encoded again, the latents kept
    assert prepare().texts_encoded == 1 and (out / "shard-00000.safetensors").read_bytes() == latents
    assert read_shard(out / "shard-00000.safetensors")[0]["glyph_text"].shape[1] == 256
    capsys.readouterr()  # the loading bars so far
    with pytest.raises(SystemExit) as exit_info:  # the command line: one line, exit code 2
        main([f"input={clips}", f"out={tmp_path / 'cli'}", f"vae={hunyuan}", f"text_encoder={hunyuan}",
              f"glyph_encoder={hunyuan}"])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "but prompt_template=null" in error.splitlines()[0], error
    assert "Traceback" not in error and not (tmp_path / "cli").exists()

    from hydra.errors import InstantiationException

    with pytest.raises((ValueError, InstantiationException)) as raised:
        prepare_train(["experiment=wan_tiny", "data=text_latents", f"data.path={glyph_data}"], tmp_path / "run")
    assert re.search(r"the data hold glyph text \(glyph_text 256 x 8: .*\), which model.family=wan does not read; "
                     r"prepare the data without glyph_encoder, or train model=hunyuan_video15",
                     f"{raised.value} {raised.value.__cause__}"), raised.value
    with pytest.raises(ConfigError, match=r"the data's glyph text embeddings have width 5 but the model's "
                                          r"text_embed_2_dim is 8"):
        DiffusersTransformer("hunyuan_video15", config=architecture("hunyuan_video15_tiny"), glyph_len=4, glyph_dim=5)

    from ringdit.data.text_latents import TextLatentsDataModule, write_text_latents

    latents, text = torch.zeros(2, 4, 3, 4, 4), torch.zeros(2, TEXT_LEN, 16)
    glyph = {"glyph_text": torch.zeros(2, 6, GLYPH_DIM), "glyph_text_mask": torch.zeros(2, 6, dtype=torch.bool)}
    with pytest.raises(ValueError, match=r"glyph holds \['glyph_text'\]; give both glyph_text, glyph_text_mask"):
        write_text_latents(tmp_path / "x.safetensors", latents, text, glyph={"glyph_text": glyph["glyph_text"]})
    from safetensors.torch import save_file

    lone = tmp_path / "lone"
    lone.mkdir()
    save_file({"latents": latents, "text": text, "glyph_text": glyph["glyph_text"]}, str(lone / "a.safetensors"))
    with pytest.raises(ConfigError, match=r"holds glyph_text but no glyph_text_mask; write both"):
        TextLatentsDataModule(str(lone))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_text_latents(mixed / "a.safetensors", latents, text, glyph=glyph)
    write_text_latents(mixed / "b.safetensors", latents, text)
    with pytest.raises(ConfigError, match=r"b.safetensors has glyph text \(G, D_g\) None but a.safetensors has "
                                          r"\(6, 8\)"):
        TextLatentsDataModule(str(mixed))
