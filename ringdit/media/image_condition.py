"""Image-to-video conditioning from pixels: what ``python -m ringdit.prepare task=i2v`` stores for every clip and what
``infer.py image=`` encodes for its images, by the same code (the optional keys of ringdit/data/text_latents.py):

    image_latents    (B, C, 1, h, w)   the first frame encoded ALONE as a 1-frame video; Wan's VAE is causal, so this
                                       is what Wan 2.2 TI2V puts in the first latent frame (WanImageToVideoPipeline
                                       with ``expand_timesteps``: its ``latent_condition``)
    image_condition  (B, C, T', h, w)  the VAE latents of ``[first frame ; T - 1 zero frames]`` at the clip's frame
                                       count T (T' = 1 + (T - 1) / temporal): WanImageToVideoPipeline's
                                       ``latent_condition`` for Wan 2.1 I2V (the mask it concatenates is the
                                       model's to build)
    image_embeds     (B, N_img, D_img) CLIP vision penultimate hidden states (the pipeline's ``encode_image``), only
                                       with an ``image_encoder``

Both latents are normalised exactly like the clip's ``latents`` (``VAE.encode``: ``(z - latents_mean) /
latents_std``, as the pipeline normalises ``latent_condition``). The first frame is the one the clip's bucket shows
(cropped and resized by ``frames.fit``, as prepare places a clip; infer's images take the same rule for the size
asked), and CLIP is given that same frame as an 8-bit RGB image through its ``CLIPImageProcessor``, so that training
and sampling condition on the same picture.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ringdit.errors import ConfigError
from ringdit.media.frames import image_pixels, to_image, upright_size
from ringdit.media.pretrained import REMOTE_CODE, find_folder
from ringdit.models.diffusers.folders import check_weights_folder

log = logging.getLogger("ringdit.media")

VISION_ENCODERS = ("clip_vision_model", "clip")  # config.json model_type: CLIPVisionModel loads either


def first_frame_condition(encode, first: torch.Tensor, frames: int) -> dict[str, torch.Tensor]:
    """``first`` (B, 3, H, W) pixels in [-1, 1] -> ``image_latents`` (B, C, 1, h, w) and ``image_condition``
    (B, C, T', h, w) for clips of ``frames`` frames. ``encode``: ``VAE.encode`` (or prepare's tile-parallel one,
    so under ``parallel_vae=true`` these encodes are split over the ranks like the clips')."""
    image = first[:, :, None]  # (B, 3, 1, H, W)
    zeros = image.new_zeros(image.shape[0], image.shape[1], frames - 1, *image.shape[-2:])  # grey in [-1, 1]
    return {"image_latents": encode(image), "image_condition": encode(torch.cat([image, zeros], dim=2))}


def image_encoder_folders(image_encoder, image_processor=None) -> tuple[Path, Path]:
    """(the CLIPVisionModel folder, its CLIPImageProcessor folder), checked (config, model type, safetensors
    headers) without loading anything: ``image_encoder`` is the model's folder or a pipeline folder with
    ``image_encoder/`` (Wan2.1-I2V's); ``image_processor`` None: ``image_processor/`` beside it, else its own
    folder."""
    folder = find_folder(image_encoder, "image_encoder", "config.json", "image_encoder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"image_encoder={image_encoder}: {folder / 'config.json'} cannot be read as JSON "
                          f"({error}); pass the folder CLIPVisionModel.save_pretrained wrote") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in VISION_ENCODERS:
        raise ConfigError(f"image_encoder={image_encoder}: model_type {model_type!r} is not a CLIP vision model "
                          f"({', '.join(VISION_ENCODERS)}); pass a CLIPVisionModel folder (Wan2.1-I2V's "
                          f"image_encoder/)")
    check_weights_folder(folder, setting="image_encoder", value=image_encoder, class_name="CLIPVisionModel",
                         library="transformers")
    if image_processor is None:
        beside = folder.parent / "image_processor"
        image_processor = beside if (beside / "preprocessor_config.json").is_file() else folder
    processor = find_folder(image_processor, "image_processor", "preprocessor_config.json", "image_processor")
    return folder, processor


class ImageEncoder:
    """A local CLIP vision model: RGB images -> its penultimate hidden states (N, N_img, D_img), as
    WanImageToVideoPipeline.encode_image computes them."""

    def __init__(self, image_encoder, image_processor=None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        import transformers

        self.folder, self.processor_folder = image_encoder_folders(image_encoder, image_processor)
        try:  # safetensors only (checked above): a pickled .bin can run code
            self.model = transformers.CLIPVisionModel.from_pretrained(str(self.folder), dtype=dtype,
                                                                      use_safetensors=True, **REMOTE_CODE)
            self.processor = transformers.CLIPImageProcessor.from_pretrained(str(self.processor_folder),
                                                                             **REMOTE_CODE)
        except (OSError, ValueError, RuntimeError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"image_encoder={image_encoder}: cannot load the CLIP vision model from {self.folder} "
                              f"or its image processor from {self.processor_folder} ({first}); save them with "
                              f"save_pretrained (safetensors)") from None
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.dtype = torch.device(device), dtype
        self.dim = int(self.model.config.hidden_size)

    @torch.no_grad()
    def __call__(self, images) -> torch.Tensor:
        inputs = self.processor(images=list(images), return_tensors="pt")
        out = self.model(pixel_values=inputs.pixel_values.to(self.device, self.dtype), output_hidden_states=True)
        return out.hidden_states[-2].float().cpu()  # (N, N_img, D_img): the penultimate layer, as the pipeline

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
    ``vae`` metadata ``path``); ``image_encoder`` (+ ``image_processor``): its CLIP, for ``image_embeds``. Each image
    is turned upright, centre-cropped to the aspect ratio of ``size`` and resized (``frames.fit``), as prepare
    places a clip."""
    from ringdit.dtypes import dtype_named
    from ringdit.media.vae import VAE

    if isinstance(dtype, str):
        dtype = dtype_named("dtype", dtype)
    if not images:
        raise ConfigError("image: no images given; pass image=<file or folder of images>")
    height, width = (int(s) for s in size)
    codec = VAE(vae_folder, device=device, dtype=dtype, tiling=tiling, tile=tile)
    if not codec.is_video:
        raise ConfigError(f"image-to-video needs a video VAE, but {vae_folder} is {codec.class_name}; pass the "
                          f"video VAE the clips were prepared with")
    if not codec.frames_ok(frames):
        raise ConfigError(f"frames={frames}: {codec.class_name} encodes 1 + k * {codec.temporal} frames; pass e.g. "
                          f"frames={1 + max(0, frames - 1) // codec.temporal * codec.temporal}")
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
