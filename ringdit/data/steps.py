"""Training batches indexed by optimizer step, so that a resumed run reads exactly the batches it would have read.

A dataset may hold several *buckets*: groups of samples of one shape (aspect ratio, frame count). Every global
batch comes from one bucket, so the shapes in a batch agree, and every rank of the whole world -- data-parallel
replicas and the ranks of a sequence-parallel group -- draws the same bucket for a step:

- the bucket of step ``s`` is drawn from the seeded stream ``DATA_BUCKET`` (keyed by the block of ``BLOCK`` steps
  ``s`` falls in), with probability proportional to the number of batches the bucket holds, so over a run each
  bucket's share of the samples read is its share of the data (or with the ``chances`` given: a dataset list's
  weights, ringdit/data/datasets.py);
- bucket ``b``'s data order is a stream of seeded per-epoch permutations of its samples. The ``k``-th step that
  draws ``b`` takes the next ``batch_size[b] x dp_size`` samples of that stream, and data-parallel rank ``r`` its
  ``r``-th slice.

So the batch of a step depends only on (seed, step, dp rank), never on how many steps ran in this process. With one
bucket this is the single stream of per-epoch permutations of earlier versions (the same batches, so their runs
resume exactly). Ranks of one sequence-parallel group share a dp rank, so they read the same samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from ringdit.common.seeding import Stream, generator

BLOCK = 1024  # steps whose buckets one generator draws: resuming at step s replays s / BLOCK draws, not s


class StepBatches(IterableDataset):
    """Yields the collated (micro-)batches ``[start_step, total_steps)`` for one data-parallel rank (both counted in
    micro-batches: ``batches_per_step`` of them per optimizer step under gradient accumulation).

    ``buckets``: each bucket's dataset indices (default: one bucket, the whole dataset); ``batch_size``: samples per
    rank and step, one int for every bucket or one per bucket. With DataLoader workers, worker w produces batches
    w, w + W, ...; the DataLoader's round-robin over workers returns them in order.
    """

    def __init__(self, dataset: Dataset, batch_size: int | Sequence[int], *, total_steps: int, start_step: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, buckets: Sequence[Sequence[int]] | None = None,
                 batches_per_step: int = 1, chances: Sequence[float] | None = None):
        if len(dataset) == 0:
            raise ValueError("the training dataset is empty")
        self.dataset = dataset
        self.buckets = [list(b) for b in buckets] if buckets is not None else [range(len(dataset))]
        if not self.buckets or any(len(b) == 0 for b in self.buckets):
            raise ValueError("every bucket needs at least one sample")
        sizes = [batch_size] * len(self.buckets) if isinstance(batch_size, int) else list(batch_size)
        if len(sizes) != len(self.buckets):
            raise ValueError(f"{len(sizes)} batch sizes for {len(self.buckets)} buckets")
        self.batch_sizes = sizes
        self.start_step, self.total_steps = start_step, total_steps
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.batches_per_step = batches_per_step  # gradient accumulation: an optimizer step's micro-batches share a bucket
        # a bucket's chance per step: the batches it holds, so samples are read in the data's proportions (the dp
        # size, a common factor, is left out: the draws depend on the data and the batch sizes only)
        # ``chances``: each bucket's chance given instead (data.datasets' weights: a folder's share, whatever its size)
        self.weights = torch.tensor([len(b) / s for b, s in zip(self.buckets, sizes)] if chances is None else
                                    list(chances), dtype=torch.float64)
        if len(self.weights) != len(self.buckets) or not (self.weights > 0).all():
            raise ValueError(f"{len(self.weights)} chances for {len(self.buckets)} buckets, each must be > 0")
        self._permutations: dict[tuple[int, int], torch.Tensor] = {}
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block -> (its draws, counts before it)

    def __len__(self) -> int:
        # The whole run, not what is left: a resumed Lightning epoch counts on from the checkpoint's batch.
        return self.total_steps

    def bucket_of(self, step: int) -> int:
        """The bucket every rank reads at global step ``step``."""
        if len(self.buckets) == 1:
            return 0
        draws, _ = self._block(step // BLOCK)
        return int(draws[step % BLOCK])

    def draws_before(self, step: int, bucket: int) -> int:
        """How many earlier steps read ``bucket``: where this step starts in the bucket's data order."""
        if len(self.buckets) == 1:
            return step
        draws, before = self._block(step // BLOCK)
        return int(before[bucket]) + int((draws[: step % BLOCK] == bucket).sum())

    def _block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``block``'s bucket draws (BLOCK,) and how often each bucket was drawn in the blocks before it."""
        if not self._blocks:
            self._blocks[0] = (self._draw(0), torch.zeros(len(self.buckets), dtype=torch.int64))
        known = max(b for b in self._blocks if b <= block)  # replay from the latest block known up to this one
        for b in range(known, block):
            draws, before = self._blocks[b]
            self._blocks[b + 1] = (self._draw(b + 1), before + torch.bincount(draws, minlength=len(self.buckets)))
        return self._blocks[block]

    def _draw(self, block: int) -> torch.Tensor:
        return torch.multinomial(self.weights, BLOCK, replacement=True,
                                 generator=generator(Stream.DATA_BUCKET, self.seed, block))

    def indices(self, batch_index: int) -> list[int]:
        """Dataset indices of this rank's share of global (micro-)batch ``batch_index``: micro-batch
        ``batch_index % batches_per_step`` of optimizer step ``batch_index // batches_per_step``."""
        step, micro = divmod(batch_index, self.batches_per_step)
        bucket = self.bucket_of(step)
        members, batch = self.buckets[bucket], self.batch_sizes[bucket]
        size = len(members)
        read = self.draws_before(step, bucket) * self.batches_per_step + micro  # this bucket's batches before this one
        first = (read * self.dp_size + self.dp_rank) * batch
        return [members[int(self._permutation(bucket, pos // size)[pos % size])] for pos in range(first, first + batch)]

    def _permutation(self, bucket: int, epoch: int) -> torch.Tensor:
        if (bucket, epoch) not in self._permutations:
            if len(self._permutations) > 2 * len(self.buckets):  # keep the few epochs a batch spans per bucket
                self._permutations.pop(next(iter(self._permutations)))
            # one bucket: the key of earlier versions, so that their runs resume on the same batches
            key = (epoch,) if len(self.buckets) == 1 else (epoch, bucket)
            order = generator(Stream.DATA_ORDER, self.seed, *key)
            self._permutations[bucket, epoch] = torch.randperm(len(self.buckets[bucket]), generator=order)
        return self._permutations[bucket, epoch]

    def __iter__(self):
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        for step in range(self.start_step + worker_id, self.total_steps, workers):
            yield default_collate([self.dataset[i] for i in self.indices(step)])


class ValidationBatches(IterableDataset):
    """The held-out samples in global batches of one bucket each: up to ``max_batches`` per bucket, bucket by
    bucket, the same on every rank; dp rank r reads its slice of each. A bucket's last batch is filled up from its
    first samples, so every replica runs the same number of forwards of the same shape (a sequence-parallel group
    and DDP's reductions need that)."""

    def __init__(self, dataset: Dataset, batch_sizes: Sequence[int], buckets: Sequence[Sequence[int]], *,
                 max_batches: int, dp_rank: int = 0, dp_size: int = 1):
        self.dataset, self.dp_rank, self.dp_size = dataset, dp_rank, dp_size
        self.batches: list[list[int]] = []  # this rank's indices of each global batch
        for members, batch in zip(buckets, batch_sizes):
            members, wanted = list(members), batch * dp_size
            if not members:
                continue
            count = min(max_batches, -(-len(members) // wanted))
            for b in range(count):
                global_batch = [members[(b * wanted + i) % len(members)] for i in range(wanted)]
                self.batches.append(global_batch[dp_rank * batch:(dp_rank + 1) * batch])

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        for batch in self.batches[worker_id::workers]:
            yield default_collate([self.dataset[i] for i in batch])
