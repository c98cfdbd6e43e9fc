"""pcops.compat.pytorch3d against float64 brute-force references written from PyTorch3D's
current source (knn.py, ball_query.py, sample_farthest_points.py, loss/chamfer.py,
points_normals.py)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pcops.compat import pytorch3d as p3


# ----------------------------------------------------------------------------------------------
# references (float64 loops, no pcops)


def _len(lengths, n, p):
    return [p] * n if lengths is None else lengths.tolist()


def ref_knn(p1, p2, K, lengths1=None, lengths2=None, norm=2):
    """dists/idx (N, P1, K): by (distance, index); 0 where p2 has fewer than K points and on padding rows."""
    n, s1, _ = p1.shape
    l1, l2 = _len(lengths1, n, s1), _len(lengths2, n, p2.shape[1])
    dists = torch.zeros(n, s1, K, dtype=torch.float64)
    idx = torch.zeros(n, s1, K, dtype=torch.long)
    a, b = p1.double(), p2.double()
    for e in range(n):
        for i in range(l1[e]):
            diff = a[e, i] - b[e, : l2[e]]
            d = diff.square().sum(1) if norm == 2 else diff.abs().sum(1)
            order = sorted(range(l2[e]), key=lambda j: (float(d[j]), j))[:K]
            for c, j in enumerate(order):
                dists[e, i, c], idx[e, i, c] = d[j], j
    return dists, idx


def ref_ball(p1, p2, K, radius, lengths1=None, lengths2=None):
    """dists (squared, 0 padded) / idx (-1 padded): the FIRST K in index order with d^2 < r^2."""
    n, s1, _ = p1.shape
    l1, l2 = _len(lengths1, n, s1), _len(lengths2, n, p2.shape[1])
    dists = torch.zeros(n, s1, K, dtype=torch.float64)
    idx = torch.full((n, s1, K), -1, dtype=torch.long)
    a, b = p1.double(), p2.double()
    for e in range(n):
        for i in range(l1[e]):
            c = 0
            for j in range(l2[e]):
                if c == K:
                    break
                d = float((a[e, i] - b[e, j]).square().sum())
                if d < radius * radius:
                    dists[e, i, c], idx[e, i, c] = d, j
                    c += 1
    return dists, idx


def ref_fps(points, K, lengths=None):
    """(N, max K) indices, -1 padded: start at 0, argmax of the min squared distance (first max)."""
    n, p, _ = points.shape
    ks = [K] * n if isinstance(K, int) else list(K)
    lens = _len(lengths, n, p)
    out = torch.full((n, max(ks)), -1, dtype=torch.long)
    for e in range(n):
        pts = points[e, : lens[e]].double()
        dist = torch.full((lens[e],), float("inf"), dtype=torch.float64)
        pick = 0
        for t in range(min(ks[e], lens[e])):
            out[e, t] = pick
            dist = torch.minimum(dist, (pts - pts[pick]).square().sum(1))
            pick = int(torch.argmax(dist))
    return out


def ref_chamfer(x, y, xl=None, yl=None, x_normals=None, y_normals=None, weights=None, batch_reduction="mean",
                point_reduction="mean", norm=2, single_directional=False, abs_cosine=True):
    """PyTorch3D's chamfer_distance, dense, float64."""
    xn, yn = x_normals, y_normals
    n = x.shape[0]
    xl = torch.tensor(_len(xl, n, x.shape[1])) if xl is None else xl
    yl = torch.tensor(_len(yl, n, y.shape[1])) if yl is None else yl
    with_normals = xn is not None and yn is not None

    def one(a, b, al, bl, an, bn):
        costs, ncosts = [], []
        for e in range(n):
            pa, pb = a[e, : al[e]].double(), b[e, : bl[e]].double()
            c = torch.zeros(a.shape[1], dtype=torch.float64)
            nc = torch.zeros(a.shape[1], dtype=torch.float64)
            if pb.shape[0]:
                diff = pa[:, None] - pb[None]
                d = diff.square().sum(-1) if norm == 2 else diff.abs().sum(-1)
                best, j = d.min(1)
                c[: al[e]] = best
                if with_normals:
                    near = bn[e, j].double()
            elif with_normals:
                near = torch.zeros(int(al[e]), 3, dtype=torch.float64)
            if with_normals:
                cos = F.cosine_similarity(an[e, : al[e]].double(), near, dim=1, eps=1e-6)
                nc[: al[e]] = 1 - (cos.abs() if abs_cosine else cos)
            w = 1.0 if weights is None else float(weights[e])
            costs.append(c * w)
            ncosts.append(nc * w)
        c, nc = torch.stack(costs), torch.stack(ncosts)
        if point_reduction == "max":
            return c.max(1).values, None
        if point_reduction is None:
            return c, nc if with_normals else None
        c, nc = c.sum(1), nc.sum(1)
        if point_reduction == "mean":
            c, nc = c / al.clamp(min=1), nc / al.clamp(min=1)
        return c, nc if with_normals else None

    cx, nx = one(x, y, xl, yl, xn, yn)
    if single_directional:
        loss, nloss = cx, nx
    else:
        cy, ny = one(y, x, yl, xl, yn, xn)
        if point_reduction == "max":
            loss, nloss = torch.maximum(cx, cy), None
        elif point_reduction is None:
            loss, nloss = (cx, cy), None if nx is None else (nx, ny)
        else:
            loss, nloss = cx + cy, None if nx is None else nx + ny
    if batch_reduction is None:
        return loss, nloss
    loss = loss.sum()
    nloss = None if nloss is None else nloss.sum()
    if batch_reduction == "mean":
        div = n if weights is None else float(weights.sum())
        loss = loss / div
        nloss = None if nloss is None else nloss / div
    return loss, nloss


