"""pcops.compat.torch_cluster against float64 brute-force references written from torch_cluster's
documented semantics and source (1.6.3; ``ignore_same_index`` from its current source)."""

import math

import numpy as np
import pytest
import torch

from pcops.compat import torch_cluster as tc


# ----------------------------------------------------------------------------------------------
# references (float64 loops, no pcops)


def _examples(n, batch):
    return torch.zeros(n, dtype=torch.long) if batch is None else batch


def ref_knn(x, y, k, bx=None, by=None, cosine=False):
    """(2, E): row 0 y index, row 1 x index; per y by (distance, index)."""
    x, y = x.double().view(x.shape[0], -1), y.double().view(y.shape[0], -1)
    bx, by = _examples(x.shape[0], bx), _examples(y.shape[0], by)
    rows, cols = [], []
    for i in range(y.shape[0]):
        cand = [j for j in range(x.shape[0]) if bx[j] == by[i]]
        if cosine:
            key = [(1 - float(x[j] @ y[i]) / (float(x[j].norm()) * float(y[i].norm())), j) for j in cand]
        else:
            key = [(float(((x[j] - y[i]) ** 2).sum()), j) for j in cand]
        for _, j in sorted(key)[:k]:
            rows.append(i)
            cols.append(j)
    return torch.tensor([rows, cols], dtype=torch.long).view(2, -1)


def ref_radius(x, y, r, bx=None, by=None, cap=32, ignore_same_index=False):
    """(2, E): per y (ascending) the first ``cap`` x (ascending index) with d^2 < r^2."""
    x, y = x.double(), y.double()
    bx, by = _examples(x.shape[0], bx), _examples(y.shape[0], by)
    rows, cols = [], []
    for i in range(y.shape[0]):
        found = 0
        for j in range(x.shape[0]):
            if found == cap:
                break
            if bx[j] != by[i] or (ignore_same_index and i == j):
                continue
            if float(((x[j] - y[i]) ** 2).sum()) < r * r:
                rows.append(i)
                cols.append(j)
                found += 1
    return torch.tensor([rows, cols], dtype=torch.long).view(2, -1)


def ref_fps(src, batch=None, ratio=0.5, starts=None):
    """torch_cluster's CPU loop in float64: picks ceil(float32(n) * float32(ratio)), argmax first max."""
    src = src.double().view(src.shape[0], -1)
    batch = _examples(src.shape[0], batch)
    out = []
    for e, b in enumerate(sorted(set(batch.tolist()))):
        rows = (batch == b).nonzero()[:, 0]
        pts = src[rows]
        count = math.ceil(float(np.float32(len(rows)) * np.float32(ratio)))
        pick = 0 if starts is None else starts[e]
        dist = ((pts - pts[pick]) ** 2).sum(1)
        picks = [pick]
        for _ in range(1, count):
            pick = int(torch.argmax(dist))
            picks.append(pick)
            dist = torch.minimum(dist, ((pts - pts[pick]) ** 2).sum(1))
        out += rows[picks].tolist()
    return torch.tensor(out, dtype=torch.long)


def ref_grid(pos, size, start=None, end=None):
    pos = pos.double().view(pos.shape[0], -1)
    start = pos.min(0).values if start is None else start.double()
    end = pos.max(0).values if end is None else end.double()
    out = []
    for p in pos:
        c, stride = 0, 1
        for d in range(pos.shape[1]):
            c += math.trunc((float(p[d]) - float(start[d])) / float(size[d])) * stride
            stride *= math.trunc((float(end[d]) - float(start[d])) / float(size[d])) + 1
        out.append(c)
    return torch.tensor(out, dtype=torch.long)


def _cloud(gen, n, d=3):
    return torch.rand(n, d, generator=gen)


def _sorted_batch(gen, n, b):
    return torch.randint(0, b, (n,), generator=gen).sort().values


# ----------------------------------------------------------------------------------------------
# knn


