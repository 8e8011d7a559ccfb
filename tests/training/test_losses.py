"""The recall losses on small exact cases."""

from __future__ import annotations

import math

import torch

from training.losses import info_nce, masked_means


def test_info_nce_is_the_cross_entropy_of_cosines_over_tau():
    q = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    k = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    loss, acc = info_nce(q, k, tau=0.5)
    # cosines: diagonal 1, off-diagonal 0 -> logits [[2, 0], [0, 2]]
    assert math.isclose(float(loss), -math.log(math.exp(2) / (math.exp(2) + 1)), rel_tol=1e-6)
    assert float(acc) == 1.0
    swapped, acc = info_nce(q, k.flip(0), tau=0.5)
    assert float(swapped) > float(loss) and float(acc) == 0.0
    extra, _ = info_nce(q, k, tau=0.5, extra_keys=torch.tensor([[1.0, 1.0]]))  # one more negative, cosine 0.71
    assert float(extra) > float(loss)


def test_info_nce_gradients_reach_both_sides():
    q = torch.randn(4, 8, requires_grad=True)
    k = torch.randn(4, 8, requires_grad=True)
    info_nce(q, k, 0.1)[0].backward()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0


def test_masked_means():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    groups = torch.tensor([0, 1, 1, 0])
    a, b, empty = masked_means(values, groups, 3)
    assert (float(a), float(b), float(empty)) == (2.5, 2.5, 0.0)
