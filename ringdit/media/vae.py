"""A diffusers VAE loaded from a local folder, with the latent normalisation the model trains on.

The model consumes latents ``(z - shift) * scale``, per channel:

    AutoencoderKLWan / AutoencoderKLQwenImage    shift = latents_mean, scale = 1 / latents_std   (as WanPipeline)
    AutoencoderKLLTXVideo                        shift = latents_mean, scale = scaling_factor / latents_std, from the
                                                 model's latents_mean / latents_std BUFFERS (its weights, not its
                                                 config; LTXPipeline._normalize_latents)
    AutoencoderKLHunyuanVideo15                  shift = 0, scale = scaling_factor (HunyuanVideo15Pipeline)
    AutoencoderKLCogVideoX                       shift = 0, scale = scaling_factor (0.7 for CogVideoX 1.5; as
                                                 CogVideoXPipeline.decode_latents divides by it and CogVideo's
                                                 fine-tuning multiplies), its latent frames front-padded (below)
    AutoencoderKL                                shift = shift_factor (0 if None), scale = scaling_factor (Flux, SD)
                                                 with latents_mean / latents_std set (SDXL-style configs):
                                                 shift = latents_mean, scale = scaling_factor / latents_std
    AutoencoderKLFlux2                           per channel of the 2x2-PATCHIFIED latents (32 -> 128 channels at half
                                                 the size): shift = bn.running_mean, scale = 1 / sqrt(bn.running_var +
                                                 batch_norm_eps), the VAE's batch-norm statistics (Flux2Pipeline); the
                                                 result is unpatchified back to 32 channels, which the flux2 family
                                                 packs 2x2 into the pipeline's tokens. So sizes are multiples of 16 px

Patchified normalisation (``patch`` 2, Flux.2): ``latents = unpatchify((patchify(z) - shift) * scale)``, channel
``c * 4 + 2 * row + col`` of the patchified latents being sub-pixel (row, col) of channel c (Flux2Pipeline's
``_patchify_latents``); ``shift`` / ``scale`` have ``latent_channels * 4`` values in that order. ``patch`` 1 (every
other VAE): ``patchify`` is the identity.

CogVideoX's latent frames (``frame_pad`` 2): CogVideoX 1.5's transformer takes latent frames in pairs (patch_size_t
2), and its VAE decodes a clip's latents in pairs too, after an odd first group, so it gives back the frames it
encoded only for an odd latent count: 1 + 8k frames (9, 81, 161; 85 frames, 22 latents, would decode to 88 frames).
``encode`` therefore takes 1 + 8k frames (an image too: one frame) and puts a copy of the first latent frame in
front, which makes the count even -- CogVideo's own fine-tuning pads its latents so (``ncopy`` copies of the first
frame) --, and ``decode`` drops the first latent frame of an even count before decoding, as CogVideoXPipeline drops
the front latent frames it added (``latents[:, additional_frames:]``). Other frame counts are a ``ConfigError``
naming the nearest good ones (``check_frames``). (AutoencoderKLCogVideoX is CogVideoX 1.0's VAE as well, whose
transformer has no temporal patch; ringdit trains the 1.5 layout only, so the pad is always made.)

AutoencoderKLMiniMaxH3 (MiniMax-H3's): shift = latents_mean, scale = 1 / latents_std from its config (its modular
pipeline's ``encode_vae_condition`` / decode step); its pixels are ImageNet-normalised [0, 1] ((x - mean) / std with
ImageNet's mean and std, the pipeline's ``pixel_mean`` / ``pixel_std``), which ``encode`` / ``decode`` convert from /
to [-1, 1]; it encodes 17-frame chunks into 5 latent frames and drops 3 at the end, so it takes 17n + 5 frames
(5n + 2 latent frames; ``frame_rule``, the kind's ``chunks``).

``VAE.describe()`` records the class, shift, scale and patch (a JSON dict stored as the ``vae`` metadata key of every
shard) so that decoding can invert the normalisation without guessing.

Memory: a video VAE here is causal in time: it encodes 1 + 4k frames in steps of 4 and decodes one latent frame at a
time, carrying a small feature cache, so the activations stay bounded however long the clip; only the input and
output tensors grow with its length. ``tiling=True`` (the default) also splits each frame into overlapping spatial
tiles (diffusers' ``enable_tiling``, blended at the seams; ``tile`` sets the tile size in pixels, default 256) and
``enable_slicing`` runs a batch one sample at a time, so peak memory depends on the tile size rather than the frame
size or the batch (``benchmarks/vae_decode.py`` measures it). ``decode`` / ``encode`` with ``group=``: the tiles
split over the ranks of a running process group (``ringdit.media.parallel_vae``), the same result.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ringdit.common.errors import ConfigError
from ringdit.media.parallel_vae import parallel_decode, parallel_encode
from ringdit.models.diffusers.folders import check_config_values, check_weights_folder
from ringdit.models.frame_rule import FrameRule
from ringdit.models.vaes import VAE_KINDS

# AutoencoderKLMiniMaxH3's pixel convention (MiniMaxH3ModularPipeline.pixel_mean / pixel_std): ImageNet's
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def vae_folder(path: str | Path, subfolder: str | None = "vae", setting: str = "vae") -> Path:
    """``path/subfolder`` when it holds a config.json (a pipeline repo such as Wan's or Flux's), else ``path``; its
    safetensors weights are checked (headers only: a truncated or pickled file fails here, before any work)."""
    root = Path(str(path)).expanduser()
    if not root.exists():
        raise ConfigError(f"{setting}={path} does not exist; pass a local diffusers VAE folder (or a pipeline folder "
                          f"with a {subfolder or 'vae'}/ subfolder)")
    for folder in ([root / subfolder] if subfolder else []) + [root]:
        if (folder / "config.json").is_file():
            check_weights_folder(folder, setting=setting, value=path, class_name=vae_class(folder, path, setting))
            return folder
    raise ConfigError(f"{setting}={path} is not a diffusers VAE folder: no config.json in "
                      f"{root / subfolder if subfolder else root} or {root}; pass the folder save_pretrained wrote")


def vae_class(folder: Path, path, setting: str = "vae") -> str:
    """The VAE class ``folder/config.json`` names, one of ``VAE_KINDS``."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{setting}={path}: {folder / 'config.json'} is not valid JSON ({error})") from None
    class_name = str(config.get("_class_name")) if isinstance(config, dict) else "None"
    if class_name not in VAE_KINDS:
        raise ConfigError(f"{setting}={path}: {folder / 'config.json'} describes {class_name!r}, not a VAE "
                          f"this can use ({', '.join(VAE_KINDS)})")
    import diffusers

    check_config_values(config, getattr(diffusers, class_name), folder / "config.json", f"{setting}={path}")
    return class_name


