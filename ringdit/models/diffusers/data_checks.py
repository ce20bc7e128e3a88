"""Whether the data fit a diffusers model of a family: the latents' shape and channels, the text, pooled and glyph
embeddings' widths, an image-to-video family's first-frame conditioning and its input channels, a control-video
family's control latents, and the audio latents of a family that generates sound with the video."""

from __future__ import annotations

from ringdit.common.errors import ConfigError
from ringdit.models.conditioning import AUDIO_KEY, CONTROL_KEY
from ringdit.models.diffusers.families import Family
from ringdit.models.diffusers.image_to_video import CONDITION_KEY


def check_width(what: str, width: int, key: str, arch: dict) -> None:
    if width != arch[key]:
        raise ConfigError(f"the data's {what} have width {width} but the model's {key} is {arch[key]}: encode the "
                          f"captions with the model's own text encoder(s)")


def glyph_shape(family: Family, data: dict) -> dict:
    """``glyph_len`` / ``glyph_dim`` of the data's glyph text for a family that reads it, {} for data without it; a
    ConfigError for glyph text that the model would not read."""
    if not data.get("glyph_len"):
        return {}
    if family.glyph_dim is None:
        raise ConfigError(f"the data hold glyph text (glyph_text {data['glyph_len']} x {data['glyph_dim']}: "
                          f"HunyuanVideo 1.5's ByT5 states of the captions' quoted text), which "
                          f"model.family={family.name} does not read; prepare the data without glyph_encoder, or "
                          f"train model=hunyuan_video15")
    return {"glyph_len": data["glyph_len"], "glyph_dim": data["glyph_dim"]}


def image_embeds_width(family: Family, arch: dict) -> int | None:
    """The width of the image embeddings (the data's ``image_embeds``) a model of ``arch`` reads; None: none."""
    return arch.get(family.image_embeds) if family.image_embeds else None


def check_image_architecture(family: Family, arch: dict) -> None:
    """Wan 2.1 I2V takes [video ; mask (4) ; image latents] on its input channels, HunyuanVideo 1.5 I2V [video ;
    image latents ; mask (1)]; Wan 2.2 TI2V the video alone."""
    if family.image_condition == "first_frame_channels" and arch["in_channels"] != 2 * arch["out_channels"] + 1:
        raise ConfigError(f"model.family={family.name} takes [video ; first-frame latents ; mask] on its channels: "
                          f"in_channels must be 2 * out_channels + 1 = {2 * arch['out_channels'] + 1}, got "
                          f"{arch['in_channels']}; use model=hunyuan_video15_i2v*")
    if family.image_condition == "channels" and arch["in_channels"] != 2 * arch["out_channels"] + 4:
        raise ConfigError(f"model.family={family.name} takes [video ; mask ; first-frame latents] on its channels: "
                          f"in_channels must be 2 * out_channels + 4 = {2 * arch['out_channels'] + 4}, got "
                          f"{arch['in_channels']}; use model=wan_i2v* (or model.family=wan for a text-to-video model)")
    if family.image_condition == "first_frame" and arch["in_channels"] != arch["out_channels"]:
        raise ConfigError(f"model.family={family.name} replaces the first latent frame: in_channels "
                          f"({arch['in_channels']}) must equal out_channels ({arch['out_channels']}); for "
                          f"[video ; mask ; image] inputs use model.family=wan_i2v")


# Wan's attention processor cuts the image keys off the front of [image ; text] as "all but the last 512"
WAN_IMAGE_TEXT_LEN = 512


def check_image_data(config: dict, family: Family, data: dict) -> None:
    """An image-to-video model needs the data's first-frame conditioning (``data["image_keys"]``: the image keys its
    samples hold, text_latents' describe()); a control-video model its control latents."""
    check_audio_data(config, family, data)
    if CONTROL_KEY in family.condition_keys and CONTROL_KEY not in data.get("image_keys", ()):
        width = (config.get("config") or {}).get("vace_in_channels", "<model.config.vace_in_channels>")
        raise ConfigError(f"model.family={family.name} denoises under a control video, but the data has no 'control' "
                          f"latents (N, vace_in_channels, T, H, W) beside the clips'; give data that hold them, e.g. "
                          f"data=synthetic_text_latents data.control={width}")
    if family.image_condition is None:
        return
    keys = set(data.get("image_keys", ()))
    needed = CONDITION_KEY[family.image_condition]
    what = {"image_latents": "the first frame's latents, encoded alone (Wan 2.2 TI2V, HunyuanVideo 1.5 I2V)",
            "image_condition": "the latents of [first frame ; zero frames] (Wan 2.1 I2V)",
            "reference": "the reference image's latents (Qwen-Image-Edit)"}[needed]
    if needed not in keys and needed == "reference":
        raise ConfigError(f"model.family={family.name} edits a reference image but the data has no 'reference' "
                          f"({what}); prepare it with `python -m ringdit.prepare reference=<folder of reference "
                          f"images>`, e.g. data=synthetic_text_latents data.reference=true")
    if needed not in keys:
        raise ConfigError(f"model.family={family.name} is image-to-video but the data has no {needed!r} ({what}); "
                          f"prepare it with `python -m ringdit.prepare task=i2v`, or use a text-to-video model")
    arch = config.get("config") or {}
    width = image_embeds_width(family, arch)
    if width and "image_embeds" not in keys:
        optional = family.image_condition == "channels"  # Wan 2.1 I2V trains without CLIP too (no image_dim)
        raise ConfigError(f"model.config.{family.image_embeds}={width}: the model takes image embeddings but the data "
                          f"has no 'image_embeds'; prepare with image_encoder=<the pipeline folder (its "
                          f"image_encoder/)>" + (f", or set model.config.{family.image_embeds}=null" if optional
                                                 else ""))
    if arch.get("image_dim"):
        if data["text_len"] != WAN_IMAGE_TEXT_LEN:
            raise ConfigError(f"model.config.image_dim is set, so Wan's attention takes the last 512 keys as text, "
                              f"but the data's captions are {data['text_len']} tokens; encode them padded to 512 "
                              f"(prepare max_text_len=512)")