# ----------------------------------------------------------------------------------------------
# knn_points / knn_gather


def _clouds(gen, n, p, d=3, dtype=torch.float32):
    return torch.rand(n, p, d, generator=gen, dtype=torch.float64).to(dtype)


def test_knn_points_squared_distances_and_zero_padding(gen):
    p1, p2 = _clouds(gen, 3, 40, 3), _clouds(gen, 3, 50, 3)
    l1, l2 = torch.tensor([40, 25, 0]), torch.tensor([50, 3, 10])
    out = p3.knn_points(p1, p2, l1, l2, K=5)
    dists, idx = ref_knn(p1, p2, 5, l1, l2)
    assert isinstance(out, p3.KNN) and out.knn is None
    assert torch.equal(out.idx, idx)
    torch.testing.assert_close(out.dists.double(), dists, rtol=1e-6, atol=1e-7)
    assert out.dists.dtype == torch.float32 and out.idx.dtype == torch.long


def test_knn_points_k_larger_than_the_cloud(gen):
    p1, p2 = _clouds(gen, 2, 10), _clouds(gen, 2, 4)
    out = p3.knn_points(p1, p2, K=7)
    assert out.idx.shape == (2, 10, 7)
    assert torch.equal(out.idx, ref_knn(p1, p2, 7)[1])
    assert bool((out.idx[..., 4:] == 0).all()) and bool((out.dists[..., 4:] == 0).all())


def test_knn_points_return_nn_is_knn_gather(gen):
    p1, p2 = _clouds(gen, 2, 20), _clouds(gen, 2, 30)
    l2 = torch.tensor([30, 2])
    out = p3.knn_points(p1, p2, lengths2=l2, K=4, return_nn=True)
    assert torch.equal(out.knn, p3.knn_gather(p2, out.idx, l2))
    assert torch.equal(out.knn[0], p2[0][out.idx[0]])
    assert bool((out.knn[1, :, 2:] == 0).all())  # columns past the cloud are 0


def test_knn_gather_masks_columns_past_the_length(gen):
    x = torch.randn(2, 5, 7, generator=gen)
    idx = torch.randint(0, 5, (2, 3, 4), generator=gen)
    out = p3.knn_gather(x, idx, torch.tensor([5, 2]))
    assert out.shape == (2, 3, 4, 7)
    assert torch.equal(out[0], x[0][idx[0]])
    assert torch.equal(out[1, :, :2], x[1][idx[1, :, :2]]) and bool((out[1, :, 2:] == 0).all())


def test_knn_points_ties_go_to_the_smaller_index():
    p2 = torch.tensor([[[1.0, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0]]])
    assert p3.knn_points(torch.zeros(1, 1, 3), p2, K=3).idx[0, 0].tolist() == [0, 1, 2]


