"""How a step's (and validation's) loss pools its micro-batches (`StepStats.sum`): the mean of their means, or, where
each loss carries the denominator of its terms (the on-policy stage), the mean over all their terms."""

import pytest
import torch

from dflash_train.architectures.stats import StepStats


def part(loss: float, normaliser: float | None = None) -> StepStats:
    return StepStats(loss=torch.tensor(loss), correct_per_slot=torch.tensor([1, 2]),
                     counted_per_slot=torch.tensor([3, 4]), accepted_sum=torch.tensor(5), kept_blocks=torch.tensor(2),
                     normaliser=None if normaliser is None else torch.tensor(normaliser))


def test_micro_batch_means_average_and_their_counts_add_up():
    total = StepStats.sum([part(1.0), part(4.0)])
    assert float(total.loss) == 2.5 and total.normaliser is None
    assert total.counted_per_slot.tolist() == [6, 8] and int(total.kept_blocks) == 4


def test_losses_with_normalisers_pool_every_term():
    """3 terms of mean 1 and 1 term of mean 4: the mean over the 4 terms is 1.75 (the mean of means would be 2.5)."""
    total = StepStats.sum([part(1.0, 3.0), part(4.0, 1.0)])
    assert float(total.loss) == pytest.approx(1.75) and float(total.normaliser) == 4.0


def test_a_step_mixing_pooled_and_plain_losses_is_refused():
    with pytest.raises(ValueError, match="normaliser"):
        StepStats.sum([part(1.0, 3.0), part(4.0)])
