"""The cuML backend's exactness layer (centring, k + margin candidates, exact re-ranking, grouping).

On the CPU, cuML's search is replaced by a stand-in that computes what cuML 26.x computes:
float32 distances by the expanded formula |x|^2 + |y|^2 - 2 x.y, then the kk smallest. The
real cuML runs in the `cuda`-marked test.
"""

import pytest
import torch

import pcops
from pcops.ops.neighbours import nearest as knn_module
from pcops.ops.neighbours.nearest import _cuml
from tests import reference


def _expanded_float32_search(blocks, device):
    """cuML's brute-force arithmetic on each (query, ref, kk) block: float32, expanded formula."""
    out = []
    for q, p, kk in blocks:
        assert q.dtype == p.dtype == torch.float32 and q.is_contiguous() and p.is_contiguous()
        sq = (q * q).sum(1)[:, None] + (p * p).sum(1)[None, :] - 2 * q @ p.T
        out.append(sq.topk(kk, dim=1, largest=False).indices)
    return out


def _far_cloud(gen, m=300, n=500, offset=1e3):
    q = torch.rand(m, 3, generator=gen, dtype=torch.float64) + offset
    p = torch.rand(n, 3, generator=gen, dtype=torch.float64) + offset
    return q, p


def test_the_stand_in_alone_is_wrong_far_from_the_origin(gen):
    # what the backend did before: float32 expanded distances on the raw coordinates, k candidates
    q, p = _far_cloud(gen)
    (raw,) = _expanded_float32_search([(q.float(), p.float(), 8)], "cpu")
    _, expected = reference.knn(q, p, 8)
    assert not torch.equal(raw, expected)


@pytest.mark.parametrize("offset", [0.0, 1e3, -5e4])
def test_centred_candidates_reranked_exactly_match_the_reference(gen, offset):
    q, p = _far_cloud(gen, offset=offset)
    dists, idx = _cuml.knn(q, p, 8, None, None, _expanded_float32_search)
    ref_d, ref_idx = reference.knn(q, p, 8)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(dists, ref_d, rtol=1e-12, atol=1e-12)


def test_ties_go_to_the_smaller_index(gen):
    base = torch.rand(40, 3, generator=gen, dtype=torch.float64) + 1e3
    p = base.repeat(3, 1)  # every point three times: exact ties
    q = base[:10]
    _, idx = _cuml.knn(q, p, 5, None, None, _expanded_float32_search)
    _, ref_idx = reference.knn(q, p, 5)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(idx[:, :3], torch.arange(10)[:, None] + torch.tensor([0, 40, 80]))


