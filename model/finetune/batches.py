"""Which examples go together: length-grouped micro-batches, in one stream for the run.

Examples of similar length share a micro-batch, so little of it is padding (a chat set
mixes 30-token and 300-token conversations): each epoch shuffles the examples with the
seed, sorts each window of ``GROUP`` batches by length, cuts it into batches and shuffles
the batches (transformers' LengthGroupedSampler, without its longest-first rule). The
epochs' batches form one stream; optimizer step k takes the k-th run of
``accumulation × world_size`` batches from it, rank r every world_size-th of those. So
the batches of a step depend on (seed, step) alone: a resumed run takes the batches an
uninterrupted one would, and every rank knows how many tokens the whole step scores.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

GROUP = 50  # batches whose examples are sorted by length together


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int,
                  epoch: int) -> list[list[int]]:
    """One epoch's micro-batches of example indices, grouped by length."""
    rng = random.Random(f"{seed}/{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * GROUP
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        group = sorted(order[start:start + window], key=lambda i: lengths[i], reverse=True)
        batches += [group[i:i + batch_size] for i in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


@dataclass(frozen=True)
class BatchPlan:
    """The run's micro-batches and how steps take them."""

    batches: list[list[int]]  # every epoch's, in order
    per_step: int  # accumulation × world_size
    world_size: int

    @classmethod
    def build(cls, lengths: Sequence[int], batch_size: int, epochs: int, seed: int,
              accumulation: int, world_size: int) -> BatchPlan:
        batches = [b for e in range(epochs) for b in epoch_batches(lengths, batch_size, seed, e)]
        return cls(batches, accumulation * world_size, world_size)

    @property
    def steps(self) -> int:
        """Whole optimizer steps in the stream (a last partial one is left out)."""
        return len(self.batches) // self.per_step

    def step(self, k: int) -> list[list[int]]:
        """Every micro-batch of step k, all ranks'."""
        return self.batches[k * self.per_step:(k + 1) * self.per_step]

    def rank_share(self, k: int, rank: int) -> list[list[int]]:
        """Rank ``rank``'s micro-batches of step k."""
        return self.step(k)[rank::self.world_size]

    def epoch_of(self, k: int, per_epoch: int) -> float:
        """How many epochs step k completes (fractional)."""
        return (k + 1) * self.per_step / max(per_epoch, 1)