def test_knn_rows_index_y_then_x_by_distance(gen):
    x, y = _cloud(gen, 200), _cloud(gen, 40)
    out = tc.knn(x, y, 6)
    assert out.dtype == torch.long and out.shape == (2, 240)
    assert torch.equal(out, ref_knn(x, y, 6))


def test_knn_batches_sorted_and_unsorted(gen):
    x, y = _cloud(gen, 300), _cloud(gen, 60)
    bx, by = _sorted_batch(gen, 300, 3), _sorted_batch(gen, 60, 3)
    assert torch.equal(tc.knn(x, y, 5, bx, by), ref_knn(x, y, 5, bx, by))
    px, py = torch.randperm(300, generator=gen), torch.randperm(60, generator=gen)
    shuffled = tc.knn(x[px], y[py], 5, bx[px], by[py])  # torch_cluster needs sorted ids; pcops does not
    assert torch.equal(shuffled, ref_knn(x[px], y[py], 5, bx[px], by[py]))


def test_knn_k_larger_than_an_example_gives_all_of_it(gen):
    x, y = _cloud(gen, 7), _cloud(gen, 5)
    bx, by = torch.tensor([0, 0, 1, 1, 1, 1, 1]), torch.tensor([0, 0, 1, 1, 2])  # example 2 has no x
    out = tc.knn(x, y, 4, bx, by)
    assert torch.equal(out, ref_knn(x, y, 4, bx, by))
    assert out.shape[1] == 2 * 2 + 2 * 4
    assert torch.equal(tc.knn(x, y, 50), ref_knn(x, y, 50))  # k > N without batches


def test_knn_ties_go_to_the_smaller_index():
    x = torch.tensor([[1.0, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1]])
    out = tc.knn(x, torch.zeros(1, 3), 3)
    assert out[1].tolist() == [0, 1, 2]


def test_knn_any_feature_dimension_and_1d_input(gen):
    for d in (1, 2, 5):
        x, y = _cloud(gen, 80, d), _cloud(gen, 20, d)
        assert torch.equal(tc.knn(x, y, 3), ref_knn(x, y, 3)), d
    x, y = torch.rand(30, generator=gen), torch.rand(6, generator=gen)
    assert torch.equal(tc.knn(x, y, 2), ref_knn(x, y, 2))


def test_knn_cosine_ranks_by_one_minus_cosine(gen):
    x, y = torch.randn(100, 8, generator=gen), torch.randn(10, 8, generator=gen)
    assert torch.equal(tc.knn(x, y, 4, cosine=True), ref_knn(x, y, 4, cosine=True))


def test_knn_empty_inputs_give_no_edges():
    for x, y in ((torch.rand(0, 3), torch.rand(4, 3)), (torch.rand(4, 3), torch.rand(0, 3))):
        out = tc.knn(x, y, 2)
        assert out.shape == (2, 0) and out.dtype == torch.long


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_knn_accepts_other_float_dtypes(gen, dtype):
    x, y = _cloud(gen, 100).to(dtype), _cloud(gen, 10).to(dtype)
    out = tc.knn(x, y, 3)
    assert out.dtype == torch.long
    assert torch.equal(out, ref_knn(x.float(), y.float(), 3))


def test_knn_errors(gen):
    x = _cloud(gen, 10)
    with pytest.raises(ValueError, match="batch_y"):
        tc.knn(x, x, 2, batch_x=torch.tensor([0] * 5 + [1] * 5))
    with pytest.raises(ValueError, match="k"):
        tc.knn(x, x, 0)
    with pytest.raises(ValueError, match="same number of features"):
        tc.knn(x, _cloud(gen, 4, 2), 1)
    with pytest.raises(TypeError, match="x"):
        tc.knn(x.numpy(), x, 1)


# ----------------------------------------------------------------------------------------------
# knn_graph