def check_audio_data(config: dict, family: Family, data: dict) -> None:
    """A family that generates sound with the video (LTX-2) needs the clips' audio latents; a family that neither
    generates nor reads sound must not be given them (it would train on the video alone, silently)."""
    keys = data.get("image_keys", ())
    if AUDIO_KEY in family.joint_latents and AUDIO_KEY not in keys:
        arch = config.get("config") or {}
        width = arch.get("audio_in_channels")
        bins = 16 if width and width >= 128 and width % 16 == 0 else 2  # LTX-2's audio VAE: 8 channels x 16 mel bins
        example = f"[{width // bins},5,{bins}]" if width and width % bins == 0 else "[channels,frames,mel_bins]"
        if family.audio_frame is not None and width:  # the family's own layout of an audio latent frame
            channels, features = family.audio_frame(arch)
            example = f"[{channels},5,{features}]"
        raise ConfigError(f"model.family={family.name} generates video and audio together, but the data has no "
                          f"'audio' latents (N, channels, L, features) beside the clips'; give data that hold them, "
                          f"e.g. data=synthetic_text_latents data.audio={example}")
    check_audio_rate(config, data)
    check_audio_latent_rate(family, data)
    if data.get("audio_text_dim") and "audio_text" not in family.condition_keys:
        raise ConfigError(f"the data hold audio prompt states (audio_text, {data['audio_text_dim']} wide: LTX-2's text "
                          f"connectors' audio output), which model.family={family.name} does not read; prepare the "
                          f"captions with this model's own text encoder (without prompt_template=ltx2), or train "
                          f"model=ltx2")
    if AUDIO_KEY in keys and AUDIO_KEY not in family.joint_latents + family.condition_keys:
        raise ConfigError(f"the data hold the clips' 'audio' latents, but model.family={family.name} generates no "
                          f"sound: it would train on the video alone; train an audio-video model (model=ltx2), or "
                          f"give data without audio")


def check_latent_shape(size: tuple[int, ...], patch: tuple[int, ...], data_channels: int | None, channels: int) -> None:
    if len(size) != len(patch):
        raise ConfigError(f"the data's latents have shape {list(size)} but the model patches {len(patch)}-D "
                          f"{'videos (T, H, W)' if len(patch) == 3 else 'images (H, W)'}")
    if any(s % p for s, p in zip(size, patch)):
        raise ConfigError(f"the data's latent shape {list(size)} is not divisible by the model's patch size "
                          f"{list(patch)}; crop or pad the latents to a multiple of it")
    if data_channels is not None and data_channels != channels:
        raise ConfigError(f"the data's latents have {data_channels} channels but the model takes {channels}: "
                          f"encode with the model's own VAE")


def check_audio_rate(config: dict, data: dict) -> None:
    """Audio latents that prepare encoded (its ``audio_vae`` record: the audio VAE's sample rate and mel hop) fit a
    model whose audio is timed at ``audio_sampling_rate`` / ``audio_hop_length`` (LTX-2's RoPE places its audio tokens
    in seconds of them): another rate would play the sound at another speed than the video."""
    audio_vae, arch = data.get("audio_vae"), config.get("config") or {}
    if not audio_vae or "audio_sampling_rate" not in arch:
        return
    rate, hop = audio_vae.get("sample_rate"), audio_vae.get("mel_hop_length")
    if (rate, hop) != (arch["audio_sampling_rate"], arch.get("audio_hop_length", hop)):
        where = (data.get("source") or {}).get("path", "data.path")
        raise ConfigError(f"data.path={where}: the audio latents were encoded by an audio VAE at {rate} Hz with a mel "
                          f"hop of {hop} ({audio_vae.get('path')}), but the model's audio is at "
                          f"model.config.audio_sampling_rate={arch['audio_sampling_rate']} with audio_hop_length="
                          f"{arch.get('audio_hop_length')}: the sound would play at another speed than the video; "
                          f"prepare the clips again with the audio VAE of the model's own pipeline (audio_vae=), or "
                          f"train a model of that rate")


def check_audio_latent_rate(family: Family, data: dict) -> None:
    """Audio latents that prepare encoded (its ``audio_vae`` record) at the family's ``audio_latent_rate`` (MiniMax-H3
    times 40 audio latents a second against its video): another rate would play the sound at another speed."""
    audio_vae = data.get("audio_vae")
    if not audio_vae or family.audio_latent_rate is None:
        return
    rate, hop = audio_vae.get("sample_rate"), audio_vae.get("hop_length")
    per_second = rate / hop if rate and hop else None  # no hop_length: an audio VAE of mel frames (LTX-2's)
    if per_second != family.audio_latent_rate:
        where = (data.get("source") or {}).get("path", "data.path")
        encoded = f"{per_second:g} latents a second" if per_second else "mel frames"
        raise ConfigError(f"data.path={where}: the audio latents were encoded by {audio_vae.get('class')} at {rate} "
                          f"Hz ({encoded}; {audio_vae.get('path')}), but model.family={family.name} times its sound "
                          f"at {family.audio_latent_rate:g} latents a second: the sound would play at another speed "
                          f"than the video; prepare the clips again with the audio VAE of the model's own pipeline "
                          f"(audio_vae=)")
