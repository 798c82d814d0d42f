"""preserved_rng(): every global generator is back to its state on entry."""
import random

import numpy as np
import pytest
import torch

from pixal3d.staging import preserved_rng


def draw() -> tuple:
    return (torch.rand(3).tolist(), random.random(), np.random.rand())


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_generators_are_restored_after_the_block():
    seed_all(11)
    expected = draw()
    seed_all(11)
    with preserved_rng():
        draw()
        torch.nn.Linear(64, 64)  # random init
    assert draw() == expected


def test_generators_are_restored_when_the_block_raises():
    seed_all(5)
    expected = draw()
    seed_all(5)
    with pytest.raises(RuntimeError), preserved_rng():
        draw()
        raise RuntimeError("loader failed")
    assert draw() == expected


def test_control_without_preservation_the_draws_shift():
    seed_all(11)
    expected = draw()
    seed_all(11)
    draw()
    assert draw() != expected


def test_private_generators_are_left_alone():
    gen = torch.Generator().manual_seed(1)
    with preserved_rng():
        first = torch.rand(2, generator=gen)
    assert not torch.equal(torch.rand(2, generator=gen), first)
