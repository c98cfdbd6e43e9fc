"""Independent references for the tests: dense float64 computations with direct differences."""

import numpy as np
import torch


def distances(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(M, N) Euclidean distances in float64 from direct differences (never cdist's matmul form),
    each the IEEE root of its square (:func:`root`)."""
    q, p = q.double(), p.double()
    return root((q[:, None, :] - p[None, :, :]).pow(2).sum(-1))


def root(sq: torch.Tensor) -> torch.Tensor:
    """The square roots of ``sq``, each the nearest float (IEEE 754's, by numpy: torch's CPU sqrt
    is within an ulp of it, not always the nearest, and two squares an ulp apart then tie or not
    by chance), differentiable as ``sqrt``."""
    approx = sq.sqrt()
    with np.errstate(invalid="ignore"):
        exact = torch.from_numpy(np.sqrt(sq.detach().cpu().numpy())).to(sq.device)
    # (within an ulp of each other, their difference and the sum are exact: the nearest root's value)
    return torch.where(torch.isfinite(approx), approx + (exact - approx).detach(), approx)


def first(d: torch.Tensor, k: int) -> torch.Tensor:
    """``d.argsort(dim=1, stable=True)[:, :k]``: each row's k smallest entries, ties by the
    smaller index; for a few of many finite entries, from the entries up to each row's k-th
    smallest value (``topk``) ordered by (value, index), not from whole sorted rows."""
    n = d.shape[1] if d.dim() == 2 else 0
    if not 0 < 8 * k <= n or not bool(torch.isfinite(d).all()):
        return d.argsort(dim=1, stable=True)[:, :k]
    within = d <= d.topk(k, dim=1, largest=False).values[:, -1:]  # every entry up to the k-th smallest value
    count = int(within.sum(1).max())  # (at least k a row; more where values tie with the k-th)
    if 8 * count > n:
        return d.argsort(dim=1, stable=True)[:, :k]
    found = torch.where(within, d, torch.inf).topk(count, dim=1, largest=False).indices.sort(dim=1).values
    return found.gather(1, d.gather(1, found).argsort(dim=1, stable=True)[:, :k])  # (others: above the k-th value)


def softmax_mean(d: torch.Tensor, mask: torch.Tensor, f: torch.Tensor, sigma: float) -> torch.Tensor:
    """sum_j w_ij f_j / sum_j w_ij with w_ij = exp(-d_ij / sigma) over mask, 0 for an empty row."""
    inf = torch.tensor(float("inf"), dtype=d.dtype)
    m = torch.where(mask, d, inf).min(1, keepdim=True).values
    w = torch.where(mask, torch.exp(-(d - torch.where(torch.isinf(m), 0, m)) / sigma), 0)
    total = w.sum(1, keepdim=True)
    return torch.where(total > 0, (w @ f.double()) / torch.where(total > 0, total, 1), 0)


def radius_aggregate(q, p, f, radius, sigma):
    """Dense float64 reference of pcops.radius_aggregate."""
    d = distances(q, p)
    return softmax_mean(d, d <= radius, f, float(sigma))


def safe_radius(q, p, radius, gap=1e-4):
    """A radius near ``radius`` with no pair distance within ``gap * radius`` of it.

    Keeps float32 rounding and finite differences away from the discontinuity at d == r.
    """
    d = distances(q, p).reshape(-1)
    for k in range(200):
        r = radius * (1 + 0.0031 * k)
        if d.numel() == 0 or (d - r).abs().min() > gap * r:
            return r
    raise AssertionError("no boundary-safe radius found")


def cloud(kind: str, gen: torch.Generator, m: int = 60, n: int = 90):
    """Adversarial (query, ref, radius) clouds in float64."""
    rand = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if kind == "uniform":
        q, p, r = rand(m, 3) * 2 - 1, rand(n, 3) * 2 - 1, 0.5
    elif kind == "far_negative":  # far outside [-1, 1], all coordinates negative
        q, p, r = rand(m, 3) * 40 - 250, rand(n, 3) * 40 - 250, 12.0
    elif kind == "clustered":  # a few tight clusters and a sparse background
        centres = rand(4, 3) * 2 - 1
        p = centres[torch.randint(0, 4, (n,), generator=gen)] + 0.02 * (rand(n, 3) - 0.5)
        p[: n // 6] = rand(n // 6, 3) * 2 - 1
        q = centres[torch.randint(0, 4, (m,), generator=gen)] + 0.05 * (rand(m, 3) - 0.5)
        r = 0.04
    elif kind == "duplicates":  # repeated reference points, queries exactly on reference points
        base = rand(n // 3, 3)
        p = base.repeat(3, 1)
        q = torch.cat([base[: m // 2], rand(m - m // 2, 3)])
        r = 0.3
    elif kind == "isolated":  # half the queries have no neighbour
        p = rand(n, 3)
        q = torch.cat([rand(m // 2, 3), rand(m - m // 2, 3) + 10])
        r = 0.25
    elif kind == "huge_radius":  # every reference point is a neighbour of every query
        q, p, r = rand(m, 3) * 2 - 1, rand(n, 3) * 2 - 1, 100.0
    else:
        raise ValueError(kind)
    return q, p, r


CLOUDS = ["uniform", "far_negative", "clustered", "duplicates", "isolated", "huge_radius"]


def knn(q, p, k):
    """Dense float64 kNN: (dists, idx) sorted by distance, ties by the smaller index."""
    d = distances(q, p)
    order = first(d, k)
    return d.gather(1, order), order


def knn_aggregate(q, p, f, k, sigma):
    """Dense float64 reference of pcops.knn_aggregate (softmax(-d/sigma) over the k nearest)."""
    d, idx = knn(q, p, k)
    w = torch.softmax(-d / float(sigma), dim=1)
    return (w[..., None] * f.double()[idx]).sum(1)


def farthest_point_sample(points, n_samples, start=0):
    """Float64 iterative FPS from direct differences: the farthest unpicked point, ties by the smaller index."""
    p = points.double()
    n = p.shape[0]
    picked = [start] if n else []
    dist = torch.full((n,), float("inf"), dtype=torch.float64)
    while len(picked) < min(n_samples, n):
        dist = torch.minimum(dist, (p - p[picked[-1]]).square().sum(1))
        free = dist.clone()
        free[torch.tensor(picked)] = -1
        picked.append(int(free.argmax()))  # argmax returns the first maximum
    return torch.tensor(picked, dtype=torch.int64)


def ball_query(q, p, radius, k):
    """Dense float64 ball query: (dists, idx, counts), the k closest within radius, -1 / inf padded."""
    d = distances(q, p)
    within = d <= radius
    inside = torch.where(within, d, float("inf"))
    order = inside.argsort(dim=1, stable=True)[:, :k]
    dists = inside.gather(1, order)
    if order.shape[1] < k:  # fewer reference points than k
        pad = k - order.shape[1]
        order = torch.cat([order, order.new_full((q.shape[0], pad), -1)], 1)
        dists = torch.cat([dists, dists.new_full((q.shape[0], pad), float("inf"))], 1)
    idx = torch.where(torch.isinf(dists), -1, order)
    return dists, idx, within.sum(1)


def graph(points, batch=None, loop=False, k=None, radius=None, max_neighbors=None):
    """Dense float64 kNN graph (k) or radius graph (radius): edge_index (2, E), row 0 the
    neighbour, row 1 the centre; by centre, then distance, ties by the smaller index."""
    n = points.shape[0]
    d = distances(points, points)
    same = torch.ones(n, n, dtype=torch.bool) if batch is None else batch[:, None] == batch[None, :]
    if not loop:
        same &= ~torch.eye(n, dtype=torch.bool)
    if radius is not None:
        same &= d <= radius
    edges = []
    for i in range(n):
        cand = same[i].nonzero().flatten()
        cand = cand[d[i, cand].argsort(stable=True)]
        cap = k if k is not None else max_neighbors
        edges += [(int(j), i) for j in (cand if cap is None else cand[:cap])]
    return torch.tensor(edges, dtype=torch.int64).reshape(-1, 2).T.contiguous()


def knn_weighted(q, p, f, k, weights, reduce="mean", sigma=None):
    """Dense float64 reference of pcops.knn_aggregate for every weighting and reduction."""
    d, idx = knn(q, p, k)
    g = f.double()[idx]  # (M, k, F)
    if reduce == "max":
        return g.amax(1)
    if weights == "softmax":
        w = torch.softmax(-d / float(sigma), dim=1)
    elif weights == "inverse_distance":  # PyTorch Geometric's knn_interpolate
        w = 1.0 / (q.double()[:, None, :] - p.double()[idx]).pow(2).sum(-1).clamp(min=1e-16)
        w = w / w.sum(1, keepdim=True)
    else:
        w = torch.full_like(d, 1.0 / k)
    return (w[..., None] * g).sum(1)


def chamfer_terms(x, y, norm=2):
    """Dense float64 per-point Chamfer costs (cham_x (P1,), cham_y (P2,)) of two single clouds."""
    diff = x.double()[:, None, :] - y.double()[None, :, :]
    d = diff.pow(2).sum(-1) if norm == 2 else diff.abs().sum(-1)
    if 0 in d.shape:  # PyTorch3D: a point with nothing to match costs 0
        return torch.zeros(x.shape[0], dtype=torch.float64), torch.zeros(y.shape[0], dtype=torch.float64)
    return d.min(1).values, d.min(0).values


def normals(points, k):
    """Dense float64 kNN-covariance normals (numpy's eigh), sign not fixed: (P, 3), and eigenvalues (P, 3)."""
    import numpy as np

    _, idx = knn(points, points, k)
    nb = points.double()[idx]  # (P, k, 3)
    centred = nb - nb.mean(1, keepdim=True)
    cov = (centred.transpose(1, 2) @ centred / k).numpy()
    values, vectors = np.linalg.eigh(cov)
    return torch.from_numpy(vectors[..., 0].copy()), torch.from_numpy(values)


def voxel_pool(points, voxel_size, features=None, batch=None, reduce="mean"):
    """Float64 voxel pooling by a Python dictionary of (sample, floor(p / s)) keys, sorted."""
    p = points.double()
    cells = torch.floor(p / voxel_size).long().tolist()
    ids = [0] * p.shape[0] if batch is None else batch.tolist()
    keys = [(b, *c) for b, c in zip(ids, cells)]
    order = {key: n for n, key in enumerate(sorted(set(keys)))}
    cluster = torch.tensor([order[key] for key in keys], dtype=torch.int64)
    members = [(cluster == c).nonzero().flatten() for c in range(len(order))]
    pooled = torch.stack([p[m].mean(0) for m in members]) if members else p.new_zeros((0, 3))
    pooled_f = None
    if features is not None:
        f = features.double()
        pool = (lambda x: x.mean(0)) if reduce == "mean" else (lambda x: x.max(0).values)
        pooled_f = torch.stack([pool(f[m]) for m in members]) if members else f.new_zeros((0, f.shape[1]))
    return pooled, pooled_f, cluster


def radius_weighted(q, p, f, radius, weights, reduce="mean", sigma=None):
    """Dense float64 reference of pcops.radius_aggregate for every weighting and reduction."""
    d = distances(q, p)
    mask = d <= radius
    f = f.double()
    if reduce == "max":
        if 0 in mask.shape:
            return torch.zeros(q.shape[0], f.shape[1], dtype=torch.float64)
        g = torch.where(mask[..., None], f[None], float("-inf")).amax(1)
        return torch.where(mask.any(1, keepdim=True), g, 0)
    if weights == "softmax":
        return softmax_mean(d, mask, f, float(sigma))
    if weights == "inverse_distance":
        w = torch.where(mask, 1.0 / (q.double()[:, None, :] - p.double()[None]).pow(2).sum(-1).clamp(min=1e-16), 0)
    else:
        w = mask.double()
    total = w.sum(1, keepdim=True)
    return torch.where(total > 0, (w @ f) / torch.where(total > 0, total, 1), 0)


def winding_number(points, vertices, faces):
    """The exact generalised winding number (M,) of points about a triangle mesh: the sum of the
    faces' signed solid angles (Van Oosterom and Strackee) over 4 pi, in float64."""
    points, corners = points.double(), vertices.double()[faces]
    out = []
    for chunk in points.split(256):
        x, y, z = (corners[None, :, k] - chunk[:, None] for k in range(3))
        lx, ly, lz = x.norm(dim=-1), y.norm(dim=-1), z.norm(dim=-1)
        num = (x * torch.linalg.cross(y, z, dim=-1)).sum(-1)
        den = lx * ly * lz + (x * y).sum(-1) * lz + (y * z).sum(-1) * lx + (z * x).sum(-1) * ly
        out.append(2 * torch.atan2(num, den).sum(-1) / (4 * torch.pi))
    return torch.cat(out)


def _segment_points(p, a, b):
    """Closest points of segments ab to points p (broadcast), the parameter clamped to [0, 1]."""
    ab = b - a
    length2 = (ab * ab).sum(-1, keepdim=True)
    t = ((p - a) * ab).sum(-1, keepdim=True) / torch.where(length2 > 0, length2, 1)
    return a + torch.where(length2 > 0, t.clamp(0, 1), 0) * ab


def triangle_points(p, a, b, c):
    """The closest point of each triangle abc to each point p (broadcast shapes (..., 3)), float64:
    the nearest of the three edges' closest points and, where the normal equations of the plane
    a + s (b - a) + t (c - a) put the stationary point inside (s, t >= 0, s + t <= 1; solved by
    the pseudo-inverse, so slivers and degenerate faces are safe), that point. Every candidate is
    a point of the triangle, so the result is never nearer than the triangle."""
    p, a, b, c = (x.double() for x in (p, a, b, c))
    e0, e1 = b - a, c - a
    gram = torch.stack([torch.stack([(e0 * e0).sum(-1), (e0 * e1).sum(-1)], -1), torch.stack([(e0 * e1).sum(-1), (e1 * e1).sum(-1)], -1)], -2)
    w = p - a
    rhs = torch.stack([(w * e0).sum(-1), (w * e1).sum(-1)], -1)
    st = (torch.linalg.pinv(gram) @ rhs[..., None])[..., 0]
    s_, t_ = st[..., 0:1], st[..., 1:2]
    interior = a + s_ * e0 + t_ * e1
    inside = ((s_ >= 0) & (t_ >= 0) & (s_ + t_ <= 1))[..., 0]
    candidates = torch.stack([_segment_points(p, a, b), _segment_points(p, b, c), _segment_points(p, c, a), interior.expand_as(_segment_points(p, a, b))], -2)
    d = (p[..., None, :] - candidates).norm(dim=-1)
    d[..., 3] = torch.where(inside, d[..., 3], torch.inf)
    pick = d.argmin(-1)
    return candidates.gather(-2, pick[..., None, None].expand(*pick.shape, 1, 3))[..., 0, :]


def _sub(u, v):
    return [x - y for x, y in zip(u, v)]


def _dot(u, v):
    return sum(x * y for x, y in zip(u, v))


def _cross(u, v):
    return [u[1] * v[2] - u[2] * v[1], u[2] * v[0] - u[0] * v[2], u[0] * v[1] - u[1] * v[0]]


def exact_unit_normal(a, b, c) -> torch.Tensor:
    """The unit normal of triangle abc (float 3-vectors), (b - a) x (c - a) computed exactly
    (rationals), then rounded and normalised in float64: within a few ulps of the true direction
    however thin the triangle."""
    from fractions import Fraction

    a, b, c = ([Fraction(float(x)) for x in t] for t in (a, b, c))
    n = torch.tensor([float(x) for x in _cross(_sub(b, a), _sub(c, a))], dtype=torch.float64)
    return n / n.norm()


def exact_triangle_point(p, a, b, c):
    """The closest point of triangle abc to p (3-vectors of floats) in exact rational arithmetic
    (the float values as fractions, nothing rounded): (squared distance, closest point, "plane" or
    "edge"), for inputs whose float64 formulas may round (thin faces in float64). The plane where
    p projects inside a triangle of nonzero area, else the nearest point of its three edges."""
    from fractions import Fraction

    p, a, b, c = ([Fraction(float(x)) for x in t] for t in (p, a, b, c))
    n = _cross(_sub(b, a), _sub(c, a))
    sub, dot, cross = _sub, _dot, _cross
    nn = dot(n, n)
    if nn > 0 and all(dot(n, cross(sub(y, x), sub(p, x))) >= 0 for x, y in ((a, b), (b, c), (c, a))):
        t = dot(n, sub(a, p)) / nn
        return t * t * nn, [x + t * y for x, y in zip(p, n)], "plane"
    best = None
    for x, y in ((a, b), (b, c), (c, a)):
        xy = sub(y, x)
        length2 = dot(xy, xy)
        t = min(max(dot(sub(p, x), xy) / length2, Fraction(0)), Fraction(1)) if length2 else Fraction(0)
        q = [u + t * v for u, v in zip(x, xy)]
        if best is None or dot(sub(p, q), sub(p, q)) < best[0]:
            best = (dot(sub(p, q), sub(p, q)), q, "edge")
    return best


def mesh_distance(points, vertices, faces, tie: float = 1e-12):
    """Dense float64 point-to-mesh distances from the closest point on every (point, face) pair
    (:func:`triangle_points`): (dists (M,), closest (M, 3), face (M,)), ties within ``tie``
    times the coordinates' size by the smaller face index."""
    p, corners = points.double(), vertices.double()[faces]
    near = torch.cat([triangle_points(chunk[:, None], corners[None, :, 0], corners[None, :, 1], corners[None, :, 2]) for chunk in p.split(64)]) \
        if p.shape[0] else p.new_zeros((0, corners.shape[0], 3))
    d = (p[:, None] - near).norm(dim=-1)
    size = max(p.abs().max().item() if p.numel() else 0.0, corners.abs().max().item())
    face = (d <= d.min(1, keepdim=True).values + tie * size).to(torch.int8).argmax(1)  # the first (smallest) index within the tie
    rows = torch.arange(p.shape[0])
    return d[rows, face], near[rows, face], face
