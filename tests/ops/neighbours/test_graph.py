"""pcops.knn_graph and pcops.radius_graph against a dense float64 reference (the shared op suite)."""

import pytest
import torch

import pcops
from tests import reference
from tests.op_suite import F64, TOL, OpSuite, pack

K = 5


def assert_edges(edges, expected, dtype, points):
    """Exact in float64; otherwise the same centres in the same order and each edge's length
    within TOL[dtype] of the reference edge in its place (rounding may reorder near-ties)."""
    assert edges.dtype == torch.int64 and edges.shape == expected.shape
    if dtype == F64:
        assert torch.equal(edges, expected)
        return
    assert torch.equal(edges[1], expected[1])
    p = points.double()
    length = lambda e: (p[e[0]] - p[e[1]]).norm(dim=1)  # noqa: E731
    torch.testing.assert_close(length(edges), length(expected), **TOL[dtype])


class _GraphSuite(OpSuite):
    """Shared hooks of the two graph ops (no gradients: edges are indices)."""

    loop = False

    def compare(self, out, expected, dtype, inputs=None):
        if inputs is None:
            assert torch.equal(out[0], expected[0])
        else:
            assert_edges(out[0], expected[0], dtype, inputs["points"])

    def inputs(self, kind, gen):
        _, p, r = reference.cloud(kind, gen)
        return dict(points=p, radius=reference.safe_radius(p, p, r, gap=1e-3))

    def compile_calls(self, gen):
        def fn(points, batch):
            edges = self.graph(points, batch=batch)
            messages = (points[edges[0]] - points[edges[1]]).square().sum(1, keepdim=True)
            return edges, points.new_zeros((points.shape[0], 1)).index_add(0, edges[1], messages)

        calls = []
        for n in (30, 47):
            calls.append((torch.rand(n, 3, generator=gen).requires_grad_(), torch.randint(0, 3, (n,), generator=gen)))
        return fn, calls

    def batched(self, gen):
        sizes = [14, 0, 5, 3, 1]
        samples = [torch.rand(n, 3, generator=gen, dtype=F64) for n in sizes]
        expected = [(self.reference_graph(p, None),) for p in samples]
        results = []
        for shuffle in (False, True):
            if shuffle:
                points, ids, position = pack(samples, gen)
            else:
                points = torch.cat(samples)
                ids = torch.cat([torch.full((n,), b) for b, n in enumerate(sizes)])
                position = torch.arange(points.shape[0])
            edges = self.graph(points, batch=ids)
            local = torch.empty_like(position)  # packed row -> row within its sample
            offsets = torch.tensor([0, *sizes]).cumsum(0)
            local[position] = torch.arange(position.numel()) - offsets[ids[position]]
            per_sample = []
            for b in range(len(sizes)):
                e = local[edges[:, ids[edges[1]] == b]]
                e = e[:, torch.argsort(e[1], stable=True)]  # centres in sample order, neighbours kept in order
                per_sample.append((e,))
            results.append(per_sample)
        return expected, results[0], results[1]


class TestKnnGraph(_GraphSuite):
    def graph(self, points, batch=None):
        return pcops.knn_graph(points, K, batch=batch, loop=self.loop)

    def reference_graph(self, points, batch):
        return reference.graph(points, batch, loop=self.loop, k=K)

    def run(self, points, radius):
        return (self.graph(points),)

    def reference(self, points, radius):
        return (self.reference_graph(points, None),)

    def opcheck_cases(self, gen):
        idx = torch.randint(-1, 20, (20, 4), generator=gen)
        return [(torch.ops.pcops.edges.default, (idx, idx >= 3))]

    def bad_inputs(self, gen):
        p = torch.rand(10, 3, generator=gen)
        return {
            "zero k": (lambda: pcops.knn_graph(p, 0), ValueError, "k must be >= 1"),
            "float k": (lambda: pcops.knn_graph(p, 2.0), TypeError, "k must be an int"),
            "padded points": (lambda: pcops.knn_graph(p[None], 2), ValueError, "points must be a tensor of shape"),
            "int points": (lambda: pcops.knn_graph(p.long(), 2), TypeError, "points must have a floating dtype"),
            "batch shape": (lambda: pcops.knn_graph(p, 2, batch=torch.zeros(9, dtype=torch.long)), ValueError, "batch must be a tensor of shape"),
            "negative batch": (lambda: pcops.knn_graph(p, 2, batch=-torch.ones(10, dtype=torch.long)), ValueError, "batch values"),
            "loop not bool": (lambda: pcops.knn_graph(p, 2, loop=1), TypeError, "loop must be a bool"),
        }


