"""Sampling jobs for ``infer.py``: which samples to draw and at which shape (``SampleSizes``: ``size=[H, W]`` /
``frames=N`` to the data's cells; ``read_prompt_file``), batches of one shape each (``ShapeBatches``), and collecting
the samples from every rank into files (``SampleWriter``: one set of files per shape when the shapes differ)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import BatchSampler, Dataset

from ringdit.atomic import atomic_write
from ringdit.errors import ConfigError
from ringdit.images import save_samples, to_image, write_gif
from ringdit.media.writing import write_media, write_mp4
from ringdit.models.frames import FrameRule
from ringdit.preemption import Preempted
from ringdit.safe_json import parse_json
from ringdit.seeding import Stream, seed_of

Shape = tuple[int, ...]  # a sample's ([T,] H, W) in the data's cells (latent cells, or pixels of pixel-space data)


def resolve_labels(labels, num_samples: int, data_info: dict) -> list[int]:
    """Class ids for ``num_samples`` samples: the given ids or class names, cycled; all classes when None.

    A number is a class id (``labels=[3]`` is class 3, also when a folder is named "7"); other strings are names.
    """
    names = [str(n) for n in data_info.get("class_names") or []]
    num_classes = data_info["num_classes"]
    if labels is None:
        labels = list(range(num_classes))
    elif isinstance(labels, (int, str)):
        labels = [labels]
    ids = []
    for label in labels:
        if isinstance(label, str) and label in names and not label.isdigit():
            ids.append(names.index(label))
            continue
        if isinstance(label, float) and not label.is_integer() or isinstance(label, bool) \
                or isinstance(label, str) and not label.isascii():  # int() would read "３" (full-width) as 3
            raise ValueError(f"labels: {label!r} is not a class id (a whole number) nor one of the class names {names}")
        try:
            value = int(label)
        except (TypeError, ValueError):
            raise ValueError(f"labels: {label!r} is neither a class id nor one of the class names {names}") from None
        if not 0 <= value < num_classes:
            raise ValueError(f"labels: class id {value} is out of range; this model has classes 0..{num_classes - 1}")
        ids.append(value)
    if not ids:
        raise ValueError("labels is empty; give class ids, class names, or null for all classes")
    return [ids[i % len(ids)] for i in range(num_samples)]


def patch_shape(model) -> Shape:
    """The data cells one token of ``model`` covers, ``([T,] H, W)``: its ``patch_shape``, else a DiT's patch
    embedder's, a diffusers transformer's ``patch_size``."""
    patch = getattr(model, "patch_shape", None)
    if patch is None:
        patch = model.x_embedder.patch_shape if hasattr(model, "x_embedder") else model.patch_size
    return tuple(int(p) for p in patch)


def size_pair(size, setting: str, hint: str = "") -> list[int]:
    """``size`` as [H, W], two positive whole numbers (a list or tuple); else a ``ConfigError`` naming ``setting``."""
    pair = list(size) if isinstance(size, (list, tuple)) else None
    if pair is None or len(pair) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in pair):
        raise ConfigError(f"{setting}={size!r} is not [H, W], two positive whole numbers" + (f" {hint}" if hint else ""))
    return pair


@dataclass(frozen=True)
class SampleSizes:
    """How a requested ``size=[H, W]`` / ``frames=N`` becomes a sample shape ``([T,] H, W)`` in the data's cells, the
    shape ``DiffusionModule.generate(shape=)`` takes -- checked against the model's patch.

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
                   max_grid=max_grid, frame_pad=int(vae.get("frame_pad") or 0))

    @property
    def video(self) -> bool:
        return len(self.default) == 3

    def user_size(self, shape: Shape) -> tuple[list[int], int | None]:
        """``shape`` (cells) in the units ``size`` / ``frames`` are given in: ([H, W], frames or None)."""
        height, width = (s * self.spatial for s in shape[-2:])
        decoded = shape[0] - max(self.frame_pad - 1, 0) if len(shape) == 3 else None  # the pad is dropped
        frames = (decoded - 1) * self.temporal + 1 if decoded is not None else None
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
        (``ringdit.models.frames``) for the data's VAE and the model's temporal patch."""
        return FrameRule(self.temporal, max(self.frame_pad, 1), self.patch[0]).check(f"{where}{setting}", frames)


FPS_HINT = "the frames per second videos are written at; null: the model's own (its pipeline's rate)"


def frame_rate(setting: str, value, model_config: dict) -> int | None:
    """The frames per second videos are written at: ``value`` (the ``setting`` fps=, checked: a positive integer),
    else (None) the model kind's own rate, its published pipeline's (``DiffusionModel.frame_rate``: Wan 2.1 16,
    HunyuanVideo 1.5 24, ...); None for an image model when none is given."""
    from hydra.utils import get_class  # the kind's class: the config was checked by its spec (ringdit.spec.model)

    from ringdit.errors import require_count

    require_count(setting, value, optional=True, hint=FPS_HINT)
    return value if value is not None else get_class(model_config["_target_"]).frame_rate(model_config)


PROMPT_KEYS = ("prompt", "size", "frames", "negative_prompt")
PROMPT_LINE = '{"prompt": "a red fox running", "size": [480, 832], "frames": 81}'


@dataclass(frozen=True)
class PromptLine:
    """One prompt of a ``prompt_file``: its text and, optionally, its own size / frames / negative prompt (checked by
    ``SampleSizes.shape`` with ``where``, which names the file and line)."""

    prompt: str
    where: str                      # "prompt_file=<path> line <n>: "
    size: object = None             # as written: [H, W] (checked later, in the data's units)
    frames: object = None
    negative_prompt: str | None = None
    options: dict = field(default_factory=dict)  # the caller's own keys (read_prompt_file's ``options``), as written


def read_prompt_file(path, setting: str = "prompt_file", options: tuple[str, ...] = ()) -> list[PromptLine]:
    """The prompts of a ``.jsonl`` file (one JSON object per line: ``prompt`` and optionally ``size`` [H, W],
    ``frames``, ``negative_prompt``, and the caller's ``options`` keys, kept as written for it to check) or a ``.txt``
    file (one prompt per line); blank lines are skipped. Data, never code: each line is parsed as JSON and checked, a
    mistake is one ``ConfigError`` naming the file and line."""
    file = Path(str(path)).expanduser()
    kind = file.suffix.lower()
    if kind not in (".jsonl", ".txt"):
        raise ConfigError(f"{setting}={path} is not a .jsonl or .txt file; give one JSON object per line ({PROMPT_LINE}"
                          f") in a .jsonl file, or one prompt per line in a .txt file")
    if not file.is_file():
        raise ConfigError(f"{setting}={path} does not exist" + (" (it is a folder)" if file.is_dir() else "") +
                          f"; give a .jsonl file of lines such as {PROMPT_LINE}, or a .txt file of prompts")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{setting}={path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{setting}={path} line {number}: "
        lines.append(PromptLine(raw.strip(), where) if kind == ".txt" else _prompt_line(raw, where, options))
    if not lines:
        raise ConfigError(f"{setting}={path} holds no prompts; write one per line")
    return lines


def _prompt_line(raw: str, where: str, options: tuple[str, ...] = ()) -> PromptLine:
    entry = parse_json(raw, f"{where}the line", fix=f"each line is one object such as {PROMPT_LINE}")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}a JSON {type(entry).__name__}, not an object such as {PROMPT_LINE}")
    unknown = [key for key in entry if key not in PROMPT_KEYS + options]
    if unknown:
        raise ConfigError(f"{where}unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; a "
                          f"line holds {', '.join(PROMPT_KEYS + options)} (all but prompt optional)")
    prompt, negative = entry.get("prompt"), entry.get("negative_prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}\"prompt\" must be a non-empty string, got {prompt!r}")
    if negative is not None and not isinstance(negative, str):
        raise ConfigError(f"{where}\"negative_prompt\" must be a string, got {negative!r}")
    return PromptLine(prompt, where, entry.get("size"), entry.get("frames"), negative,
                      {key: entry[key] for key in options if key in entry})


class SampleRequests(Dataset):
    """Position p = (i, condition_i, the noise seed of sample i[, extra_i]): what sample i is, independent of how many
    samples there are, their shapes and how they are split over ranks.

    ``conditions``: class ids, or a dict of text tensors ``(N, ...)`` (one prompt embedding per sample).
    ``shapes``: each sample's shape ``([T,] H, W)`` (None: every sample at the data's; the items are then 3-tuples).
    The positions hold the samples by shape -- the shapes in order of first appearance, each shape's samples in
    index order -- so that ``ShapeBatches`` batches them without mixing shapes; every item carries its index i,
    which names its files. ``extra_i``: ``shape`` (its shape as a tensor) and, with ``negatives`` (a dict of
    ``(N, ...)`` tensors, the negative prompt of each sample) and ``negative_given`` ``(N,)`` bool (False: the
    run's negative prompt, or the empty one), ``negative`` and ``negative_given``.
    """

    def __init__(self, conditions: list[int] | dict[str, torch.Tensor], seed: int, shapes: list[Shape] | None = None,
                 negatives: dict[str, torch.Tensor] | None = None, negative_given: torch.Tensor | None = None):
        self.conditions, self.seed = conditions, seed
        self.shapes = [tuple(int(s) for s in shape) for shape in shapes] if shapes is not None else None
        self.negatives, self.negative_given = negatives, negative_given
        if self.shapes is not None and len(self.shapes) != len(self):
            raise ValueError(f"{len(self.shapes)} shapes for {len(self)} samples")
        first = {shape: k for k, shape in enumerate(self.distinct_shapes())}
        self.order = sorted(range(len(self)), key=lambda i: first[self.shapes[i]]) if self.shapes else \
            list(range(len(self)))

    def __len__(self) -> int:
        if isinstance(self.conditions, dict):
            return len(next(iter(self.conditions.values())))
        return len(self.conditions)

    def __getitem__(self, position: int):
        i = self.order[position]
        if isinstance(self.conditions, dict):
            item = i, {key: value[i] for key, value in self.conditions.items()}, self.noise_seed(i)
        else:
            item = i, self.conditions[i], self.noise_seed(i)
        if self.shapes is None:
            return item
        extra = {"shape": torch.tensor(self.shapes[i])}
        if self.negatives is not None:
            extra["negative"] = {key: value[i] for key, value in self.negatives.items()}
            extra["negative_given"] = self.negative_given[i]
        return *item, extra

    def noise_seed(self, i: int) -> int:
        return seed_of(Stream.INFERENCE, self.seed, i)

    def distinct_shapes(self) -> list[Shape]:
        """The samples' shapes, each once, in order of first appearance (none without ``shapes``)."""
        return list(dict.fromkeys(self.shapes or ()))

    def batches(self, batch_size: int) -> ShapeBatches:
        """The batch sampler of a prediction ``DataLoader`` over these requests (see ``ShapeBatches``)."""
        from torch.utils.data import SequentialSampler

        shapes = tuple(self.shapes[i] for i in self.order) if self.shapes else (None,) * len(self)
        batches = type("ShapeBatches", (ShapeBatches,), {"shapes": shapes})  # the shape of each position
        return batches(SequentialSampler(self), batch_size, drop_last=False)


class ShapeBatches(BatchSampler):
    """``BatchSampler``'s batches of up to ``batch_size`` positions, also cut where the shape changes: one batch is
    one forward, of one shape. Lightning rebuilds a prediction batch sampler around this rank's slice of the positions
    (``cls(sampler, batch_size=..., drop_last=False)``), so the shapes are the class's (``SampleRequests.batches``
    makes the subclass); every rank of a sequence-parallel group slices the same positions, so gets the same
    batches."""

    shapes: tuple = ()  # the shape of each dataset position

    def __iter__(self):
        batch, shape = [], None
        for position in self.sampler:
            here = self.shapes[position]
            if batch and (here != shape or len(batch) == self.batch_size):
                yield batch
                batch = []
            batch.append(position)
            shape = here
        if batch:
            yield batch

    def __len__(self) -> int:
        return sum(1 for _ in self)


class SampleWriter(L.Callback):
    """Collect every rank's samples after ``predict`` and write ``samples.png`` (video: ``samples.gif`` plus
    ``sample-000.mp4`` / ``.gif`` ... each) and
    ``samples.npz`` (``images`` uint8 ``(N, [T,] H, W, C)``, ``labels`` int64 ``(N,)``) into ``output_dir``.

    A model trained on latents (data=latents) gets ``samples.npz`` with ``latents`` float32 ``(N, C, [T,] H, W)``
    in its VAE's scale instead, and no picture: decode them with the VAE that encoded the data. Text-conditioned
    models write ``captions`` (the prompt of each sample, where known) instead of ``labels``.

    Samples of several shapes (``shapes``: the requests' distinct shapes, more than one; a prompt_file with sizes)
    cannot share one array or grid: each shape gets its own set, named by ``shape_names`` (``HxW`` / ``HxWxF``,
    default the shape's cells): ``samples-<name>.npz`` (the same keys, plus ``index`` int64: the sample numbers it
    holds), the grid ``samples-<name>.png`` / ``.gif``, and videos' ``sample-<i>.mp4`` / ``.gif`` each, named by
    their sample number i whatever their shape.

    When SIGTERM stops sampling (``ringdit.preemption``), the samples of every finished batch are written
    the same way. Every .npz is written to a temp file and renamed: it is never half-written.
    """

    def __init__(self, output_dir: str | Path, columns: int | None = None, captions: list[str] | None = None,
                 fps: int | None = 16, shapes: list[Shape] | None = None, shape_names: dict[Shape, str] | None = None):
        self.output_dir, self.columns, self.captions, self.fps = Path(output_dir), columns, captions, fps
        self.shapes = [tuple(shape) for shape in shapes] if shapes and len(shapes) > 1 else None
        self.shape_names = shape_names or {}
        self.batches: list[dict] = []
        self.written: list[Path] = []
        self.npz_files: list[Path] = []  # rank 0: the samples*.npz written, one per shape

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.batches.append(outputs)

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        count, shown = self._write(trainer, pl_module)
        if trainer.is_global_zero:
            print(f"wrote {count} samples to {shown}", flush=True)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """SIGTERM stopped every rank at the same step (``Preempted``): write the finished batches, gathered as at the
        end, and say how many of all requested samples that is in the preemption's log line. After any other
        exception nothing is gathered: the other ranks may not be there."""
        if not isinstance(exception, Preempted) or trainer.state.fn != TrainerFn.PREDICTING:
            return
        count, shown = self._write(trainer, pl_module)
        if trainer.is_global_zero:
            total = _requested_samples(trainer)
            exception.kept = (f"wrote {count} of {total} samples (the finished batches) to {shown}; run again for "
                              f"all {total} (sample i is the same for the same seed)" if count else
                              f"no sample of {total} was finished, nothing written")

    def _write(self, trainer, pl_module) -> tuple[int, str]:
        """Gather every rank's samples (collectives, shape by shape) and write them on rank 0: (samples written, the
        files)."""
        count, self.written, self.npz_files = 0, [], []
        for shape in self.shapes or [None]:  # every rank walks the same shapes: the collectives pair up
            batches = self.batches if shape is None else [b for b in self.batches if _sample_shape(b) == shape]
            local = self._padded_to_equal_counts(trainer, pl_module, batches)
            if local is None:
                continue
            kind = "images" if "images" in local else "latents"
            gathered = {key: pl_module.all_gather(value.to(pl_module.device)).cpu() for key, value in local.items()}
            if not trainer.is_global_zero:
                continue
            index = gathered["index"].reshape(-1)
            real = torch.nonzero(index >= 0).reshape(-1)  # drop the padding rows (index -1)
            _, first = np.unique(index[real].numpy(), return_index=True)  # sequence-parallel ranks repeat samples
            order = real[torch.from_numpy(first)]
            samples = gathered[kind].reshape(-1, *local[kind].shape[1:])[order].numpy()
            indices = index[order].tolist()
            contents = {kind: samples}
            if "labels" in gathered:  # class-conditional models
                contents["labels"] = gathered["labels"].reshape(-1)[order].numpy().astype(np.int64)
            if self.captions is not None:  # text-conditioned models: the prompt of each sample (all, or those finished)
                contents["captions"] = np.array([self.captions[i] for i in indices])
            if shape is None:
                self.written += self._write_files(contents, kind, "samples", None)
            else:
                name = self.shape_names.get(shape) or "x".join(map(str, shape))
                contents["index"] = np.asarray(indices, dtype=np.int64)
                self.written += self._write_files(contents, kind, f"samples-{name}", indices)
            count += len(samples)
        written = sorted(self.written, key=lambda p: (p.suffix == ".npz", p.name.startswith("sample-")))
        shown = written if len(written) <= 3 else [*written[:2], f"... ({len(written)} files)"]
        return count, " and ".join(map(str, shown))

    def _write_files(self, contents: dict, kind: str, stem: str, indices: list[int] | None) -> list[Path]:
        """``stem``.npz, and for pixels the grid (``stem``.png / .gif) and each video; ``indices``: the sample
        numbers that name each video's files (None: their position, as for one shape)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        npz = self.output_dir / f"{stem}.npz"
        if self.fps and contents[kind].ndim == 5:  # videos: their rate, for python -m ringdit.media.decode
            contents = {**contents, "fps": np.asarray(self.fps, dtype=np.int64)}
        with atomic_write(npz) as partial, open(partial, "wb") as f:  # a samples.npz is never half-written
            np.savez_compressed(f, **contents)
        self.npz_files.append(npz)
        samples = contents[kind]
        if kind != "images":
            return [npz]
        if indices is None and samples.ndim == 5:  # videos: the grid as a GIF, and each as MP4 + GIF
            return [*write_media(samples, self.output_dir, fps=self.fps), npz]
        columns = self.columns or min(len(samples), 10) if samples.ndim == 4 else None
        return [*write_pixels(samples, self.output_dir, stem=stem, indices=indices, fps=self.fps, columns=columns,
                              each=samples.ndim == 5), npz]

    def _padded_to_equal_counts(self, trainer, pl_module, batches: list[dict]) -> dict[str, torch.Tensor] | None:
        """This rank's samples of ``batches``, padded with rows of index -1 to the largest count of any rank:
        prediction splits samples without repeating any (3 samples on 2 data-parallel ranks: 2 and 1; 1 sample: 1
        and 0), and all_gather needs equal shapes. A rank with the most samples tells the others the shapes; None
        when no rank has any (SIGTERM before the first batch was finished, or none of this shape)."""
        local = {key: torch.cat([b[key] for b in batches]) for key in batches[0]} if batches else {}
        count = len(local["index"]) if local else 0
        counts = pl_module.all_gather(torch.tensor(count, device=pl_module.device)).reshape(-1)
        most = int(counts.max())
        if most == 0:
            return None
        shapes = {key: (tuple(v.shape[1:]), v.dtype) for key, v in local.items()}
        template = trainer.strategy.broadcast(shapes, src=int(torch.argmax(counts)))
        padded, device = {}, pl_module.device  # all_gather needs the tensors on the accelerator (NCCL)
        for key, (shape, dtype) in template.items():
            value = local[key].to(device) if local else torch.empty((0, *shape), dtype=dtype, device=device)
            pad = (most - len(value), *shape)
            filler = torch.full(pad, -1 if key == "index" else 0, dtype=dtype, device=device)
            padded[key] = torch.cat([value, filler])
        return padded


def _sample_shape(outputs: dict) -> Shape:
    """The ``([T,] H, W)`` of a prediction batch: images ``(B, [T,] H, W, C)`` or latents ``(B, C, [T,] H, W)``."""
    if "images" in outputs:
        return tuple(outputs["images"].shape[1:-1])
    return tuple(outputs["latents"].shape[2:])


def write_pixels(pixels: np.ndarray, out_dir: Path, *, stem: str, indices: list[int], fps: int = 16,
                 columns: int | None = None, each: bool = True) -> list[Path]:
    """uint8 ``(N, H, W, C)`` images or ``(N, T, H, W, C)`` videos of one shape: the grid ``stem``.png / .gif and,
    with ``each``, ``sample-<i>.png`` (images) or ``.mp4`` + ``.gif`` (videos) named by ``indices`` (the sample
    numbers)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [save_samples(pixels, out / stem, columns=columns, fps=fps)]
    for i, sample in zip(indices, pixels) if each else ():
        name = out / f"sample-{i:03d}"
        if pixels.ndim == 4:
            to_image(sample).save(name.with_suffix(".png"))
            written.append(name.with_suffix(".png"))
        else:
            written += [write_mp4(sample, name.with_suffix(".mp4"), fps), write_gif(sample, name.with_suffix(".gif"), fps)]
    return written


def _requested_samples(trainer) -> int:
    """How many samples ``predict`` was asked for: the length of its (first) request set."""
    loaders = trainer.predict_dataloaders
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    return len(loader.dataset)
