"""A training order that a run resumed mid-epoch continues exactly, with the same augmentations: the
order is a function of ``(seed, epoch)``, the loader's ``state_dict`` (which Lightning checkpoints)
counts the images of the epoch consumed, and every sample's augmentation seed is a hash of
``(seed, epoch, index)``, whichever worker decodes it."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler

from ssl_vit.runtime import world_info

log = logging.getLogger(__name__)


class SeededIndex(NamedTuple):
    """A dataset index with the seed of its augmentations."""

    index: int
    seed: int


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # SplitMix64's finaliser (Steele, Lea & Flood 2014); uint64 arrays wrap on overflow, as it needs.
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_seeds(seed: int, epoch: int, indices: Sequence[int]) -> list[int]:
    """The augmentation seeds of samples ``indices`` in ``epoch``: SplitMix64 chained over (seed, epoch, index)."""
    key = _splitmix64(_splitmix64(np.array([seed % 2**64], dtype=np.uint64)) ^ np.uint64(epoch))  # [1]
    return _splitmix64(key ^ np.asarray(indices, dtype=np.uint64)).tolist()


class ResumableSampler(DistributedSampler):
    """Shuffled per ``(seed, epoch)``, sharded over ``num_replicas`` processes (None: from ``torch.distributed``),
    yielding :class:`SeededIndex` items; a ``DistributedSampler``, so Lightning keeps it instead of its own.
    A loop that iterates again without ``set_epoch`` gets the next epoch, not a repeat."""

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0) -> None:
        default_rank, default_world = world_info()
        # Padded, not dropped, as Lightning's own distributed sampler; the loader drops an incomplete batch.
        super().__init__(dataset, num_replicas=default_world if num_replicas is None else num_replicas,
                         rank=default_rank if rank is None else rank, shuffle=shuffle, seed=seed, drop_last=False)
        self._epoch_set = True
        self._skip = 0  # samples of this process's share to skip at the start of the next pass
        self._skip_epoch = 0
        self.start = 0  # samples skipped at the start of the current pass
        self._start_epoch: int | None = None  # the epoch of that pass

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._epoch_set = True

    def skip(self, epoch: int, num_samples: int) -> None:
        """Start the next pass over ``epoch`` after its first ``num_samples`` samples."""
        self.set_epoch(epoch)
        self._skip, self._skip_epoch = num_samples, epoch

    def resume_offset(self) -> int:
        """This process's samples of the current epoch before its pass: the position a resume asked
        for (until the pass begins), or where the pass under way began; 0 for a fresh epoch."""
        if self._skip and self._skip_epoch == self.epoch:
            return self._skip
        return self.start if self._start_epoch == self.epoch else 0

    def __iter__(self) -> Iterator[SeededIndex]:  # type: ignore[override]
        if not self._epoch_set:
            self.epoch += 1  # iterated again without set_epoch: a new epoch, not a repeat
        self._epoch_set = False
        self.start = self._skip if self._skip_epoch == self.epoch else 0
        self._start_epoch = self.epoch
        self._skip = 0
        indices = list(super().__iter__())[self.start :]  # this process's share, in epoch order
        return map(SeededIndex, indices, sample_seeds(self.seed, self.epoch, indices))


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` whose state is the training loop's position:
    ``{"seed", "epoch", "batches", "samples"}``, the batches of the epoch the iterator returned (not
    those workers drew ahead) and the images they held over all processes."""

    def __init__(self, dataset: Dataset, sampler: ResumableSampler, **kwargs: Any) -> None:
        if isinstance(sampler, SequentialSampler):
            # Lightning's overfit_batches rebuilds the loader with a SequentialSampler: kept resumable.
            sampler = ResumableSampler(dataset, shuffle=False)
        super().__init__(dataset, sampler=sampler, **kwargs)
        self.resumable: ResumableSampler = sampler  # (self.sampler, typed)
        self._batches = 0  # batches of epoch ``_pass_epoch`` handed out
        self._samples = 0  # and this process's samples in them (with those skipped on a resume)
        self._pass_epoch = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._counting(super().__iter__())

    def _counting(self, batches: Iterator[Any]) -> Iterator[Any]:
        sampler = self.resumable
        self._batches, self._samples, self._pass_epoch = 0, 0, sampler.epoch
        batch_size = self.batch_size or 1
        for i, batch in enumerate(batches, start=1):
            # The sampler has begun its pass by now, so it knows where the pass started.
            self._batches, self._pass_epoch = -(-sampler.start // batch_size) + i, sampler.epoch
            self._samples = min(sampler.start + i * batch_size, sampler.num_samples)
            yield batch

    def state_dict(self) -> dict[str, int]:
        sampler = self.resumable
        if self._pass_epoch == sampler.epoch and self._batches:
            batches, samples = self._batches, self._samples
        else:
            # No batch of this epoch handed out yet: a fresh epoch (0), or a resumed one whose position
            # must survive a checkpoint written before its first batch.
            samples = sampler.resume_offset()
            batches = -(-samples // (self.batch_size or 1))
        # Process p's share is positions p, p + R, p + 2R ... of the epoch's permutation, so s
        # samples from each of R processes are its first s * R positions.
        return {"seed": sampler.seed, "epoch": sampler.epoch, "batches": batches, "samples": samples * sampler.num_replicas}

    def epochs_done(self) -> float:
        """Passes over the training set so far, with the part of the current one; an epoch whose last
        batch is handed out counts whole."""
        state = self.state_dict()
        seen = state["samples"] / self.resumable.num_replicas  # this process's share of the epoch
        if self._epoch_ended(seen):
            return float(state["epoch"] + 1)
        return state["epoch"] + seen / self.resumable.num_samples

    def _epoch_ended(self, seen: float) -> bool:
        """Whether ``seen`` samples of this process's share leave no batch (``drop_last``: a whole one)."""
        return self.resumable.num_samples - seen < ((self.batch_size or 1) if self.drop_last else 1)

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler, epoch = self.resumable, int(state["epoch"])
        if "samples" in state:
            seen = int(state["samples"])
            skip = -(-seen // sampler.num_replicas)  # this process's share of the images seen
            if seen % sampler.num_replicas:
                log.warning("resuming on %d processes after %d images of the epoch: each process skips %d, so %d images of "
                            "the epoch are left out", sampler.num_replicas, seen, skip, skip * sampler.num_replicas - seen)
        else:  # a checkpoint from before the sample count: the batch size is assumed unchanged
            skip = int(state["batches"]) * (self.batch_size or 1)
        if self._epoch_ended(skip):
            epoch, skip = epoch + 1, 0  # saved after the epoch's last batch: the next starts afresh
        sampler.seed = int(state["seed"])  # the checkpoint's: a run seeded at random continues its order
        sampler.skip(epoch, skip)