def test_knn_points_other_dimensions(gen):
    for d in (2, 6):
        p1, p2 = _clouds(gen, 2, 15, d), _clouds(gen, 2, 25, d)
        assert torch.equal(p3.knn_points(p1, p2, K=3).idx, ref_knn(p1, p2, 3)[1])


def test_knn_points_l1_nearest(gen):
    p1, p2 = _clouds(gen, 2, 30), _clouds(gen, 2, 40)
    l2 = torch.tensor([40, 12])
    out = p3.knn_points(p1, p2, lengths2=l2, norm=1)
    dists, idx = ref_knn(p1, p2, 1, None, l2, norm=1)
    assert torch.equal(out.idx, idx)
    torch.testing.assert_close(out.dists.double(), dists, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="norm=1"):
        p3.knn_points(p1, p2, norm=1, K=2)


@pytest.mark.parametrize("d", [1, 2, 4, 7])
def test_knn_points_l1_nearest_in_any_dimension(gen, d):
    """norm=1 with K=1 takes any number of coordinates, as the docs say (D > 3 raised)."""
    p1, p2 = _clouds(gen, 2, 20, d), _clouds(gen, 2, 30, d)
    l2 = torch.tensor([30, 9])
    out = p3.knn_points(p1, p2, lengths2=l2, norm=1)
    dists, idx = ref_knn(p1, p2, 1, None, l2, norm=1)
    assert torch.equal(out.idx, idx)
    torch.testing.assert_close(out.dists.double(), dists, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm", [1, 2])
def test_knn_points_gradcheck(gen, norm):
    p1 = _clouds(gen, 2, 6, dtype=torch.float64).requires_grad_()
    p2 = _clouds(gen, 2, 8, dtype=torch.float64).requires_grad_()
    k = 3 if norm == 2 else 1
    l2 = torch.tensor([8, 2])
    assert torch.autograd.gradcheck(lambda a, b: p3.knn_points(a, b, lengths2=l2, K=k, norm=norm).dists, (p1, p2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_knn_points_half_precision_returns_its_dtype(gen, dtype):
    p1, p2 = _clouds(gen, 2, 20, dtype=dtype), _clouds(gen, 2, 30, dtype=dtype)
    out = p3.knn_points(p1, p2, K=3)
    assert out.dists.dtype == dtype
    assert torch.equal(out.idx, ref_knn(p1.float(), p2.float(), 3)[1])


def test_errors_name_the_problem(gen):
    p1 = _clouds(gen, 2, 5)

    class Pointclouds:  # what PyTorch3D's structure looks like from outside
        def points_padded(self):
            return p1

        def num_points_per_cloud(self):
            return torch.tensor([5, 5])

    with pytest.raises(TypeError, match="Pointclouds"):
        p3.knn_points(Pointclouds(), p1)
    with pytest.raises(TypeError, match="Pointclouds"):
        p3.chamfer_distance(Pointclouds(), p1)
    with pytest.raises(ValueError, match="batch dimension"):
        p3.knn_points(p1, _clouds(gen, 3, 5))
    with pytest.raises(ValueError, match="point dimension"):
        p3.knn_points(p1, _clouds(gen, 2, 5, 2))
    with pytest.raises(ValueError, match="Support for 1 or 2 norm"):
        p3.knn_points(p1, p1, norm=3)


# ----------------------------------------------------------------------------------------------
# ball_query


def test_ball_query_keeps_the_first_k_in_index_order(gen):
    p2 = torch.rand(1, 300, 3, generator=gen) * 0.1
    p1 = torch.full((1, 1, 3), 0.05)
    out = p3.ball_query(p1, p2, K=16, radius=0.5)
    assert out.idx[0, 0].tolist() == list(range(16))  # not the closest 16


def test_ball_query_matches_reference_with_lengths(gen):
    p1, p2 = _clouds(gen, 3, 40), _clouds(gen, 3, 200)
    l1, l2 = torch.tensor([40, 10, 0]), torch.tensor([200, 50, 7])
    out = p3.ball_query(p1, p2, l1, l2, K=12, radius=0.25)
    dists, idx = ref_ball(p1, p2, 12, 0.25, l1, l2)
    assert torch.equal(out.idx, idx)
    torch.testing.assert_close(out.dists.double(), dists, rtol=1e-6, atol=1e-7)
    assert torch.equal(out.knn, torch.where((idx >= 0)[..., None], p2[torch.arange(3)[:, None, None], idx.clamp(min=0)], 0.0))


def test_ball_query_is_strict_at_the_radius():
    p2 = torch.tensor([[[0.5, 0, 0], [0.25, 0, 0]]])
    out = p3.ball_query(torch.zeros(1, 1, 3), p2, K=2, radius=0.5)
    assert out.idx[0, 0].tolist() == [1, -1] and out.dists[0, 0].tolist() == [0.0625, 0.0]


def test_ball_query_defaults_and_empty_cloud(gen):
    p1 = _clouds(gen, 1, 4)
    out = p3.ball_query(p1, torch.zeros(1, 0, 3))
    assert out.idx.shape == (1, 4, 500) and bool((out.idx == -1).all()) and out.knn.shape == (1, 4, 500, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ball_query_and_fps_accept_half_precision(gen, dtype):
    p1, p2 = _clouds(gen, 2, 20, dtype=dtype), _clouds(gen, 2, 60, dtype=dtype)
    out = p3.ball_query(p1, p2, K=6, radius=0.3)
    assert out.dists.dtype == dtype and out.knn.dtype == dtype
    assert torch.equal(out.idx, ref_ball(p1.float(), p2.float(), 6, 0.3)[1])
    pts, idx = p3.sample_farthest_points(p2, K=5)
    assert pts.dtype == torch.float32 and torch.equal(idx, ref_fps(p2.float(), 5))


def test_ball_query_gradcheck(gen):
    p1 = _clouds(gen, 1, 5, dtype=torch.float64).requires_grad_()
    p2 = _clouds(gen, 1, 9, dtype=torch.float64).requires_grad_()
    radius = 0.7
    # keep every pair away from the boundary, where the finite difference would cross it
    d = (p1[0, :, None] - p2[0, None]).detach().norm(dim=-1)
    assert float((d - radius).abs().min()) > 1e-3
    assert torch.autograd.gradcheck(lambda a, b: p3.ball_query(a, b, K=4, radius=radius, return_nn=False).dists, (p1, p2))


# ----------------------------------------------------------------------------------------------
# sample_farthest_points


def test_sample_farthest_points_matches_the_loop(gen):
    points = _clouds(gen, 3, 100)
    lengths = torch.tensor([100, 30, 5])
    pts, idx = p3.sample_farthest_points(points, lengths, K=10)
    assert torch.equal(idx, ref_fps(points, 10, lengths))
    assert idx.shape == (3, 10) and bool((idx[2, 5:] == -1).all())
    assert bool((pts[2, 5:] == 0).all()) and torch.equal(pts[0], points[0][idx[0]])


def test_sample_farthest_points_per_cloud_k_and_float32_output(gen):
    points = _clouds(gen, 2, 50, dtype=torch.float64)
    pts, idx = p3.sample_farthest_points(points, K=[3, 7])
    assert idx.shape == (2, 7) and pts.dtype == torch.float32  # PyTorch3D converts to float32
    assert torch.equal(idx, ref_fps(points, [3, 7]))
    assert bool((idx[0, 3:] == -1).all()) and bool((pts[0, 3:] == 0).all())
    _, again = p3.sample_farthest_points(points, K=torch.tensor([3, 7]))
    assert torch.equal(again, idx)


def test_sample_farthest_points_random_start_is_seeded(gen):
    points = _clouds(gen, 2, 60)
    torch.manual_seed(1)
    a = p3.sample_farthest_points(points, K=5, random_start_point=True)[1]
    torch.manual_seed(1)
    b = p3.sample_farthest_points(points, K=5, random_start_point=True)[1]
    assert torch.equal(a, b)


def test_sample_farthest_points_gradient_reaches_the_points(gen):
    points = _clouds(gen, 1, 20).requires_grad_()
    pts, idx = p3.sample_farthest_points(points, K=4)
    pts.sum().backward()
    assert points.grad[0, idx[0]].eq(1).all() and points.grad.sum() == 12


# ----------------------------------------------------------------------------------------------
# chamfer_distance


@pytest.mark.parametrize("point_reduction", ["mean", "sum", "max", None])
@pytest.mark.parametrize("batch_reduction", ["mean", "sum", None])
@pytest.mark.parametrize("norm", [1, 2])
def test_chamfer_without_normals_matches_reference(gen, point_reduction, batch_reduction, norm):
    if point_reduction is None and batch_reduction is not None:
        return
    x, y = _clouds(gen, 3, 30), _clouds(gen, 3, 40)
    xl, yl = torch.tensor([30, 10, 1]), torch.tensor([40, 40, 0])
    kw = dict(batch_reduction=batch_reduction, point_reduction=point_reduction, norm=norm)
    loss, normals = p3.chamfer_distance(x, y, xl, yl, **kw)
    expected, _ = ref_chamfer(x, y, xl, yl, **kw)
    assert normals is None
    loss = loss if isinstance(loss, tuple) else (loss,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for a, b in zip(loss, expected):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("abs_cosine", [True, False])
@pytest.mark.parametrize("point_reduction", ["mean", "sum", None])
def test_chamfer_with_normals_and_weights_matches_reference(gen, abs_cosine, point_reduction):
    x, y = _clouds(gen, 3, 25), _clouds(gen, 3, 35)
    xn, yn = torch.randn(3, 25, 3, generator=gen), torch.randn(3, 35, 3, generator=gen)
    xl, yl = torch.tensor([25, 7, 3]), torch.tensor([35, 35, 0])
    weights = torch.tensor([1.0, 0.5, 2.0])
    batch_reduction = None if point_reduction is None else "mean"
    kw = dict(x_normals=xn, y_normals=yn, weights=weights, abs_cosine=abs_cosine,
              point_reduction=point_reduction, batch_reduction=batch_reduction)
    loss, normals = p3.chamfer_distance(x, y, xl, yl, **kw)
    expected, expected_normals = ref_chamfer(x, y, xl, yl, **kw)
    flat = lambda t: t if isinstance(t, tuple) else (t,)  # noqa: E731
    for a, b in zip(flat(loss) + flat(normals), flat(expected) + flat(expected_normals)):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_chamfer_single_directional(gen):
    x, y = _clouds(gen, 2, 20), _clouds(gen, 2, 30)
    loss, _ = p3.chamfer_distance(x, y, single_directional=True)
    torch.testing.assert_close(loss.double(), ref_chamfer(x, y, single_directional=True)[0], rtol=1e-5, atol=1e-6)


def test_chamfer_zero_weights_give_zero_losses(gen):
    x, y = _clouds(gen, 2, 20), _clouds(gen, 2, 30)
    loss, normals = p3.chamfer_distance(x, y, weights=torch.zeros(2))
    assert float(loss) == 0.0 and float(normals) == 0.0
    with pytest.raises(ValueError, match="negative"):
        p3.chamfer_distance(x, y, weights=torch.tensor([1.0, -1.0]))


def test_chamfer_errors_as_pytorch3d(gen):
    x = _clouds(gen, 2, 5)
    with pytest.raises(ValueError, match="point_reduction"):
        p3.chamfer_distance(x, x, point_reduction="median")
    with pytest.raises(ValueError, match="Batch reduction must be None"):
        p3.chamfer_distance(x, x, point_reduction=None)
    with pytest.raises(ValueError, match="Normals must be None"):
        p3.chamfer_distance(x, x, x_normals=x, y_normals=x, point_reduction="max")


def test_chamfer_gradcheck_both_paths(gen):
    x = _clouds(gen, 2, 6, dtype=torch.float64).requires_grad_()
    y = _clouds(gen, 2, 7, dtype=torch.float64).requires_grad_()
    xn = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64).requires_grad_()
    yn = torch.randn(2, 7, 3, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: p3.chamfer_distance(a, b)[0], (x, y))
    w = torch.tensor([1.0, 3.0], dtype=torch.float64)
    fn = lambda a, b, n: sum(p3.chamfer_distance(a, b, x_normals=n, y_normals=yn, weights=w, abs_cosine=False))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, y, xn))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chamfer_half_precision(gen, dtype):
    x, y = _clouds(gen, 2, 20, dtype=dtype), _clouds(gen, 2, 30, dtype=dtype)
    loss, _ = p3.chamfer_distance(x, y)
    assert loss.dtype == dtype
    torch.testing.assert_close(loss.double(), ref_chamfer(x.float(), y.float())[0], rtol=1e-2, atol=1e-3)


# ----------------------------------------------------------------------------------------------
# estimate_pointcloud_normals


def ref_normals(points, k, disambiguate=True):
    out = torch.zeros(points.shape, dtype=torch.float64)
    for e in range(points.shape[0]):
        pts = points[e].double()
        pts = pts - pts.mean(0)
        d = (pts[:, None] - pts[None]).square().sum(-1)
        for i in range(pts.shape[0]):
            nb = pts[sorted(range(pts.shape[0]), key=lambda j: (float(d[i, j]), j))[:k]]
            c = nb - nb.mean(0)
            _, vec = np.linalg.eigh((c.T @ c / k).numpy())
            n = torch.from_numpy(vec[:, 0])
            if disambiguate and int((((nb - pts[i]) @ n) > 0).sum()) < 0.5 * k:
                n = -n
            out[e, i] = n
    return out


def test_estimate_normals_disambiguated_as_pytorch3d(gen):
    theta = torch.rand(2, 150, generator=gen, dtype=torch.float64) * 2 * np.pi
    z = torch.rand(2, 150, generator=gen, dtype=torch.float64) * 2 - 1
    sphere = torch.stack([(1 - z**2).sqrt() * theta.cos(), (1 - z**2).sqrt() * theta.sin(), z], -1)
    points = (sphere + 0.01 * torch.randn(sphere.shape, generator=gen, dtype=torch.float64)).float()
    out = p3.estimate_pointcloud_normals(points, 12)
    expected = ref_normals(points, 12)
    cos = (out.double() * expected).sum(-1)
    assert out.shape == points.shape and out.dtype == torch.float32
    assert float(cos.min()) > 0.999  # same direction and the same sign


def test_estimate_normals_gradcheck(gen):
    points = torch.rand(1, 14, 3, generator=gen, dtype=torch.float64)
    points[..., 2] *= 0.1  # a noisy slab: a simple smallest eigenvalue everywhere
    points.requires_grad_()
    assert torch.autograd.gradcheck(lambda p: p3.estimate_pointcloud_normals(p, 6), (points,))


def test_estimate_normals_needs_more_points_than_neighbours(gen):
    with pytest.raises(ValueError, match="neighborhood_size"):
        p3.estimate_pointcloud_normals(_clouds(gen, 1, 10), 10)


# ----------------------------------------------------------------------------------------------
# torch.compile


def test_knn_points_ball_query_and_chamfer_compile_without_graph_breaks(gen):
    from torch._dynamo.utils import counters

    p1, p2 = _clouds(gen, 2, 30), _clouds(gen, 2, 40)
    l2 = torch.tensor([40, 20])

    def f(a, b, l2):
        knn = p3.knn_points(a, b, lengths2=l2, K=4)
        ball = p3.ball_query(a, b, lengths2=l2, K=8, radius=0.3)
        loss, _ = p3.chamfer_distance(a, b, y_lengths=l2)
        return knn.dists, knn.idx, ball.idx, loss

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(p1, p2, l2)
    assert not counters["graph_break"]
    for a, b in zip(out, f(p1, p2, l2)):
        torch.testing.assert_close(a, b)


@pytest.mark.cuda
def test_cuda_results_equal_cpu_results(gen):
    p1, p2 = _clouds(gen, 2, 50), _clouds(gen, 2, 80)
    l2 = torch.tensor([80, 30])
    a, b, l = p1.cuda(), p2.cuda(), l2.cuda()
    assert torch.equal(p3.knn_points(a, b, lengths2=l, K=5).idx.cpu(), p3.knn_points(p1, p2, lengths2=l2, K=5).idx)
    assert torch.equal(p3.ball_query(a, b, lengths2=l, K=8, radius=0.3).idx.cpu(), p3.ball_query(p1, p2, lengths2=l2, K=8, radius=0.3).idx)
    assert torch.equal(p3.sample_farthest_points(a, K=10)[1].cpu(), p3.sample_farthest_points(p1, K=10)[1])
    torch.testing.assert_close(p3.chamfer_distance(a, b)[0].cpu(), p3.chamfer_distance(p1, p2)[0])
