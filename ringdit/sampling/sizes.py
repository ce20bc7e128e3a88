"""Sample shapes: a requested ``size=[H, W]`` / ``frames=N`` to a shape ``([T,] H, W)`` in the data's cells
(``SampleSizes``, checked against the model's patch, its position grid and the VAE's frame rule), the patch a model's
token covers, and the frame rate videos are written at."""

from __future__ import annotations

from dataclasses import dataclass

from ringdit.common.errors import ConfigError, require_count
from ringdit.models.frame_rule import FrameRule

Shape = tuple[int, ...]  # a sample's ([T,] H, W) in the data's cells (latent cells, or pixels of pixel-space data)


def patch_shape(model) -> Shape:
    """The data cells one token of ``model`` covers, ``([T,] H, W)``: its ``patch_shape``."""
    return tuple(int(p) for p in model.patch_shape)


def size_pair(size, setting: str, hint: str = "") -> list[int]:
    """``size`` as [H, W], two positive whole numbers (a list or tuple); else a ``ConfigError`` naming ``setting``."""
    pair = list(size) if isinstance(size, (list, tuple)) else None
    if pair is None or len(pair) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in pair):
        raise ConfigError(f"{setting}={size!r} is not [H, W], two positive whole numbers" + (f" {hint}" if hint else ""))
    return pair


