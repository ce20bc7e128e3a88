"""Sampling jobs for ``infer.py``: which samples to draw, and collecting them from every rank into files."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import Dataset

from ringdit.atomic import atomic_write
from ringdit.images import save_samples
from ringdit.media.writing import write_media
from ringdit.seeding import Stream, seed_of
from ringdit.training.preemption import Preempted


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
        if isinstance(label, float) and not label.is_integer() or isinstance(label, bool):
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


class SampleRequests(Dataset):
    """Item i = (i, condition_i, the noise seed of sample i): what sample i is, independent of how many samples there
    are and how they are split over ranks.

    ``conditions``: class ids, or a dict of text tensors ``(N, ...)`` (one prompt embedding per sample).
    """

    def __init__(self, conditions: list[int] | dict[str, torch.Tensor], seed: int):
        self.conditions, self.seed = conditions, seed

    def __len__(self) -> int:
        if isinstance(self.conditions, dict):
            return len(next(iter(self.conditions.values())))
        return len(self.conditions)

    def __getitem__(self, i: int):
        if isinstance(self.conditions, dict):
            return i, {key: value[i] for key, value in self.conditions.items()}, self.noise_seed(i)
        return i, self.conditions[i], self.noise_seed(i)

    def noise_seed(self, i: int) -> int:
        return seed_of(Stream.INFERENCE, self.seed, i)


class SampleWriter(L.Callback):
    """Collect every rank's samples after ``predict`` and write ``samples.png`` (video: ``samples.gif`` plus
    ``sample-000.mp4`` / ``.gif`` ... each) and
    ``samples.npz`` (``images`` uint8 ``(N, [T,] H, W, C)``, ``labels`` int64 ``(N,)``) into ``output_dir``.

    A model trained on latents (data=latents) gets ``samples.npz`` with ``latents`` float32 ``(N, C, [T,] H, W)``
    in its VAE's scale instead, and no picture: decode them with the VAE that encoded the data. Text-conditioned
    models write ``captions`` (the prompt of each sample, where known) instead of ``labels``.

    When SIGTERM stops sampling (``ringdit.training.preemption``), the samples of every finished batch are written
    the same way. samples.npz is written to a temp file and renamed: it is never half-written.
    """

    def __init__(self, output_dir: str | Path, columns: int | None = None, captions: list[str] | None = None,
                 fps: int = 16):
        self.output_dir, self.columns, self.captions, self.fps = Path(output_dir), columns, captions, fps
        self.batches: list[dict] = []
        self.written: list[Path] = []

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
        """Gather every rank's samples (a collective) and write them on rank 0: (samples written, the files)."""
        local = self._padded_to_equal_counts(trainer, pl_module)
        if local is None:
            return 0, ""
        kind = "images" if "images" in local else "latents"
        gathered = {key: pl_module.all_gather(value.to(pl_module.device)).cpu() for key, value in local.items()}
        if not trainer.is_global_zero:
            return 0, ""
        index = gathered["index"].reshape(-1)
        real = torch.nonzero(index >= 0).reshape(-1)  # drop the padding rows (index -1)
        _, first = np.unique(index[real].numpy(), return_index=True)  # sequence-parallel ranks repeat samples
        order = real[torch.from_numpy(first)]
        samples = gathered[kind].reshape(-1, *local[kind].shape[1:])[order].numpy()
        contents = {kind: samples}
        if "labels" in gathered:  # class-conditional models
            contents["labels"] = gathered["labels"].reshape(-1)[order].numpy().astype(np.int64)
        if self.captions is not None:  # text-conditioned models: the prompt of each sample (all, or those finished)
            contents["captions"] = np.array([self.captions[i] for i in index[order].tolist()])
        self.output_dir.mkdir(parents=True, exist_ok=True)
        npz = self.output_dir / "samples.npz"
        with atomic_write(npz) as partial, open(partial, "wb") as f:  # a samples.npz is never half-written
            np.savez_compressed(f, **contents)
        self.written = [npz]
        if kind == "images" and samples.ndim == 5:  # videos: the grid as a GIF, and each as MP4 + GIF
            self.written = write_media(samples, self.output_dir, fps=self.fps) + self.written
        elif kind == "images":
            columns = self.columns or min(len(samples), 10)
            self.written.insert(0, save_samples(samples, self.output_dir / "samples", columns=columns))
        shown = self.written if len(self.written) <= 3 else [*self.written[:2], f"... ({len(self.written)} files)"]
        return len(samples), " and ".join(map(str, shown))

    def _padded_to_equal_counts(self, trainer, pl_module) -> dict[str, torch.Tensor] | None:
        """This rank's samples, padded with rows of index -1 to the largest count of any rank: prediction splits
        samples without repeating any (3 samples on 2 data-parallel ranks: 2 and 1; 1 sample: 1 and 0), and
        all_gather needs equal shapes. A rank with the most samples tells the others the shapes; None when no rank
        has any (SIGTERM before the first batch was finished)."""
        local = {key: torch.cat([b[key] for b in self.batches]) for key in self.batches[0]} if self.batches else {}
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


def _requested_samples(trainer) -> int:
    """How many samples ``predict`` was asked for: the length of its (first) request set."""
    loaders = trainer.predict_dataloaders
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    return len(loader.dataset)