def ref_knn_graph(x, k, batch=None, loop=False, flow="source_to_target"):
    e = ref_knn(x, x, k if loop else k + 1, batch, batch)
    row, col = (e[1], e[0]) if flow == "source_to_target" else (e[0], e[1])
    if not loop:
        keep = row != col
        row, col = row[keep], col[keep]
    return torch.stack([row, col])


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
def test_knn_graph_loop_and_flow(gen, loop, flow):
    x = _cloud(gen, 120)
    batch = _sorted_batch(gen, 120, 3)
    assert torch.equal(tc.knn_graph(x, 5, batch, loop=loop, flow=flow), ref_knn_graph(x, 5, batch, loop, flow))


def test_knn_graph_in_feature_space_as_dgcnn_uses_it(gen):
    features = torch.randn(150, 16, generator=gen)
    batch = _sorted_batch(gen, 150, 3)
    assert torch.equal(tc.knn_graph(features, 8, batch), ref_knn_graph(features, 8, batch))


def test_knn_graph_duplicates_keep_torch_clusters_k_plus_one_rule():
    # three copies of one point: point 2's k + 1 = 2 nearest are 0 and 1 (ties by index), so
    # dropping itself removes nothing and it keeps 2 neighbours (torch_cluster does the same)
    x = torch.tensor([[0.0, 0, 0], [0, 0, 0], [0, 0, 0], [5, 5, 5]])
    out = tc.knn_graph(x, 1)
    assert torch.equal(out, ref_knn_graph(x, 1))
    assert (out[1] == 2).sum() == 2


def test_knn_graph_rejects_unknown_flow(gen):
    with pytest.raises(ValueError, match="flow"):
        tc.knn_graph(_cloud(gen, 5), 2, flow="both")


# ----------------------------------------------------------------------------------------------
# radius / radius_graph


def test_radius_rows_index_y_then_x_in_index_order(gen):
    x, y = _cloud(gen, 400), _cloud(gen, 50)
    out = tc.radius(x, y, 0.2, max_num_neighbors=1000)
    assert torch.equal(out, ref_radius(x, y, 0.2, cap=1000))


def test_radius_cap_keeps_the_first_by_index_not_the_closest(gen):
    x = torch.rand(500, 3, generator=gen) * 0.1  # all within 0.2 of the query
    y = torch.full((1, 3), 0.05)
    out = tc.radius(x, y, 0.2, max_num_neighbors=32)
    assert out[1].tolist() == list(range(32))
    x, y = _cloud(gen, 600), _cloud(gen, 80)
    bx, by = _sorted_batch(gen, 600, 2), _sorted_batch(gen, 80, 2)
    assert torch.equal(tc.radius(x, y, 0.3, bx, by, max_num_neighbors=8), ref_radius(x, y, 0.3, bx, by, cap=8))