@dataclass(frozen=True)
class SampleSizes:
    """How a requested ``size=[H, W]`` / ``frames=N`` becomes a sample shape ``([T,] H, W)`` in the data's cells, the
    shape ``Sampler.generate(shape=)`` takes -- checked against the model's patch.

    Units: when the data records the VAE it was encoded with (``data["vae"]``: data=text_latents from
    ``ringdit.prepare``), ``size`` is in pixels and ``frames`` in video frames, as diffusers pipelines' height /
    width / num_frames: H = height / spatial, W = width / spatial, T = (frames - 1) / temporal + 1. Otherwise
    (pixel-space DiT data, data=latents, synthetic latents) both are in the data's own cells: pixels of pixel data,
    latent cells of latents. What is not given is the data's ``image_size`` (its most frequent bucket).
    """

    default: Shape          # the data's image_size, in cells
    patch: Shape            # the cells one model token covers, ([T,] H, W)
    spatial: int = 1        # pixels per cell along H and W (the data's VAE); 1: sizes are cells
    temporal: int = 1       # video frames per latent frame after the first (a video VAE); 1: frames are cells
    pixels: bool = False    # the data records a VAE: sizes in pixels and video frames
    max_grid: Shape | None = None  # the most tokens per axis the model's position embedding covers; None: any
    # latent frames stored in front, copies of the first, that decoding drops (CogVideoX's VAE: its data records
    # frame_pad 2, the latents padded to an even count); 0: the latents are the VAE's frames as they are
    frame_pad: int = 0
    # a chunked VAE's frame rule (AutoencoderKLMiniMaxH3's, its data's ``vae`` record ``chunks``): (chunk,
    # chunk_latents, chunk_drop) as ringdit.models.frame_rule.FrameRule takes them, 17n + 5 frames are 5n + 2 latent
    # frames; None: none
    chunks: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, data_info: dict, patch, max_grid=None) -> SampleSizes:
        """The data's units (its ``describe()``, a checkpoint's ``hparams.data``) for a model of ``patch`` (and
        ``max_grid``: ``DiffusionModel.max_grid``)."""
        default = tuple(int(s) for s in data_info["image_size"])
        patch, max_grid = tuple(int(p) for p in patch), None if max_grid is None else tuple(map(int, max_grid))
        vae = data_info.get("vae")
        if not isinstance(vae, dict):
            return cls(default, patch, max_grid=max_grid)
        spatial, temporal = vae.get("spatial_compression"), vae.get("temporal_compression")
        return cls(default, patch, spatial=int(spatial or 1), temporal=int(temporal or 1), pixels=spatial is not None,
                   max_grid=max_grid, frame_pad=int(vae.get("frame_pad") or 0),
                   chunks=tuple(int(vae["chunks"][key]) for key in CHUNK_KEYS) if vae.get("chunks") else None)

    @property
    def video(self) -> bool:
        return len(self.default) == 3

    def user_size(self, shape: Shape) -> tuple[list[int], int | None]:
        """``shape`` (cells) in the units ``size`` / ``frames`` are given in: ([H, W], frames or None)."""
        height, width = (s * self.spatial for s in shape[-2:])
        decoded = shape[0] - max(self.frame_pad - 1, 0) if len(shape) == 3 else None  # the pad is dropped
        frames = (decoded - 1) * self.temporal + 1 if decoded is not None else None
        if decoded is not None and self.chunks:  # chunk_latents x n + (chunk_latents - drop) latents: chunk x n + ...
            chunk, per, drop = self.chunks
            frames = ((decoded + drop) // per - 1) * chunk + per
        return [height, width], frames

    def name(self, shape: Shape) -> str:
        """``HxW`` / ``HxWxF`` in the units of ``size`` / ``frames`` (as prepare names its buckets)."""
        size, frames = self.user_size(shape)
        return "x".join(map(str, size + ([frames] if frames is not None else [])))

    def shape(self, size=None, frames=None, *, where: str = "", names: tuple[str, str] = ("size", "frames")) -> Shape:
        """The sample shape for ``size`` ``[H, W]`` and ``frames`` (None: the data's); a ``ConfigError`` naming the
        setting (``where`` + ``names``), its value and the fix for anything the model cannot sample."""
        size_name, frames_name = names
        shape = list(self.default)
        if size is not None:
            shape[-2:] = self._cells(size, where, size_name)
        if frames is not None:
            if not self.video:
                raise ConfigError(f"{where}{frames_name}={frames!r}: the model makes images ({self.name(self.default)}"
                                  f"), not videos; drop {frames_name}")
            shape[0] = self._latent_frames(frames, where, frames_name)
        self._check_grid(shape, where, names)
        return tuple(shape)

    def _check_grid(self, shape: list[int], where: str, names: tuple[str, str]) -> None:
        """Each axis's tokens within what the model's position embedding covers (Wan's RoPE table), named in the
        units of the setting that set it."""
        if self.max_grid is None:
            return
        over = [axis for axis, (cells, patch, most) in enumerate(zip(shape, self.patch, self.max_grid))
                if cells // patch > most]
        if not over:
            return
        # every axis clipped at once, so that the size suggested is one this check takes (CogVideoX's RoPE grid
        # bounds height and width both)
        largest = [min(cells, most * patch) for cells, patch, most in zip(shape, self.patch, self.max_grid)]
        (given, given_frames), (bound, bound_frames) = self.user_size(tuple(shape)), self.user_size(tuple(largest))
        video = len(shape) == 3
        settings, fixes = [], []
        if any(axis >= len(shape) - 2 for axis in over):
            settings.append(f"{names[0]}={given}")
            fixes.append(f"{names[0]}={bound}")
        if video and 0 in over:
            settings.append(f"{names[1]}={given_frames}")
            fixes.append(f"{names[1]}={bound_frames}")
        first, *others = over
        tokens = (f"{shape[first] // self.patch[first]} tokens along one axis, more than the {self.max_grid[first]} "
                  f"positions the model's position embedding covers" +
                  "".join(f", and {shape[a] // self.patch[a]} along another that covers {self.max_grid[a]}"
                          for a in others))
        raise ConfigError(f"{where}{' '.join(settings)}: {tokens} (Wan's rope_max_seq_len, CogVideoX's sample_height "
                          f"/ sample_width); the most it samples there is {' '.join(fixes)}")

    def _cells(self, size, where: str, setting: str) -> list[int]:
        default, _ = self.user_size(self.default)
        unit = "pixels" if self.pixels else "the data's cells"
        pair = size_pair(size, f"{where}{setting}", f"({unit}); e.g. {setting}=[{default[0]},{default[1]}]")
        cells = []
        for axis, (value, patch) in enumerate(zip(pair, self.patch[-2:])):
            step = self.spatial * patch  # one token's pixels (or cells) along this axis
            why = (f"the VAE's {self.spatial}x downsampling x the model's patch {patch}" if self.pixels else
                   f"the model's patch {patch}")
            dim = ("height", "width")[axis]
            if value < step:
                fix = list(pair)
                fix[axis] = step
                raise ConfigError(f"{where}{setting}={pair}: the {dim} {value} is smaller than one model token, "
                                  f"{step} {'pixels' if self.pixels else 'cells'} ({why}), so the latent grid would "
                                  f"be empty; use at least {step}, "
                                  f"e.g. {setting}=[{fix[0]},{fix[1]}]")
            if value % step:
                low, high = value // step * step, -(-value // step) * step
                fix = [round(s / (self.spatial * p)) * self.spatial * p or self.spatial * p
                       for s, p in zip(pair, self.patch[-2:])]
                nearest = f"{low} or {high}" if low else f"{high}"
                raise ConfigError(f"{where}{setting}={pair}: the {dim} {value} is not a multiple of {step} ({why}); "
                                  f"the nearest valid {dim}s are {nearest}, e.g. {setting}=[{fix[0]},{fix[1]}]")
            cells.append(value // self.spatial)
        return cells

    def _latent_frames(self, frames, where: str, setting: str) -> int:
        """The stored latent frames for ``frames`` (video frames; the cells without a VAE): the model's frame rule
        (``ringdit.models.frame_rule``) for the data's VAE and the model's temporal patch."""
        return FrameRule(self.temporal, max(self.frame_pad, 1), self.patch[0], **dict(zip(CHUNK_KEYS, self.chunks or ()))).check(
            f"{where}{setting}", frames)


CHUNK_KEYS = ("chunk", "chunk_latents", "chunk_drop")  # a chunked VAE's record, FrameRule's fields
FPS_HINT = "the frames per second videos are written at; null: the model's own (its pipeline's rate)"


def frame_rate(setting: str, value, model_config: dict) -> int | None:
    """The frames per second videos are written at: ``value`` (the ``setting`` fps=, checked: a positive integer),
    else (None) the model kind's own rate, its published pipeline's (``DiffusionModel.frame_rate``: Wan 2.1 16,
    HunyuanVideo 1.5 24, ...); None for an image model when none is given."""
    from hydra.utils import get_class  # the kind's class: the config was checked by its spec (ringdit.spec.model)

    require_count(setting, value, optional=True, hint=FPS_HINT)
    return value if value is not None else get_class(model_config["_target_"]).frame_rate(model_config)