class VAE:
    """Encode pixels in [-1, 1] to normalised latents and back."""

    def __init__(self, path: str | Path, subfolder: str | None = "vae", *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, tiling: bool = True, tile: int | None = None,
                 setting: str = "vae", tile_setting: str = "tile"):
        import diffusers

        device = usable_device(device)
        folder = vae_folder(path, subfolder, setting)  # the class and the weights' headers checked
        self.class_name = vae_class(folder, path, setting)
        self.folder = folder
        self.kind = kind = VAE_KINDS[self.class_name]
        self.is_video = kind.video
        self.patch = latent_patch(self.class_name, folder, path, setting)  # its config checked before the weights
        try:  # safetensors only: a pickled .bin can run code, and infer.py may take this folder from a checkpoint
            self.model = getattr(diffusers, self.class_name).from_pretrained(str(folder), torch_dtype=dtype,
                                                                             use_safetensors=True)
        except (OSError, ValueError, RuntimeError) as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"{setting}={path}: cannot load {self.class_name} weights from {folder} ({first}); "
                              f"save it with save_pretrained (safetensors; .bin pickles are not loaded)") from None
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.dtype = torch.device(device), dtype
        try:
            self.shift, self.scale = normalisation(self.model.config, self.model)
        except ConfigError as error:
            raise ConfigError(f"{setting}={path}: {folder / 'config.json'}: {error}; give one statistic per latent "
                              f"channel in its config.json") from None
        self.channels = self.shift.numel() // self.patch ** 2  # of the latents (Flux.2: 32 of 128 statistics)
        self.spatial = int(getattr(self.model, "spatial_compression_ratio", None)
                           or 2 ** (len(self.model.config.block_out_channels) - 1))
        self.size_step = self.spatial * self.patch  # a pixel size's multiple: whole latent patches (Flux.2: 16)
        # Wan: scale_factor_temporal (4); LTX-Video: temporal_compression_ratio (8); HunyuanVideo 1.5: 4; CogVideoX:
        # its config's temporal_compression_ratio (4; read there: diffusers warns when the model is asked)
        self.temporal = int(self.model.config.get("temporal_compression_ratio") if kind.frame_pad > 1
                            else getattr(self.model, "temporal_compression_ratio", None)
                            or self.model.config.get("scale_factor_temporal") or 4) if self.is_video else 1
        self.frame_pad = kind.frame_pad if kind.frame_pad > 1 else None  # None: the latents are the VAE's frames
        if tile is not None and self.frame_pad and tile % (4 * self.spatial):  # CogVideoX: stride 3/4 of the tile
            # and a quarter blended, each whole latent cells, else its tiled encode / decode misplace the tiles
            raise ConfigError(f"{tile_setting}={tile}: {self.class_name}'s tiles overlap by a quarter of a tile, "
                              f"which must be whole {self.spatial}-pixel latent cells; use a multiple of "
                              f"{4 * self.spatial}, e.g. {tile_setting}=256, or {tile_setting}=null for diffusers' "
                              f"default")
        if tile is not None and (tile < 2 * self.spatial or tile % self.spatial):  # diffusers' tiles are whole
            # latent cells and blend over a quarter of one: a smaller tile divides by zero or skips pixels
            raise ConfigError(f"{tile_setting}={tile}: the VAE's tiles are whole {self.spatial}-pixel latent cells, at "
                              f"least 2 of them; use a multiple of {self.spatial} from {2 * self.spatial}, e.g. "
                              f"{tile_setting}=256, or {tile_setting}=null for diffusers' default")
        if tiling:
            self.model.enable_tiling(**({} if tile is None else self._tile_kwargs(tile)))
        self.model.enable_slicing()

    def _tile_kwargs(self, tile: int) -> dict:
        tiles_by = self.kind.tiles_by  # how its enable_tiling takes a tile size (ringdit.models.vaes.VaeKind)
        if tiles_by == "sizes":  # tile sizes and an overlap factor, no strides (HunyuanVideo 1.5's)
            return dict(tile_sample_min_height=tile, tile_sample_min_width=tile,
                        tile_latent_min_height=tile // self.spatial, tile_latent_min_width=tile // self.spatial)
        if tiles_by == "overlap":  # overlap factors, no strides: stride 3/4 as below (CogVideoX's)
            return dict(tile_sample_min_height=tile, tile_sample_min_width=tile, tile_overlap_factor_height=0.25,
                        tile_overlap_factor_width=0.25)
        if tiles_by == "min_overlap":  # tile sizes and minimum overlaps (AutoencoderKLMiniMaxH3's): a quarter
            return dict(tile_sample_min_height=tile, tile_sample_min_width=tile,
                        tile_sample_min_overlap_height=tile // 4, tile_sample_min_overlap_width=tile // 4)
        if tiles_by == "strides":  # overlapping tiles: stride 3/4 of the tile, blended in the overlap
            stride = max(self.spatial, tile * 3 // 4)
            return dict(tile_sample_min_height=tile, tile_sample_min_width=tile,
                        tile_sample_stride_height=stride, tile_sample_stride_width=stride)
        self.model.tile_sample_min_size = tile  # AutoencoderKL sizes its tiles from these two attributes
        self.model.tile_latent_min_size = tile // self.spatial
        return {}

    @property
    def frame_rule(self) -> FrameRule:
        """The frame counts this VAE's clips come back from: 1 + k x temporal (1, 5, 9, ... for Wan); CogVideoX's
        (its latents padded to pairs) every other of those, 1 + 8k; MiniMax-H3's (chunked) 17n + 5."""
        return FrameRule(self.temporal, self.frame_pad or 1, **self.chunk_geometry())

    def chunk_geometry(self) -> dict:
        """A chunked VAE's (``VaeKind.chunks``) frames per chunk, latent frames per chunk and latent frames dropped
        at the end, as ``FrameRule`` takes them; {} for the others."""
        if not self.kind.chunks:
            return {}
        return dict(chunk=int(self.model.config.clip_length), chunk_latents=int(self.model.tokens_chunk_size),
                    chunk_drop=int(self.model.config.token_drop))

    def check_frames(self, frames: int, setting: str = "frames") -> None:
        """A ``ConfigError`` (one line: ``setting``, the value, the rule, the nearest good counts) where clips of
        ``frames`` frames would not come back from this VAE as they went in."""
        self.frame_rule.check(setting, frames, who=self.class_name)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, group=None, dst: int | None = None) -> torch.Tensor | None:
        """(B, 3, [T,] H, W) in [-1, 1] -> normalised latents (B, C, [T',] H', W'); the posterior mode, so that
        re-running prepare gives the same shards. Images given to a video VAE become one-frame videos.

        ``group``: a torch.distributed process group whose ranks all call this with the same pixels: the spatial
        tiles are encoded in parallel over its ranks (``ringdit.media.parallel_vae``); the latents come back on
        group rank ``dst`` (None: on every rank), None on the others. None (the default): this process alone."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        if self.is_video and pixels.ndim == 4:
            pixels = pixels[:, :, None]  # (B, 3, 1, H, W)
        if self.frame_pad or (self.kind.chunks and pixels.shape[2] > 1):  # before any rank starts encoding: every
            self.check_frames(pixels.shape[2])  # rank of a group refuses alike (a chunked VAE's image: one frame)
        pixels = self._to_vae_pixels(pixels.to(self.device, self.dtype))
        if _parallel(group):
            moments = parallel_encode(self.model, pixels, group, dst)
            if moments is None:
                return None
            latents = DiagonalGaussianDistribution(moments).mode().float()
        else:
            latents = self.model.encode(pixels).latent_dist.mode().float()
        patches = patchify(latents, self.patch)  # (B, C p^2, [T',] H'/p, W'/p)
        latents = unpatchify((patches - self._view(self.shift, patches)) * self._view(self.scale, patches), self.patch)
        if self.frame_pad and latents.shape[2] % self.frame_pad:  # CogVideoX: the first latent frame in front
            copies = self.frame_pad - latents.shape[2] % self.frame_pad
            latents = torch.cat([latents[:, :, :1].expand(-1, -1, copies, -1, -1), latents], dim=2)
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, normalised: bool = True, group=None,
               dst: int | None = 0) -> torch.Tensor | None:
        """Latents (B, C, [T',] H', W') -> pixels (B, 3, [T,] H, W) in [-1, 1], float32 on the CPU. ``normalised``:
        as prepare stores them (the normalisation is inverted first), else the VAE's raw latents.

        ``group``: a torch.distributed process group (e.g. ``torch.distributed.group.WORLD``) whose ranks all call
        this with the same latents: the spatial tiles of the tiled decode are decoded in parallel over its ranks
        and blended as diffusers blends them (``ringdit.media.parallel_vae``); the pixels come back on group rank
        ``dst`` (None: on every rank) and None on the others. None (the default), or a group of one rank: this
        process alone. CogVideoX's latents of an even frame count lose their first frame first: the pad ``encode``
        put there (or the frame CogVideoXPipeline would drop)."""
        latents = latents.float().to(self.device)
        if self.frame_pad and latents.ndim == 5 and latents.shape[2] % self.frame_pad == 0:
            latents = latents[:, :, self.frame_pad - 1:]  # (B, C, T' - 1, H', W'): odd again
        if normalised:
            patches = patchify(latents, self.patch)  # (B, C p^2, [T',] H'/p, W'/p)
            raw = unpatchify(patches / self._view(self.scale, patches) + self._view(self.shift, patches), self.patch)
        else:
            raw = latents
        if _parallel(group):
            pixels = parallel_decode(self.model, raw.to(self.dtype), group, dst)
            return None if pixels is None else self._from_vae_pixels(pixels.float()).clamp(-1, 1).cpu()
        return self._from_vae_pixels(self.model.decode(raw.to(self.dtype)).sample.float()).clamp(-1, 1).cpu()

    def _to_vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[-1, 1] -> the pixels the VAE takes: the same, or ImageNet-normalised [0, 1] (``VaeKind.pixels``)."""
        if self.kind.pixels != "imagenet":
            return pixels
        mean, std = (torch.tensor(v, dtype=pixels.dtype, device=pixels.device) for v in (IMAGENET_MEAN, IMAGENET_STD))
        return ((pixels + 1) / 2 - self._view(mean, pixels)) / self._view(std, pixels)  # (B, 3, [T,] H, W)

    def _from_vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """The inverse of ``_to_vae_pixels``: the VAE's decoded pixels in [-1, 1] (before the clamp)."""
        if self.kind.pixels != "imagenet":
            return pixels
        mean, std = (torch.tensor(v, dtype=pixels.dtype, device=pixels.device) for v in (IMAGENET_MEAN, IMAGENET_STD))
        return (pixels * self._view(std, pixels) + self._view(mean, pixels)) * 2 - 1

    @staticmethod
    def _view(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return values.to(like.device).view(1, -1, *([1] * (like.ndim - 2)))  # (1, C, 1, ...)

    def describe(self) -> dict:
        """What a shard records as its ``vae`` metadata key, enough to invert the normalisation."""
        return {"class": self.class_name, "path": str(self.folder.resolve()), "shift": self.shift.tolist(),
                "scale": self.scale.tolist(), "spatial_compression": self.spatial,
                "temporal_compression": self.temporal if self.is_video else None,
                "latent_channels": self.channels, "patch": self.patch,
                **({"frame_pad": self.frame_pad} if self.frame_pad else {}),
                **({"chunks": self.chunk_geometry()} if self.kind.chunks else {})}



def usable_device(device) -> torch.device:
    """``device=`` as a torch device this machine has: not ``meta`` (no data), a CUDA index it has; a
    ``ConfigError`` naming the setting otherwise."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r} is not a torch device; e.g. device=cpu or device=cuda:0") from None
    if device.type == "meta":
        raise ConfigError("device=meta holds no data, so nothing can be encoded on it; use device=cpu or device=cuda")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA"
        raise ConfigError(f"device={device}: this machine has {have}; use device=cpu or an index it has")
    return device

def _parallel(group) -> bool:
    """Whether ``group`` asks for a tile-parallel decode / encode: a process group of more than one rank."""
    import torch.distributed as dist

    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def normalisation(config, model=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (shift, scale) such that the model's latents are ``(z - shift) * scale`` (see the module doc);
    ``model``: where its latents_mean / latents_std are buffers (LTX-Video), or its statistics a batch norm
    (Flux.2: per channel of the patchified latents), they are read from it."""
    bn = getattr(model, "bn", None)
    if isinstance(bn, torch.nn.BatchNorm2d):  # AutoencoderKLFlux2: Flux2Pipeline's (z - mean) / sqrt(var + eps)
        std = torch.sqrt(bn.running_var.float() + float(config.get("batch_norm_eps")))
        return bn.running_mean.float().cpu(), (1 / std).cpu()
    channels = int(config.get("z_dim") or config.get("latent_channels"))
    mean, std = config.get("latents_mean"), config.get("latents_std")
    buffers = dict(model.named_buffers()) if model is not None else {}
    if mean is None and "latents_mean" in buffers and "latents_std" in buffers:
        mean, std = buffers["latents_mean"].float().tolist(), buffers["latents_std"].float().tolist()
    scaling = config.get("scaling_factor")
    scaling = 1.0 if scaling is None else float(scaling)
    if mean is not None and std is not None:
        shift = torch.tensor(mean, dtype=torch.float32)
        scale = scaling / torch.tensor(std, dtype=torch.float32)
    else:
        shift = torch.full((channels,), float(config.get("shift_factor") or 0.0))
        scale = torch.full((channels,), scaling)
    if shift.numel() != channels or scale.numel() != channels:  # diffusers' own pipelines fail on these too
        raise ConfigError(f"latents_mean / latents_std hold {shift.numel()} / {scale.numel()} values for "
                          f"{channels} latent channels (z_dim / latent_channels)")
    return shift.reshape(channels), scale.reshape(channels)


def latent_patch(class_name: str, folder: Path, path, setting: str = "vae") -> int:
    """The side of the latent patches the normalisation applies to: the VAE kind's ``latent_patch``
    (``ringdit.models.vaes``: 2 for AutoencoderKLFlux2, whose batch norm is over the 2x2-patchified channels; 1 for
    every other VAE). ``folder``: the VAE's (its config.json is read where the kind patchifies)."""
    kind = VAE_KINDS[class_name]
    patch = kind.latent_patch
    if patch == 1:
        return 1
    config = json.loads((folder / "config.json").read_text())  # valid JSON: vae_class read it
    # its pipeline patchifies p x p whatever the config says: a config that says otherwise would be read wrongly
    if tuple(config.get("patch_size") or (patch, patch)) != (patch, patch):
        raise ConfigError(f"{setting}={path}: {class_name} with patch_size={config.get('patch_size')}; "
                          f"{kind.pipeline} normalises {patch}x{patch} patches (patch_size [{patch}, {patch}]), so "
                          f"only those can be used")
    return patch


def patchify(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, C p^2, H/p, W/p), channel c * p^2 + p * row + col = sub-pixel (row, col) of channel c,
    as Flux2Pipeline._patchify_latents; ``patch`` 1: unchanged. A size that is not a multiple of p: ValueError."""
    if patch == 1:
        return latents
    batch, channels, height, width = latents.shape
    if height % patch or width % patch:
        raise ValueError(f"latents of {height}x{width} do not split into the VAE's {patch}x{patch} latent patches, "
                         f"which its normalisation is per; their sizes must be multiples of {patch}")
    patches = latents.reshape(batch, channels, height // patch, patch, width // patch, patch)
    return patches.permute(0, 1, 3, 5, 2, 4).reshape(batch, channels * patch ** 2, height // patch, width // patch)


def unpatchify(patches: torch.Tensor, patch: int) -> torch.Tensor:
    """The inverse of ``patchify`` (Flux2Pipeline._unpatchify_latents)."""
    if patch == 1:
        return patches
    batch, channels, height, width = patches.shape
    latents = patches.reshape(batch, channels // patch ** 2, patch, patch, height, width).permute(0, 1, 4, 2, 5, 3)
    return latents.reshape(batch, channels // patch ** 2, height * patch, width * patch)
