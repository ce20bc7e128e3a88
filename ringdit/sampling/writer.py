"""The one way samples become files: collecting the samples from every rank after ``predict`` into samples.npz
(``SampleWriter``: one set of files per shape when the shapes differ; the finished batches when SIGTERM stops
sampling), and writing pixels as grids and files (``write_pixels``; one sample's file: ``write_sample``; both from
``ringdit.media.writing``, which ``python -m ringdit.media.decode`` writes with too) -- PNG for an image, MP4 for a
video, with its AAC sound track where the sample has sound (LTX-2). infer.py, the preview grids and the server write
through these."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn

from ringdit.common.atomic import atomic_write
from ringdit.media.writing import write_pixels, write_sample  # noqa: F401 - the sampling side's writer, here too
from ringdit.models.conditioning import AUDIO_KEY
from ringdit.commands.preemption import Preempted
from ringdit.sampling.sizes import Shape


class SampleWriter(L.Callback):
    """Collect every rank's samples after ``predict`` and write ``samples.png`` (video: ``samples.gif`` plus
    ``sample-000.mp4`` / ``.gif`` ... each) and
    ``samples.npz`` (``images`` uint8 ``(N, [T,] H, W, C)``, ``labels`` int64 ``(N,)``) into ``output_dir``. A model
    that samples sound beside its video (LTX-2) adds ``audio`` float32 ``(N, 1, L, C_a * M)``: the audio latents on
    the audio VAE's normalised scale, decoded to the MP4s' sound track with infer.py's audio VAE and vocoder.

    A model trained on latents (data=latents) gets ``samples.npz`` with ``latents`` float32 ``(N, C, [T,] H, W)``
    in its VAE's scale instead, and no picture: decode them with the VAE that encoded the data. Text-conditioned
    models write ``captions`` (the prompt of each sample, where known) instead of ``labels``.

    Samples of several shapes (``shapes``: the requests' distinct shapes, more than one; a prompt_file with sizes)
    cannot share one array or grid: each shape gets its own set, named by ``shape_names`` (``HxW`` / ``HxWxF``,
    default the shape's cells): ``samples-<name>.npz`` (the same keys, plus ``index`` int64: the sample numbers it
    holds), the grid ``samples-<name>.png`` / ``.gif``, and videos' ``sample-<i>.mp4`` / ``.gif`` each, named by
    their sample number i whatever their shape.

    When SIGTERM stops sampling (``ringdit.commands.preemption``), the samples of every finished batch are written
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
            if AUDIO_KEY in gathered:  # the sound sampled beside the video (LTX-2): latents, decoded with the video
                contents[AUDIO_KEY] = gathered[AUDIO_KEY].reshape(-1, *local[AUDIO_KEY].shape[1:])[order].numpy()
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
            return [*write_pixels(samples, self.output_dir, stem=stem, fps=self.fps), npz]
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


def _requested_samples(trainer) -> int:
    """How many samples ``predict`` was asked for: the length of its (first) request set."""
    loaders = trainer.predict_dataloaders
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    return len(loader.dataset)
