"""The tests' references themselves: a shortcut in one must give what its plain form gives."""

import pytest
import torch

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
