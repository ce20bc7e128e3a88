"""Training batches indexed by optimizer step, so that a resumed run reads exactly the batches it would have read.

The data order is a stream of seeded per-epoch permutations of the dataset. Global step ``s`` takes the next
``batch_size x dp_size`` indices of that stream and data-parallel rank ``r`` its ``r``-th slice: the batch of a step
depends only on (seed, step, dp rank), never on how many steps ran in this process. Ranks of one sequence-parallel
group share a dp rank, so they read the same samples.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from ringdit.seeding import Stream, generator


class StepBatches(IterableDataset):
    """Yields the collated batches of steps ``[start_step, total_steps)`` for one data-parallel rank.

    With DataLoader workers, worker w produces steps w, w + W, ...; the DataLoader's round-robin over workers
    returns them in step order.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, total_steps: int, start_step: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0):
        if len(dataset) == 0:
            raise ValueError("the training dataset is empty")
        self.dataset, self.batch_size = dataset, batch_size
        self.start_step, self.total_steps = start_step, total_steps
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self._permutations: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        # The whole run, not what is left: a resumed Lightning epoch counts on from the checkpoint's batch.
        return self.total_steps

    def indices(self, step: int) -> list[int]:
        """Dataset indices of this rank's share of global batch ``step``."""
        size = len(self.dataset)
        first = (step * self.dp_size + self.dp_rank) * self.batch_size
        return [int(self._permutation(pos // size)[pos % size]) for pos in range(first, first + self.batch_size)]

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._permutations:
            if len(self._permutations) > 2:  # keep the few epochs a batch spans (more only when batch > dataset)
                self._permutations.pop(min(self._permutations))
            order = generator(Stream.DATA_ORDER, self.seed, epoch)
            self._permutations[epoch] = torch.randperm(len(self.dataset), generator=order)
        return self._permutations[epoch]

    def __iter__(self):
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        for step in range(self.start_step + worker_id, self.total_steps, workers):
            yield default_collate([self.dataset[i] for i in self.indices(step)])