def test_radius_is_strict_at_the_boundary():
    x = torch.tensor([[0.5, 0.0, 0.0], [0.25, 0.0, 0.0]], dtype=torch.float64)
    y = torch.zeros(1, 3, dtype=torch.float64)
    assert tc.radius(x, y, 0.5)[1].tolist() == [1]  # d = r exactly: not a neighbour
    assert tc.radius(x, y, 0.5000001)[1].tolist() == [0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ignore_same_index", [False, True])
def test_radius_cap_on_a_lattice_with_points_exactly_at_r(gen, dtype, ignore_same_index):
    # integer points (exact squares): many at d = r exactly, which the search's margin finds
    # and the strict test drops; with a small cap some queries lose kept points to it and
    # must be searched again for the ones after them
    x = torch.randint(0, 5, (300, 3), generator=gen).to(dtype)
    bx = torch.arange(300) // 150
    for r, cap in ((1.0, 2), (2.0, 5), (3.0, 40)):
        out = tc.radius(x, x, r, bx, bx, max_num_neighbors=cap, ignore_same_index=ignore_same_index)
        assert torch.equal(out, ref_radius(x, x, r, bx, bx, cap=cap, ignore_same_index=ignore_same_index))


def test_radius_ignore_same_index_skips_before_the_cap(gen):
    x = torch.rand(50, 3, generator=gen) * 0.05
    out = tc.radius(x, x, 0.2, max_num_neighbors=4, ignore_same_index=True)
    assert torch.equal(out, ref_radius(x, x, 0.2, cap=4, ignore_same_index=True))
    assert bool((out[0] != out[1]).all()) and out.shape[1] == 50 * 4


def test_radius_2d_points_and_empty_inputs(gen):
    x, y = _cloud(gen, 200, 2), _cloud(gen, 30, 2)
    assert torch.equal(tc.radius(x, y, 0.15), ref_radius(x, y, 0.15))
    assert tc.radius(torch.rand(0, 3), y[:, :1].repeat(1, 3), 0.1).shape == (2, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_radius_half_precision_searches_in_float32(gen, dtype):
    x, y = _cloud(gen, 200).to(dtype), _cloud(gen, 20).to(dtype)
    out = tc.radius(x, y, 0.25)
    assert torch.equal(out, ref_radius(x.float(), y.float(), 0.25))


def test_radius_errors(gen):
    x = _cloud(gen, 10)
    with pytest.raises(ValueError, match="r must be finite and > 0"):
        tc.radius(x, x, 0.0)
    with pytest.raises(ValueError, match="max_num_neighbors"):
        tc.radius(x, x, 0.1, max_num_neighbors=0)
    with pytest.raises(ValueError, match="at most 3"):
        tc.radius(_cloud(gen, 5, 4), _cloud(gen, 5, 4), 0.1)


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
def test_radius_graph_loop_flow_and_cap(gen, loop, flow):
    x = _cloud(gen, 300)
    batch = _sorted_batch(gen, 300, 2)
    e = ref_radius(x, x, 0.25, batch, batch, cap=10, ignore_same_index=not loop)
    expected = torch.stack([e[1], e[0]]) if flow == "source_to_target" else e
    assert torch.equal(tc.radius_graph(x, 0.25, batch, loop=loop, max_num_neighbors=10, flow=flow), expected)


def test_radius_graph_cap_counts_neighbours_other_than_itself():
    x = torch.zeros(6, 3)  # six copies: each point keeps max_num_neighbors others
    out = tc.radius_graph(x, 0.1, max_num_neighbors=3)
    assert torch.bincount(out[1]).tolist() == [3] * 6
    assert out[:, :3].tolist() == [[1, 2, 3], [0, 0, 0]]


# ----------------------------------------------------------------------------------------------
# fps


def test_fps_matches_the_loop_from_the_first_point(gen):
    src = _cloud(gen, 300)
    batch = _sorted_batch(gen, 300, 3)
    out = tc.fps(src, batch, ratio=0.25, random_start=False)
    assert out.dtype == torch.long
    assert torch.equal(out, ref_fps(src, batch, 0.25))


def test_fps_counts_are_computed_in_float32_as_torch_cluster():
    src = torch.rand(50, 3)
    assert tc.fps(src, ratio=0.3, random_start=False).numel() == 16  # float64 would say 15
    batch = torch.tensor([0] * 50 + [1] * 10)
    out = tc.fps(torch.rand(60, 3), batch, ratio=0.3, random_start=False)
    assert out.numel() == 16 + 3


def test_fps_default_ratio_is_one_half_and_ptr_equals_batch(gen):
    src = _cloud(gen, 100)
    batch = torch.tensor([0] * 40 + [1] * 60)
    by_batch = tc.fps(src, batch, random_start=False)
    assert by_batch.numel() == 50
    assert torch.equal(tc.fps(src, ptr=[0, 40, 100], random_start=False), by_batch)
    assert torch.equal(tc.fps(src, ptr=torch.tensor([0, 40, 100]), random_start=False), by_batch)


def test_fps_per_example_ratio_tensor(gen):
    src = _cloud(gen, 100)
    batch = torch.tensor([0] * 40 + [1] * 60)
    out = tc.fps(src, batch, ratio=torch.tensor([0.1, 0.5]), random_start=False)
    assert torch.equal(out, torch.cat([ref_fps(src[:40], None, 0.1), 40 + ref_fps(src[40:], None, 0.5)]))


def test_fps_random_start_follows_torchs_global_rng(gen):
    src = _cloud(gen, 200)
    batch = _sorted_batch(gen, 200, 2)
    torch.manual_seed(3)
    a = tc.fps(src, batch, 0.1)
    torch.manual_seed(3)
    b = tc.fps(src, batch, 0.1)
    assert torch.equal(a, b)
    firsts = set()
    for seed in range(6):
        torch.manual_seed(seed)
        firsts.add(int(tc.fps(src, ratio=0.1)[0]))
    assert len(firsts) > 1
    # from its start, the run is the deterministic loop's
    sizes = torch.bincount(batch)
    starts = [int(a[0]), int(a[int(math.ceil(float(np.float32(sizes[0]) * np.float32(0.1))))] - sizes[0])]
    assert torch.equal(a, ref_fps(src, batch, 0.1, starts))


def test_fps_ties_go_to_the_smaller_index_and_2d_points():
    square = torch.tensor([[0.0, 0], [1, 0], [0, 1], [1, 1]])
    assert tc.fps(square, ratio=1.0, random_start=False).tolist() == [0, 3, 1, 2]


def test_fps_errors(gen):
    with pytest.raises(ValueError, match="ratio"):
        tc.fps(_cloud(gen, 10), ratio=1.5)
    with pytest.raises(ValueError, match="at most 3"):
        tc.fps(_cloud(gen, 10, 4))


def test_a_batch_size_that_counts_fewer_examples_than_the_batch_vectors_is_an_error(gen):
    """torch_cluster reads ``batch_size`` as the number of examples: 1 searches every point as one
    example whatever the batch vectors say, and fewer than their ids leave the later examples
    out; pcops reads the examples from the vectors, so such a count is a ValueError naming it,
    and a count that covers them (or more, trailing examples empty) gives the same edges as none."""
    x, y = _cloud(gen, 60), _cloud(gen, 20)
    bx, by = _sorted_batch(gen, 60, 3), _sorted_batch(gen, 20, 3)
    top = int(max(bx.max(), by.max()))
    calls = {
        "knn": lambda size: tc.knn(x, y, 4, bx, by, batch_size=size),
        "knn_graph": lambda size: tc.knn_graph(x, 4, bx, batch_size=size),
        "radius": lambda size: tc.radius(x, y, 0.5, bx, by, batch_size=size),
        "radius_graph": lambda size: tc.radius_graph(x, 0.5, bx, batch_size=size),
        "fps": lambda size: tc.fps(x, bx, 0.5, random_start=False, batch_size=size),
    }
    for name, call in calls.items():
        for size in (1, top):
            with pytest.raises(ValueError, match="batch_size"):
                call(size)
        for size in (top + 1, top + 3):
            assert torch.equal(call(size), call(None)), name
        for bad, error in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(error, match="batch_size"):
                call(bad)
    one = torch.zeros(60, dtype=torch.long)  # every id 0: one example, as batch_size=1 says
    assert torch.equal(tc.knn_graph(x, 4, one, batch_size=1), tc.knn_graph(x, 4))
    # as in torch_cluster: fps reads the examples from ptr alone, and empty inputs give no edges first
    ptr = [0, 20, 60]
    assert torch.equal(tc.fps(x, ratio=0.5, random_start=False, ptr=ptr, batch_size=1), tc.fps(x, ratio=0.5, random_start=False, ptr=ptr))
    assert tc.knn(x[:0], y, 4, bx[:0], by, batch_size=1).shape == (2, 0)
    assert tc.radius(x, y[:0], 0.5, bx, by[:0], batch_size=1).shape == (2, 0)


# ----------------------------------------------------------------------------------------------
# nearest / grid_cluster


def test_nearest_matches_brute_force(gen):
    x, y = _cloud(gen, 200), _cloud(gen, 30)
    bx, by = _sorted_batch(gen, 200, 3), torch.arange(3).repeat_interleave(10)
    out = tc.nearest(x, y, bx, by)
    assert torch.equal(out, ref_knn(y, x, 1, by, bx)[1])
    assert torch.equal(tc.nearest(x, y), ref_knn(y, x, 1)[1])


def test_nearest_errors_as_torch_cluster(gen):
    x, y = _cloud(gen, 4), _cloud(gen, 2)
    with pytest.raises(ValueError, match="not sorted"):
        tc.nearest(x, y, torch.tensor([1, 0, 0, 0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="do not occur"):
        tc.nearest(x, y, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0]))


def test_grid_cluster_matches_the_formula(gen):
    pos = torch.rand(100, 3, generator=gen) * 10
    size = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(tc.grid_cluster(pos, size), ref_grid(pos, size))
    start, end = torch.tensor([-1.0, 0.0, 2.0]), torch.tensor([12.0, 10.0, 11.0])
    assert torch.equal(tc.grid_cluster(pos, size, start, end), ref_grid(pos, size, start, end))
    pos2 = torch.tensor([[0.0, 0], [11, 9], [2, 8], [2, 2], [8, 3]])  # torch_cluster's docstring example
    assert tc.grid_cluster(pos2, torch.tensor([5.0, 5.0])).tolist() == [0, 5, 3, 0, 1]
    for bad in ([0.0, 5.0], [-5.0, 5.0], [5.0, -0.0]):  # (0 gave ids of INT64_MIN, -5 negative ones)
        with pytest.raises(ValueError, match="size must be > 0"):
            tc.grid_cluster(pos2, torch.tensor(bad))


# ----------------------------------------------------------------------------------------------
# torch.compile


def _compiles(fn, *args):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    assert not counters["graph_break"]
    return out


def test_knn_graph_and_radius_compile_without_graph_breaks(gen):
    x = _cloud(gen, 200)
    batch = _sorted_batch(gen, 200, 2)

    def f(x, batch):
        a = tc.knn_graph(x, 6, batch)
        b = tc.radius(x, x[:50], 0.2, batch, batch[:50], max_num_neighbors=8)
        return a, b

    a, b = _compiles(f, x, batch)
    ea, eb = f(x, batch)
    assert torch.equal(a, ea) and torch.equal(b, eb)


def test_fps_compiles_without_graph_breaks(gen):
    src = _cloud(gen, 200)
    batch = _sorted_batch(gen, 200, 2)
    out = _compiles(lambda s, b: tc.fps(s, b, 0.3, random_start=False), src, batch)
    assert torch.equal(out, ref_fps(src, batch, 0.3))


def test_first_within_op_passes_opcheck(gen):
    q, p = _cloud(gen, 40), _cloud(gen, 120)
    qg, pg = _sorted_batch(gen, 40, 2), _sorted_batch(gen, 120, 2)
    for args in ((q, p, None, None, 0.3, 0.09, 5, False), (q, p, qg, pg, 0.3, 0.09, 8, True)):
        torch.library.opcheck(torch.ops.pcops_compat.first_within.default, args)


@pytest.mark.cuda
def test_cuda_results_equal_cpu_results(gen):
    x, y = _cloud(gen, 500), _cloud(gen, 100)
    bx, by = _sorted_batch(gen, 500, 3), _sorted_batch(gen, 100, 3)
    cuda = [t.cuda() for t in (x, y, bx, by)]
    assert torch.equal(tc.knn(*cuda[:2], 6, *cuda[2:]).cpu(), tc.knn(x, y, 6, bx, by))
    assert torch.equal(tc.radius(*cuda[:2], 0.2, *cuda[2:], max_num_neighbors=8).cpu(), tc.radius(x, y, 0.2, bx, by, max_num_neighbors=8))
    assert torch.equal(tc.knn_graph(cuda[0], 5, cuda[2]).cpu(), tc.knn_graph(x, 5, bx))
    assert torch.equal(tc.fps(cuda[0], cuda[2], 0.3, random_start=False).cpu(), tc.fps(x, bx, 0.3, random_start=False))