def test_rerank_orders_by_exact_distance_then_index():
    query = torch.zeros(1, 3, dtype=torch.float64)
    ref = torch.tensor([[3.0, 0, 0], [1.0, 0, 0], [0, 1.0, 0], [2.0, 0, 0]], dtype=torch.float64)
    cand = torch.tensor([[3, 2, 0, 1]])  # in cuML's (wrong) order
    d, i = _cuml.rerank(query, ref, cand, 3)
    assert i.tolist() == [[1, 2, 3]] and d.tolist() == [[1.0, 1.0, 2.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rerank_of_lattice_points_ties_equal_roots_as_the_warp_search(dtype):
    """On a lattice many squares lie an ulp apart with one root: the re-ranking ranks by the
    roots (ties by index), so every candidate given, it returns the Warp search's neighbours and
    distances."""
    gen = torch.Generator().manual_seed(5)
    p = ((torch.rand(240, 3, generator=gen, dtype=torch.float64) * 5).round() / 5).to(dtype)
    q = ((torch.rand(180, 3, generator=gen, dtype=torch.float64) * 5).round() / 5).to(dtype)
    cand = torch.randperm(240, generator=gen).repeat(180, 1)  # every point, in no order
    d, i = _cuml.rerank(q, p, cand, 39)
    want = pcops.knn(q, p, 39, backend="warp")
    assert torch.equal(i, want.idx) and torch.equal(d, want.dists)


def test_groups_are_searched_separately_with_one_sort(gen):
    q, p = _far_cloud(gen, m=200, n=300)
    qg = torch.randint(0, 5, (200,), generator=gen, dtype=torch.int32)
    rg = torch.randint(0, 5, (300,), generator=gen, dtype=torch.int32)
    rg[rg == 3] = 4  # sample 3 has queries but no reference points: -1 / inf
    rg[:3] = 7  # sample 7 has reference points only
    seen = []

    def search(blocks, device):
        seen.append(len(blocks))
        return _expanded_float32_search(blocks, device)

    dists, idx = _cuml.knn(q, p, 6, qg, rg, search)
    assert seen == [4]  # one call for the samples present on both sides (0, 1, 2, 4)
    for g in range(5):
        rows, cols = (qg == g).nonzero().flatten(), (rg == g).nonzero().flatten()
        if g == 3:
            assert (idx[rows] == -1).all() and torch.isinf(dists[rows]).all()
            continue
        ref_d, ref_i = reference.knn(q[rows], p[cols], 6)
        assert torch.equal(idx[rows], cols[ref_i])
        torch.testing.assert_close(dists[rows], ref_d, rtol=1e-12, atol=1e-12)


def test_a_small_sample_fills_what_it_has(gen):
    q = torch.rand(4, 3, generator=gen, dtype=torch.float64)
    p = torch.rand(5, 3, generator=gen, dtype=torch.float64)
    qg, rg = torch.tensor([0, 0, 1, 1], dtype=torch.int32), torch.tensor([0, 1, 1, 1, 1], dtype=torch.int32)
    dists, idx = _cuml.knn(q, p, 3, qg, rg, _expanded_float32_search)
    assert (idx[:2, 0] == 0).all() and (idx[:2, 1:] == -1).all() and torch.isinf(dists[:2, 1:]).all()
    assert set(idx[2].tolist()) <= {1, 2, 3, 4} and (idx[2:] >= 1).all()


@pytest.mark.cuda
@pytest.mark.parametrize("grouped", [False, True])
def test_cuml_is_exact_on_a_cloud_centred_at_1e3(gen, grouped):
    if not knn_module.BACKENDS["cuml"].available():
        pytest.skip(f"cuml is not installed: {knn_module.BACKENDS['cuml'].install}")
    q = torch.rand(2000, 3, generator=gen, dtype=torch.float64) + 1e3
    p = torch.rand(3000, 3, generator=gen, dtype=torch.float64) + 1e3
    batch = dict(query_batch=torch.arange(2000) % 3, ref_batch=torch.arange(3000) % 3) if grouped else {}
    expected = pcops.knn(q, p, 8, backend="torch", **batch)
    got = pcops.knn(q.cuda(), p.cuda(), 8, backend="cuml", **{k: v.cuda() for k, v in batch.items()})
    assert torch.equal(got.idx.cpu(), expected.idx)
    torch.testing.assert_close(got.dists.cpu(), expected.dists, rtol=1e-12, atol=1e-12)


def test_each_device_searches_in_a_thread_of_its_own(monkeypatch):
    # cuML's handle is per thread and keeps the first device it saw: one worker thread per device
    import threading
    import types

    synced, calls = [], []
    monkeypatch.setattr(_cuml, "_workers", {})
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device: types.SimpleNamespace(synchronize=lambda: synced.append(device))
    )
    monkeypatch.setattr(
        _cuml, "_search_blocks", lambda blocks, index, stream: calls.append((index, threading.get_ident())) or ["x"]
    )
    for index in (0, 1, 0, 1, 1):
        assert _cuml._cuml_candidates([None], torch.device("cuda", index)) == ["x"]
    threads = {}
    for index, ident in calls:
        threads.setdefault(index, set()).add(ident)
    assert len(threads[0]) == len(threads[1]) == 1 and threads[0] != threads[1]
    assert threading.get_ident() not in threads[0] | threads[1]
    assert len(synced) == 5  # torch's stream is synchronised before every search


@pytest.mark.cuda
def test_cuml_on_two_devices_from_one_thread(gen):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    if not knn_module.BACKENDS["cuml"].available():
        pytest.skip(f"cuml is not installed: {knn_module.BACKENDS['cuml'].install}")
    q, p = torch.rand(500, 3, generator=gen), torch.rand(800, 3, generator=gen)
    expected = pcops.knn(q, p, 6, backend="torch").idx
    for device in ("cuda:0", "cuda:1", "cuda:0", "cuda:1"):
        got = pcops.knn(q.to(device), p.to(device), 6, backend="cuml")
        assert got.idx.device == torch.device(device)
        assert torch.equal(got.idx.cpu(), expected)


def test_the_cuml_call_with_stand_ins_for_cupy_and_cuml(monkeypatch, gen):
    # the calls into CuPy and cuML as cuML 26.10 / CuPy 14 spell them, on the CPU
    import contextlib
    import sys
    import types

    seen = {}

    class NearestNeighbors:
        def __init__(self, n_neighbors, algorithm, metric, output_type):
            seen["params"] = (n_neighbors, algorithm, metric, output_type)

        def fit(self, x):
            self.x = x
            return self

        def kneighbors(self, q, return_distance=True):
            (idx,) = _expanded_float32_search([(q, self.x, seen["params"][0])], "cpu")
            return torch.zeros(idx.shape), idx

    def recorded(key):
        def enter(value):
            seen[key] = value
            return contextlib.nullcontext()

        return enter

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=recorded("device"), Stream=types.SimpleNamespace(from_external=recorded("stream")))
    cupy.from_dlpack = lambda t: t
    cupy.ascontiguousarray = lambda a: a.contiguous()
    cuml = types.ModuleType("cuml")
    neighbors = types.ModuleType("cuml.neighbors")
    neighbors.NearestNeighbors = NearestNeighbors
    for name, module in [("cupy", cupy), ("cuml", cuml), ("cuml.neighbors", neighbors)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(_cuml.memory, "default_cuml_resource", lambda index: seen.setdefault("resource", index))
    q = torch.rand(50, 3, generator=gen, dtype=torch.float64) + 1e3
    p = torch.rand(70, 3, generator=gen, dtype=torch.float64) + 1e3
    stream = object()
    blocks = [((q - 1e3).float(), (p - 1e3).float(), 12)]
    (cand,) = _cuml._search_blocks(blocks, 1, stream)
    assert seen == {"params": (12, "brute", "euclidean", "cupy"), "device": 1, "stream": stream, "resource": 1}
    assert cand.dtype == torch.int64 and cand.shape == (50, 12)
    _, idx = _cuml.rerank(q, p, cand, 4)
    assert torch.equal(idx, reference.knn(q, p, 4)[1])
