"""The tests' references themselves: a shortcut in one must give what its plain form gives."""

import math

import pytest
import torch

from pcops import _vml
from tests import reference


@pytest.mark.parametrize("kind", ["uniform", "grid", "duplicates", "float32", "non-finite", "few"])
def test_first_entries_equal_a_stable_sort_of_whole_rows(kind):
    """reference.first (each row's k smallest by (value, index) from the entries up to the k-th
    value) equals the first k columns of a stable argsort, ties and repeated values included."""
    gen = torch.Generator().manual_seed(0)
    q, p = torch.rand(300, 3, generator=gen, dtype=torch.float64), torch.rand(700, 3, generator=gen, dtype=torch.float64)
    if kind == "grid":  # many equal distances
        q, p = (q * 4).round() / 4, (p * 4).round() / 4
    elif kind == "duplicates":  # each reference point several times
        p = p[torch.randint(0, 60, (700,), generator=gen)]
    elif kind == "float32":
        q, p = q.float() * 1e3, p.float() * 1e3
    elif kind == "non-finite":
        p[3], p[5, 1] = float("nan"), float("inf")
    elif kind == "few":
        p = p[:9]
    d = reference.distances(q, p)
    for k in (1, 2, 5, 16, 60):
        k = min(k, p.shape[0])
        assert torch.equal(reference.first(d, k), d.argsort(dim=1, stable=True)[:, :k])


def test_roots_are_the_nearest_floats_and_differentiable():
    """reference.root and pcops._vml.sqrt give each square's IEEE root (math.sqrt's in float64;
    in float32 the float64 root rounded once, which is IEEE's float32 root), where torch's CPU
    sqrt of a large tensor is an ulp off for some; the reference's gradient is sqrt's."""
    gen = torch.Generator().manual_seed(0)
    sq = torch.rand(100_000, generator=gen, dtype=torch.float64) * 4
    want = torch.tensor([math.sqrt(x) for x in sq.tolist()], dtype=torch.float64)
    assert torch.equal(reference.root(sq), want) and torch.equal(_vml.sqrt(sq), want)
    sq32 = sq.float()
    want32 = torch.tensor([math.sqrt(x) for x in sq32.double().tolist()], dtype=torch.float64).float()
    assert torch.equal(_vml.sqrt(sq32), want32)
    special = torch.tensor([0.0, float("inf"), float("nan"), -1.0], dtype=torch.float64)
    assert reference.root(special).tolist()[:2] == [0.0, math.inf] and reference.root(special)[2:].isnan().all()
    assert _vml.sqrt(special).tolist()[:2] == [0.0, math.inf] and _vml.sqrt(special)[2:].isnan().all()
    x = sq[:50].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(reference.root(x).sum(), x)
    assert torch.allclose(grad, 0.5 / x.detach().sqrt(), rtol=1e-15, atol=0)
