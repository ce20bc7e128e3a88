"""Image-to-video conditioning from pixels: what ``python -m ringdit.prepare task=i2v`` stores for every clip and what
``infer.py image=`` encodes for its images, by the same code (the optional keys of ringdit/data/text_latent_shards.py):

    image_latents    (B, C, 1, h, w)   the first frame encoded ALONE as a 1-frame video; Wan's VAE is causal, so this
                                       is what Wan 2.2 TI2V puts in the first latent frame (WanImageToVideoPipeline
                                       with ``expand_timesteps``: its ``latent_condition``)
    image_condition  (B, C, T', h, w)  the VAE latents of ``[first frame ; T - 1 zero frames]`` at the clip's frame
                                       count T (T' = 1 + (T - 1) / temporal): WanImageToVideoPipeline's
                                       ``latent_condition`` for Wan 2.1 I2V (the mask it concatenates is the
                                       model's to build)
    image_embeds     (B, N_img, D_img) the image encoder's states, only with an ``image_encoder``: a CLIP vision
                                       model's penultimate hidden states (WanImageToVideoPipeline's
                                       ``encode_image``), a SigLIP vision model's last hidden state
                                       (HunyuanVideo15ImageToVideoPipeline's ``encode_image``, 729 x 1152 for the
                                       published one)

Both latents are normalised exactly like the clip's ``latents`` (``VAE.encode``: ``(z - latents_mean) /
latents_std``, as the pipeline normalises ``latent_condition``). The first frame is the one the clip's bucket shows
(cropped and resized by ``frames.fit``, as prepare places a clip; infer's images take the same rule for the size
asked), and the image encoder is given that same frame as an 8-bit RGB image through its own image processor, so that
training and sampling condition on the same picture. HunyuanVideo 1.5 I2V puts ``image_latents`` in the first frame of
its condition channels (``HunyuanVideo15ImageToVideoPipeline``'s ``image_latents``: the image encoded alone, scaled by
the VAE's scaling factor as the clip's latents are).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ringdit.common.dtypes import dtype_named
from ringdit.common.errors import ConfigError
from ringdit.media.frames import image_pixels, to_image, upright_size
from ringdit.media.pretrained import REMOTE_CODE, find_folder
from ringdit.media.vae import VAE
from ringdit.models.diffusers.folders import check_weights_folder

log = logging.getLogger("ringdit.media")


@dataclass(frozen=True)
class VisionEncoder:
    """How one kind of image encoder is loaded and read, as its pipeline does."""

    model: str       # the transformers class of the vision model
    processor: str   # ... and of its image processor
    layer: int       # the hidden states taken: -2 the penultimate layer's, -1 the last (after the final norm)
    call: dict       # the processor's keywords in the pipeline's call


# config.json model_type -> the encoder (the vision class loads a whole CLIP / SigLIP checkpoint too)
CLIP = VisionEncoder("CLIPVisionModel", "CLIPImageProcessor", -2, {})  # WanImageToVideoPipeline.encode_image
# HunyuanVideo15ImageToVideoPipeline._get_image_embeds: last_hidden_state, preprocess(do_resize, do_convert_rgb)
SIGLIP = VisionEncoder("SiglipVisionModel", "SiglipImageProcessor", -1, {"do_resize": True, "do_convert_rgb": True})
VISION_ENCODERS = {"clip_vision_model": CLIP, "clip": CLIP, "siglip_vision_model": SIGLIP, "siglip": SIGLIP}
PROCESSOR_FOLDERS = ("image_processor", "feature_extractor")  # beside image_encoder/: Wan's name, HunyuanVideo's


def first_frame_condition(encode, first: torch.Tensor, frames: int) -> dict[str, torch.Tensor]:
    """``first`` (B, 3, H, W) pixels in [-1, 1] -> ``image_latents`` (B, C, 1, h, w) and ``image_condition``
    (B, C, T', h, w) for clips of ``frames`` frames. ``encode``: ``VAE.encode`` (or prepare's tile-parallel one,
    so under ``parallel_vae=true`` these encodes are split over the ranks like the clips')."""
    image = first[:, :, None]  # (B, 3, 1, H, W)
    zeros = image.new_zeros(image.shape[0], image.shape[1], frames - 1, *image.shape[-2:])  # grey in [-1, 1]
    return {"image_latents": encode(image), "image_condition": encode(torch.cat([image, zeros], dim=2))}


def image_encoder_folders(image_encoder, image_processor=None) -> tuple[Path, Path, VisionEncoder]:
    """(the vision model's folder, its image processor's folder, its kind), checked (config, model type, safetensors
    headers) without loading anything: ``image_encoder`` is the model's folder or a pipeline folder with
    ``image_encoder/`` (Wan2.1-I2V's CLIP, HunyuanVideo-1.5 I2V's SigLIP); ``image_processor`` None:
    ``image_processor/`` or ``feature_extractor/`` beside it, else its own folder."""
    folder = find_folder(image_encoder, "image_encoder", "config.json", "image_encoder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"image_encoder={image_encoder}: {folder / 'config.json'} cannot be read as JSON "
                          f"({error}); pass the folder the vision model's save_pretrained wrote") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in VISION_ENCODERS:
        raise ConfigError(f"image_encoder={image_encoder}: model_type {model_type!r} is not a CLIP vision model nor a "
                          f"SigLIP one ({', '.join(VISION_ENCODERS)}); pass a CLIPVisionModel folder (Wan2.1-I2V's "
                          f"image_encoder/) or a SiglipVisionModel folder (HunyuanVideo-1.5 I2V's image_encoder/)")
    kind = VISION_ENCODERS[model_type]
    check_weights_folder(folder, setting="image_encoder", value=image_encoder, class_name=kind.model,
                         library="transformers")
    if image_processor is None:
        beside = [folder.parent / name for name in PROCESSOR_FOLDERS]
        image_processor = next((b for b in beside if (b / "preprocessor_config.json").is_file()), folder)
    processor = find_folder(image_processor, "image_processor", "preprocessor_config.json", "image_processor")
    return folder, processor, kind


class ImageEncoder:
    """A local vision model: RGB images -> its states (N, N_img, D_img) as the pipeline that uses it computes them: a
    CLIP's penultimate hidden states (WanImageToVideoPipeline.encode_image), a SigLIP's last hidden state
    (HunyuanVideo15ImageToVideoPipeline._get_image_embeds)."""

    def __init__(self, image_encoder, image_processor=None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        import transformers

        self.folder, self.processor_folder, self.kind = image_encoder_folders(image_encoder, image_processor)
        try:  # safetensors only (checked above): a pickled .bin can run code
            self.model = getattr(transformers, self.kind.model).from_pretrained(
                str(self.folder), dtype=dtype, use_safetensors=True, **REMOTE_CODE)
            self.processor = getattr(transformers, self.kind.processor).from_pretrained(
                str(self.processor_folder), **REMOTE_CODE)
        except (OSError, ValueError, RuntimeError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"image_encoder={image_encoder}: cannot load the {self.kind.model} from {self.folder} "
                              f"or its image processor from {self.processor_folder} ({first}); save them with "
                              f"save_pretrained (safetensors)") from None
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.dtype = torch.device(device), dtype
        self.dim = int(self.model.config.hidden_size)

    @torch.no_grad()
    def __call__(self, images) -> torch.Tensor:
        inputs = self.processor(images=list(images), return_tensors="pt", **self.kind.call)
        pixels = inputs.pixel_values.to(self.device, self.dtype)
        if self.kind.layer == -1:  # the last hidden state after the model's final norm (SigLIP's post_layernorm)
            return self.model(pixel_values=pixels).last_hidden_state.float().cpu()  # (N, N_img, D_img)
        out = self.model(pixel_values=pixels, output_hidden_states=True)
        return out.hidden_states[self.kind.layer].float().cpu()  # (N, N_img, D_img): the penultimate layer (CLIP)

    def describe(self) -> dict:
        """What a shard records as its ``image_encoder`` metadata key (so sampling can encode images the same way)."""
        return {"class": type(self.model).__name__, "path": str(self.folder.resolve()),
                "image_processor": str(self.processor_folder.resolve()), "dim": self.dim}


def encode_image_condition(images, *, vae_folder, frames: int, size: tuple[int, int], image_encoder=None,
                           image_processor=None, device: str | torch.device = "cpu",
                           dtype: torch.dtype | str = torch.float32, tiling: bool = True,
                           tile: int | None = None) -> dict[str, torch.Tensor]:
    """``images`` (PIL images) as the first frames of ``frames``-frame clips of ``size`` (H, W) pixels: the keys of
    the module docstring, batched (B = len(images)), float32 on the CPU. ``vae_folder``: the data's VAE (a shard's
    ``vae`` metadata ``path``); ``image_encoder`` (+ ``image_processor``): its CLIP / SigLIP, for ``image_embeds``.
    Each image
    is turned upright, centre-cropped to the aspect ratio of ``size`` and resized (``frames.fit``), as prepare
    places a clip."""
    if isinstance(dtype, str):
        dtype = dtype_named("dtype", dtype)
    if not images:
        raise ConfigError("image: no images given; pass image=<file or folder of images>")
    height, width = (int(s) for s in size)
    codec = VAE(vae_folder, device=device, dtype=dtype, tiling=tiling, tile=tile)
    if not codec.is_video:
        raise ConfigError(f"image-to-video needs a video VAE, but {vae_folder} is {codec.class_name}; pass the "
                          f"video VAE the clips were prepared with")
    codec.check_frames(frames)
    if height % codec.spatial or width % codec.spatial or height < 1 or width < 1:
        raise ConfigError(f"size {height}x{width}: height and width must be positive multiples of {codec.class_name}"
                          f"'s downsampling factor {codec.spatial}")
    for index, image in enumerate(images):  # aspect ratio differs: say which crop is taken (prepare's rule)
        h, w = upright_size(image)
        if w * height != h * width:
            log.info("image %d (%dx%d) is centre-cropped to the %d:%d aspect ratio of %dx%d, then resized, as "
                     "prepare places clips", index, h, w, height, width, height, width)
    first = torch.stack([image_pixels(image, height, width) for image in images])  # (B, 3, H, W) in [-1, 1]
    cond = first_frame_condition(codec.encode, first, frames)
    if image_encoder is not None:
        clip = ImageEncoder(image_encoder, image_processor, device=device, dtype=dtype)
        cond["image_embeds"] = clip([to_image(pixels) for pixels in first])
    return {key: value.float().cpu() for key, value in cond.items()}


def first_frame_inputs(pictures, *, size: tuple[int, int], frames: int, latent: bool, vae: str | None,
                       image_encoder: str | None, channels: int, setting: str = "image",
                       device: str | None = None) -> dict[str, torch.Tensor]:
    """The first-frame conditioning of one sample per picture (PIL images, upright): a pixel-space model's first frame
    is the picture itself, resized to ``size`` (H, W); a latent model's is encoded with the data's VAE ``vae`` (and
    ``image_encoder``'s CLIP / SigLIP where the model takes it), as ``prepare task=i2v`` encodes a clip's first frame.
    float32 on the CPU, batch-first; ``setting`` names the input in errors."""
    height, width = size
    if latent:
        if not vae:
            raise ConfigError(f"{setting}: the model samples latents, so the image is encoded with the data's VAE, and "
                              f"no VAE folder is known; give vae=<the VAE folder the data was prepared with>")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        encoded = encode_image_condition(pictures, vae_folder=vae, frames=frames, size=(height, width),
                                         image_encoder=image_encoder, device=device, dtype=torch.float32)
        return {key: value.float().cpu() for key, value in encoded.items()}
    first = torch.stack([pixel_frame(p, channels, height, width) for p in pictures])[:, :, None]  # (n, C, 1, H, W)
    empty = first.new_zeros(first.shape[0], channels, frames - 1, height, width)  # the frames to generate
    return {"image_latents": first, "image_condition": torch.cat([first, empty], dim=2)}  # (n, C, T, H, W)


def pixel_frame(picture, channels: int, height: int, width: int) -> torch.Tensor:
    """(C, H, W) in [-1, 1], as the pixel-space data stores frames: grey for 1 channel, else RGB."""
    import numpy as np
    from PIL import Image

    picture = picture.convert("L" if channels == 1 else "RGB").resize((width, height), Image.Resampling.BICUBIC)
    values = torch.from_numpy(np.asarray(picture, dtype=np.float32)) / 127.5 - 1.0
    values = values[None] if values.dim() == 2 else values.permute(2, 0, 1)  # (C, H, W)
    if values.shape[0] != channels:
        raise ConfigError(f"image=: the pixel-space model takes {channels} channels; an image gives "
                          f"{values.shape[0]} (grey and RGB images are converted, other channel counts are not)")
    return values