class TestKnnGraphWithLoops(TestKnnGraph):
    loop = True


class TestRadiusGraph(_GraphSuite):
    max_neighbors = None

    def graph(self, points, batch=None, radius=0.35):
        return pcops.radius_graph(points, radius, batch=batch, loop=self.loop, max_neighbors=self.max_neighbors)

    def reference_graph(self, points, batch, radius=0.35):
        return reference.graph(points, batch, loop=self.loop, radius=radius, max_neighbors=self.max_neighbors)

    def run(self, points, radius):
        return (self.graph(points, radius=radius),)

    def reference(self, points, radius):
        return (self.reference_graph(points, None, radius),)

    def opcheck_cases(self, gen):
        p = torch.rand(30, 3, generator=gen)
        group = torch.randint(0, 3, (30,), generator=gen, dtype=torch.int32)
        op = torch.ops.pcops.radius_graph.default
        return [(op, (p, 0.3, 0, False, True, None)), (op, (p.double(), 0.3, 4, True, True, group))]

    def bad_inputs(self, gen):
        p = torch.rand(10, 3, generator=gen)
        nan = p.clone()
        nan[0, 0] = float("nan")
        return {
            "zero radius": (lambda: pcops.radius_graph(p, 0.0), ValueError, "radius must be finite and > 0"),
            "zero max_neighbors": (lambda: pcops.radius_graph(p, 0.2, max_neighbors=0), ValueError, "max_neighbors must be >= 1"),
            "float max_neighbors": (lambda: pcops.radius_graph(p, 0.2, max_neighbors=2.5), TypeError, "max_neighbors must be an int"),
            "batch dtype": (lambda: pcops.radius_graph(p, 0.2, batch=torch.zeros(10)), TypeError, "batch must have an integer dtype"),
            "NaN": (lambda: pcops.radius_graph(nan, 0.2), ValueError, "contains NaN"),
        }


class TestRadiusGraphCappedWithLoops(TestRadiusGraph):
    loop = True
    max_neighbors = 3


def test_knn_graph_matches_torch_cluster_convention():
    # on a line: each point's neighbour is the adjacent point, row 0 the neighbour, row 1 the centre
    p = torch.tensor([[0.0, 0, 0], [1.0, 0, 0], [3.0, 0, 0]], dtype=F64)
    assert pcops.knn_graph(p, 1).tolist() == [[1, 0, 1], [0, 1, 2]]


def test_radius_graph_keeps_every_neighbour_without_a_cap(gen):
    p = torch.rand(300, 3, generator=gen, dtype=F64) * 0.1  # all within the radius: 299 each, no cap of 32
    edges = pcops.radius_graph(p, 1.0)
    assert edges.shape == (2, 300 * 299)
    assert torch.equal(torch.bincount(edges[1]), torch.full((300,), 299))


@pytest.mark.parametrize("loop", [False, True])
def test_radius_graph_caps_past_the_cloud_allocate_no_wider_rows(gen, loop, monkeypatch):
    """A max_neighbors past the cloud's size (up to the int64 range) gives the float64 brute
    force's edges, the uncapped graph's, on the plain and general paths, with a batch and in the
    static-size form: the search's rows are no wider than the cloud (a cap of 2^31 on 40 points
    asked for 80 GB, 2^63 - 1 overflowed the row width)."""
    from pcops.ops.neighbours import graph

    p = torch.rand(40, 3, generator=gen, dtype=F64)
    want = reference.graph(p, loop=loop, radius=0.6)
    assert torch.equal(pcops.radius_graph(p, 0.6, loop=loop), want)
    batch = torch.zeros(40, dtype=torch.int64)
    for plain in (True, False):
        monkeypatch.setattr(graph, "PLAIN", [plain])
        for cap in (40, 2**31, 2**63 - 1):
            assert torch.equal(pcops.radius_graph(p, 0.6, max_neighbors=cap, loop=loop), want), (plain, cap)
            assert torch.equal(pcops.radius_graph(p, 0.6, max_neighbors=cap, loop=loop, batch=batch), want), (plain, cap)
            padded = pcops.radius_graph(p, 0.6, max_neighbors=cap, loop=loop, max_edges=2000)
            assert int(padded.count) == want.shape[1] and torch.equal(padded.edge_index[:, : want.shape[1]], want), (plain, cap)


