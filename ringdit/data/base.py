"""What every ringdit data module shares: a held-out split, step-indexed training batches of one bucket (shape)
each, dp-aware loaders, and the batch size per bucket (a fixed count, or a token budget)."""

from __future__ import annotations

import math

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ringdit.data.datasets import DEFAULT_VAL_FRACTION, DatasetList
from ringdit.data.steps import StepBatches, ValidationBatches
from ringdit.common.errors import ConfigError, require_count
from ringdit.common.seeding import Stream, generator


class ImageDataModule(L.LightningDataModule):
    """Subclasses set ``channels``, ``image_size`` ((H, W) or (T, H, W)), ``num_classes``, ``class_names`` and
    implement ``build_dataset()`` returning a map-style dataset of ``(x, label)``: pixels scaled to [-1, 1], or
    latents as the user's VAE made them (data=latents, whose description adds ``latent_scale``).

    Data of several shapes (buckets) also set ``bucket_shapes`` (each bucket's sample shape ``([T,] H, W)``) and
    ``sample_buckets`` ((N,) the bucket of each dataset index) before ``describe()``; ``image_size`` is then the most
    frequent bucket's shape. ``tokens_per_batch`` (with ``set_patch_shape``, from the model) sizes each bucket's
    batch by its token count instead of ``batch_size``.
    """

    channels: int
    image_size: tuple[int, ...]
    num_classes: int
    class_names: list[str]
    bucket_shapes: list[tuple[int, ...]] | None = None  # None: one bucket, image_size
    sample_buckets: np.ndarray | None = None

    def __init__(self, batch_size: int = 64, num_workers: int = 0, val_fraction: float | None = 0.05,
                 val_batches: int = 4, seed: int = 0, tokens_per_batch: int | None = None):
        super().__init__()
        require_count("data.batch_size", batch_size)
        require_count("data.tokens_per_batch", tokens_per_batch, optional=True,
                      hint="model tokens per rank and step; each bucket's batch is as many samples as fit")
        self.tokens_per_batch = tokens_per_batch
        self.patch_shape: tuple[int, ...] | None = None
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**32 - 1:
            raise ValueError(f"data.seed must be an integer from 0 to 2**32 - 1 (it defaults to seed), got {seed!r}")
        if val_fraction is None:  # data.val_fraction: null, the default of data modules without an evaluation set
            val_fraction = DEFAULT_VAL_FRACTION
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.batch_size, self.num_workers = batch_size, num_workers
        self.val_fraction, self.val_batches, self.seed = val_fraction, val_batches, seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.dataset_list: DatasetList | None = None  # several folders (data.datasets) or an evaluation set

    def build_dataset(self) -> Dataset:
        raise NotImplementedError

    def describe(self) -> dict:
        """What a checkpoint records about the data, so sampling knows shapes and class names."""
        info = {"channels": self.channels, "image_size": list(self.image_size), "num_classes": self.num_classes,
                "class_names": list(self.class_names)}
        return {**info, "buckets": self.describe_buckets()} if self.bucket_shapes is not None else info

    def describe_buckets(self) -> list[dict]:
        """``[{"shape": [..], "samples": n}, ...]`` of the training folders, the most frequent bucket first (then by
        shape)."""
        rows = self.sample_buckets if self.dataset_list is None else \
            self.sample_buckets[:self.dataset_list.training_rows]  # an evaluation set's shapes do not train
        counts = np.bincount(rows, minlength=len(self.bucket_shapes))
        order = sorted((b for b in range(len(counts)) if counts[b]), key=lambda b: (-counts[b], self.bucket_shapes[b]))
        return [{"shape": list(self.bucket_shapes[b]), "samples": int(counts[b])} for b in order]

    def shapes(self) -> list[tuple[int, ...]]:
        """Each bucket's sample shape ``([T,] H, W)``."""
        return list(self.bucket_shapes) if self.bucket_shapes is not None else [tuple(self.image_size)]

    def set_patch_shape(self, patch: tuple[int, ...]) -> None:
        """The model's patch (the latent cells one token covers): a bucket's token count, for ``tokens_per_batch``.
        A budget below one sample of the largest bucket is a ConfigError (before any process is spawned)."""
        self.patch_shape = tuple(patch)
        if self.tokens_per_batch is not None:
            largest = max(self.shapes(), key=self.tokens_of)
            if self.tokens_per_batch < self.tokens_of(largest):
                raise ConfigError(f"data.tokens_per_batch={self.tokens_per_batch} is smaller than one sample of the "
                                  f"largest bucket {list(largest)} ({self.tokens_of(largest)} tokens); set it to at "
                                  f"least {self.tokens_of(largest)}, or leave it unset for data.batch_size")

    def tokens_of(self, shape: tuple[int, ...]) -> int:
        patch = self.patch_shape or (1,) * len(shape)
        return math.prod(s // p for s, p in zip(shape, patch))

    def batch_sizes(self) -> list[int]:
        """Samples per rank and step for each bucket: ``batch_size``, or as many as ``tokens_per_batch`` holds."""
        if self.tokens_per_batch is None:
            return [self.batch_size] * len(self.shapes())
        if self.patch_shape is None:
            raise ValueError("data.tokens_per_batch needs the model's patch: call set_patch_shape(model patch) first")
        return [max(1, self.tokens_per_batch // self.tokens_of(shape)) for shape in self.shapes()]

    def largest_step(self) -> tuple[int, int]:
        """(tokens per sample, batch size) of the bucket whose steps hold the most tokens: the memory peak."""
        return max(((self.tokens_of(shape), batch) for shape, batch in zip(self.shapes(), self.batch_sizes())),
                   key=lambda step: (step[0] * step[1], step[0]))

    def _members(self, subset: Subset) -> list[list[int]]:
        """Positions in ``subset`` of each bucket's samples."""
        if self.sample_buckets is None:
            return [list(range(len(subset)))]
        members: list[list[int]] = [[] for _ in self.shapes()]
        for position, index in enumerate(subset.indices):
            members[int(self.sample_buckets[index])].append(position)
        return members

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        dataset = self.build_dataset()
        if self.dataset_list is not None:  # repeats: a training row appears that many times; eval rows validate
            train, val = self.dataset_list.split(self.seed, self.val_fraction)
            self.val_set, self.train_set = Subset(dataset, val), Subset(dataset, train)
            return
        order = torch.randperm(len(dataset), generator=generator(Stream.DATA_SPLIT, self.seed)).tolist()
        n_val = int(len(dataset) * self.val_fraction)
        self.val_set, self.train_set = Subset(dataset, order[:n_val]), Subset(dataset, order[n_val:])

    def _dp(self) -> tuple[int, int]:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs if self.trainer else None
        return (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (0, 1)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        batches_per_step = trainer.accumulate_grad_batches
        require_count("trainer.max_steps", trainer.max_steps, hint="training is counted in steps")
        dp_rank, dp_size = self._dp()
        members, sizes, chances = self._training_buckets()
        kept = [b for b, m in enumerate(members) if m]  # a bucket whose samples are all held out trains nothing
        batches = StepBatches(
            self.train_set, [sizes[b] for b in kept], buckets=[members[b] for b in kept], dp_rank=dp_rank,
            chances=None if chances is None else [chances[b] for b in kept],
            dp_size=dp_size, seed=self.seed, start_step=trainer.global_step * batches_per_step,
            total_steps=trainer.max_steps * batches_per_step, batches_per_step=batches_per_step,
        )
        return DataLoader(batches, batch_size=None, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def _training_buckets(self) -> tuple[list[list[int]], list[int], list[float] | None]:
        """The training set's buckets (positions in ``train_set``), their batch sizes and chances per step (None:
        in proportion to their batches). Weighted dataset lists: one bucket per (folder, shape), drawn by weight."""
        if self.dataset_list is not None and self.dataset_list.weighted:
            return self.dataset_list.weighted_groups(self.train_set.indices, self.sample_buckets, self.batch_sizes())
        return self._members(self.train_set), self.batch_sizes(), None

    def val_dataloader(self) -> DataLoader:
        # batches of one bucket each, this data-parallel rank's slice of every global batch (not Lightning's
        # DistributedSampler, which knows nothing of buckets)
        dp_rank, dp_size = self._dp()
        batches = ValidationBatches(self.val_set, self.batch_sizes(), self._members(self.val_set),
                                    max_batches=self.val_batches, dp_rank=dp_rank, dp_size=dp_size)
        return DataLoader(batches, batch_size=None, num_workers=self.num_workers)
