"""What every ringdit data module shares: a held-out split, step-indexed training batches, dp-aware loaders."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ringdit.data.steps import StepBatches
from ringdit.errors import require_count
from ringdit.seeding import Stream, generator


class ImageDataModule(L.LightningDataModule):
    """Subclasses set ``channels``, ``image_size`` ((H, W) or (T, H, W)), ``num_classes``, ``class_names`` and
    implement ``build_dataset()`` returning a map-style dataset of ``(x, label)``: pixels scaled to [-1, 1], or
    latents as the user's VAE made them (data=latents, whose description adds ``latent_scale``)."""

    channels: int
    image_size: tuple[int, ...]
    num_classes: int
    class_names: list[str]

    def __init__(self, batch_size: int = 64, num_workers: int = 0, val_fraction: float = 0.05, val_batches: int = 4,
                 seed: int = 0):
        super().__init__()
        require_count("data.batch_size", batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**32 - 1:
            raise ValueError(f"data.seed must be an integer from 0 to 2**32 - 1 (it defaults to seed), got {seed!r}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.batch_size, self.num_workers = batch_size, num_workers
        self.val_fraction, self.val_batches, self.seed = val_fraction, val_batches, seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def build_dataset(self) -> Dataset:
        raise NotImplementedError

    def describe(self) -> dict:
        """What a checkpoint records about the data, so sampling knows shapes and class names."""
        return {"channels": self.channels, "image_size": list(self.image_size), "num_classes": self.num_classes,
                "class_names": list(self.class_names)}

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        dataset = self.build_dataset()
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
        batches = StepBatches(
            self.train_set, self.batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=self.seed,
            start_step=trainer.global_step * batches_per_step, total_steps=trainer.max_steps * batches_per_step,
        )
        return DataLoader(batches, batch_size=None, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        # Lightning wraps this in a DistributedSampler with the strategy's data-parallel rank and size.
        count = min(len(self.val_set), self.val_batches * self.batch_size)
        return DataLoader(Subset(self.val_set, range(count)), batch_size=self.batch_size, num_workers=self.num_workers)