@pytest.mark.parametrize("loop", [False, True])
def test_radius_graph_without_a_cap_sorts_long_runs_of_neighbours(gen, loop):
    """Dozens of neighbours a point, duplicates (ties at equal distances) and three samples: the
    count pass and the fill pass agree, and each centre's run is sorted by distance, then index."""
    p = torch.rand(200, 3, generator=gen, dtype=F64)
    p = torch.cat([p, p[:50]])
    batch = torch.randint(0, 3, (250,), generator=gen)
    edges = pcops.radius_graph(p, 0.5, batch=batch, loop=loop)
    assert torch.bincount(edges[1]).float().mean() > 20
    assert torch.equal(edges, reference.graph(p, batch, loop=loop, radius=0.5))



@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_radius_graph_leaves_out_points_with_a_non_finite_coordinate_without_validation(gen, value):
    p = torch.rand(30, 3, generator=gen, dtype=torch.float64)
    p[[0, 1, 2], [0, 1, 2]] = value  # one axis each
    edges = pcops.radius_graph(p, 2.0, validate=False)
    assert edges.shape[1] == 27 * 26 and not bool((edges < 3).any())

def test_duplicates_are_neighbours_but_never_self(gen):
    base = torch.rand(4, 3, generator=gen, dtype=F64)
    p = torch.cat([base, base, base])  # each point has two copies at distance 0
    edges = pcops.knn_graph(p, 2)
    assert torch.all(edges[0] != edges[1])
    assert torch.equal(edges, reference.graph(p, k=2))


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    p = torch.rand(2000, 3, generator=gen)
    batch = torch.randint(0, 4, (2000,), generator=gen)
    for fn in (lambda x, b: pcops.knn_graph(x, 8, batch=b), lambda x, b: pcops.radius_graph(x, 0.08, batch=b)):
        assert torch.equal(fn(p.cuda(), batch.cuda()).cpu(), fn(p, batch))


@pytest.mark.parametrize("name", ["knn_graph", "radius_graph"])
def test_the_static_size_form_pads_the_edges_and_counts_them(gen, name):
    points = torch.rand(200, 3, generator=gen, dtype=F64)
    batch = torch.randint(0, 3, (200,), generator=gen)
    call = (lambda **kw: pcops.knn_graph(points, K, batch=batch, **kw)) if name == "knn_graph" else \
        (lambda **kw: pcops.radius_graph(points, 0.2, batch=batch, **kw))
    edges = call()
    e = edges.shape[1]
    for size in (e, e + 17, e // 3):  # exact, padded, cut
        padded = call(max_edges=size)
        assert isinstance(padded, pcops.PaddedEdges) and padded.edge_index.shape == (2, size)
        assert padded.count.dtype == torch.int64 and padded.count.shape == () and int(padded.count) == e
        kept = min(size, e)
        assert torch.equal(padded.edge_index[:, :kept], edges[:, :kept])  # the first edges: the smallest centres'
        assert bool((padded.edge_index[:, kept:] == -1).all())


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-3, ValueError), (True, TypeError), (2.5, TypeError)])
def test_a_bad_bound_names_max_edges(gen, bad, error):
    points = torch.rand(20, 3, generator=gen)
    for call in (lambda: pcops.knn_graph(points, 3, max_edges=bad), lambda: pcops.radius_graph(points, 0.3, max_edges=bad)):
        with pytest.raises(error, match="max_edges"):
            call()


def test_the_static_size_forms_of_empty_clouds():
    empty = torch.zeros(0, 3)
    for padded in (pcops.knn_graph(empty, 3, max_edges=4), pcops.radius_graph(empty, 0.3, max_edges=4)):
        assert padded.edge_index.shape == (2, 4) and bool((padded.edge_index == -1).all()) and int(padded.count) == 0


def test_opcheck_of_the_static_size_ops(gen):
    points = torch.rand(60, 3, generator=gen, dtype=F64)
    group = (torch.arange(60) % 2).to(torch.int32)
    idx = torch.randint(-1, 60, (60, 4), generator=gen)
    for size in (1, 200):
        torch.library.opcheck(torch.ops.pcops.edges_padded.default, (idx, idx >= 0, size))
        torch.library.opcheck(torch.ops.pcops.radius_graph_padded.default, (points, 0.3, 0, False, True, group, size))
        torch.library.opcheck(torch.ops.pcops.radius_graph_padded.default, (points, 0.3, 5, True, True, None, size))
