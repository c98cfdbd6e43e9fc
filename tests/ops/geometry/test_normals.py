"""pcops.estimate_normals on planes, spheres and noisy surfaces, against analytic normals and a float64 reference."""

import math

import pytest
import torch

import pcops
from tests import reference
from tests.compile_check import assert_compiles_like_eager
from tests.reference import CLOUDS, cloud

F64 = torch.float64


def plane(gen, n=400, noise=0.0):
    """Points on the plane z = 0.3 x - 0.2 y + 0.1 (plus normal noise), and its unit normal."""
    xy = torch.rand(n, 2, generator=gen, dtype=F64) * 2 - 1
    z = 0.3 * xy[:, :1] - 0.2 * xy[:, 1:] + 0.1
    normal = torch.tensor([-0.3, 0.2, 1.0], dtype=F64)
    normal = normal / normal.norm()
    pts = torch.cat([xy, z], 1) + noise * torch.randn(n, 1, generator=gen, dtype=F64) * normal
    return pts, normal


def sphere(gen, n=2000, radius=0.7, centre=(0.2, -0.1, 0.3)):
    d = torch.randn(n, 3, generator=gen, dtype=F64)
    d = d / d.norm(dim=1, keepdim=True)
    c = torch.tensor(centre, dtype=F64)
    return c + radius * d, d, c


def test_plane_normals_are_exact(gen):
    pts, normal = plane(gen)
    n = pcops.estimate_normals(pts, 8)
    torch.testing.assert_close((n @ normal).abs(), torch.ones(len(pts), dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(n.norm(dim=1), torch.ones(len(pts), dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_closed_form_eigensolver_matches_eigh(gen, dtype):
    # random SPD matrices and the degenerate ones of point neighbourhoods (discs: a double
    # largest eigenvalue; lines: a double smallest; isotropic; zero), rotated at random
    from pcops.ops.geometry.normals import _eigh3

    a = torch.randn(2000, 3, 3, generator=gen, dtype=F64)
    spectra = torch.tensor([[0, 1, 1], [1, 1, 3], [2, 2, 2], [0, 0, 1], [0, 0, 0], [1e-9, 1, 2], [0, 1e-6, 1],
                            [1e-6, 4e-4, 1], [1e-8, 1e-4, 1], [1e-12, 1e-8, 1]], dtype=F64)  # the last three: strips
    rot, _ = torch.linalg.qr(torch.randn(len(spectra), 3, 3, generator=gen, dtype=F64))
    mats = torch.cat([a @ a.transpose(1, 2), rot @ torch.diag_embed(spectra) @ rot.transpose(1, 2)]).to(dtype)
    values, vectors = _eigh3(mats)
    ref_values, ref_vectors = torch.linalg.eigh(mats.double())
    size = mats.double().norm(dim=(1, 2), keepdim=True).clamp_min(1e-300)
    tol = 1e-7 if dtype == F64 else 1e-3  # double eigenvalues: ~sqrt(eps) (the trigonometric form)
    torch.testing.assert_close(values.double() / size[..., 0], ref_values / size[..., 0], rtol=0, atol=tol)
    eye = torch.eye(3, dtype=F64)
    orthonormal = vectors.double().transpose(1, 2) @ vectors.double()
    torch.testing.assert_close(orthonormal, eye.expand_as(orthonormal), rtol=0, atol=1e-12 if dtype == F64 else 1e-5)
    residual = (mats.double() @ vectors.double() - vectors.double() * values.double()[:, None, :]) / size
    assert residual.abs().max() < tol
    # a simple smallest eigenvalue (every matrix but the lines, isotropic and zero ones): the
    # normal's eigenvector, up to sign, to ~eps
    simple = (ref_values[:, 1] - ref_values[:, 0]) > 1e-3 * size[:, 0, 0]
    align = (vectors[:, :, 0].double() * ref_vectors[:, :, 0]).sum(-1).abs()[simple]
    assert (1 - align).max() < (1e-12 if dtype == F64 else 1e-5)


def _kernel_normals(neighbourhoods, dtype):
    """The no-gradient kernel's unoriented normals of neighbourhoods (M, k, 3): each point's
    neighbour indices are its own neighbourhood's rows."""
    from pcops.ops.geometry.normals import _knn_normals

    m, k, _ = neighbourhoods.shape
    idx = (torch.arange(m * k) // k * k)[:, None] + torch.arange(k)
    return _knn_normals(neighbourhoods.reshape(-1, 3).to(dtype), idx, torch.ones(1, dtype=dtype), None)[::k]


def _torch_normals(neighbourhoods, dtype):
    """The differentiable path's normals of neighbourhoods (M, k, 3) (covariance in float64)."""
    from pcops.ops.geometry.normals import _SmallestEigenvector

    centred = neighbourhoods - neighbourhoods.mean(1, keepdim=True)
    cov = centred.transpose(1, 2) @ centred / neighbourhoods.shape[1]
    return _SmallestEigenvector.apply(cov.to(dtype))[0]


@pytest.mark.parametrize("solver", [_torch_normals, _kernel_normals], ids=["torch", "kernel"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_strip_shaped_neighbourhoods_get_accurate_normals(gen, dtype, solver):
    # two small covariance eigenvalues next to a large one (an edge, a scan line). An eigenvector
    # computed in a dtype with unit roundoff eps is off by about eps * lambda_max / gap radians
    # (Davis-Kahan: a perturbation of size eps * ||C|| turns it by at most that much over the gap
    # to the next eigenvalue), whatever the machine's BLAS or vector-math kernels; the reference
    # eigh (float64) is off by the same order. So each neighbourhood's bound is 16x its own
    # eps * lambda_3 / (lambda_2 - lambda_1) (measured up to 1.2x in float64, 0.3x in float32),
    # and float32 stays within 0.1 degree on these cases. Both solvers: the torch one of the
    # gradient path and the kernel of the no-gradient path (which sums the covariance in dtype).
    eps = torch.finfo(dtype).eps
    for spread in ([1, 0.02, 1e-3], [1, 0.01, 1e-4]):
        pts = torch.randn(500, 16, 3, generator=gen, dtype=F64) * torch.tensor(spread, dtype=F64)
        rot, _ = torch.linalg.qr(torch.randn(500, 3, 3, generator=gen, dtype=F64))
        centred = pts @ rot - (pts @ rot).mean(1, keepdim=True)
        cov = centred.transpose(1, 2) @ centred / 16
        values, vectors = torch.linalg.eigh(cov)
        normal = solver(pts @ rot, dtype)
        sine = torch.linalg.cross(normal.double(), vectors[..., 0], dim=-1).norm(dim=-1)  # of the angle between them
        bound = 16 * eps * values[:, 2] / (values[:, 1] - values[:, 0])
        assert (sine <= bound).all(), (sine / bound).max()
        if dtype != F64:
            assert sine.max() < math.radians(0.1)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_kernel_handles_degenerate_neighbourhoods_as_the_torch_solver(dtype):
    # a regular grid (equal larger eigenvalues), a line (equal smallest), a cube's corners
    # (isotropic), one point repeated (zero covariance), a tiny copy of the grid (scaled), a rotated grid
    g = torch.arange(4, dtype=F64)
    grid = torch.cat([torch.cartesian_prod(g, g), torch.zeros(16, 1, dtype=F64)], 1) - 1.5
    line = torch.arange(16, dtype=F64)[:, None] * torch.tensor([0.3, -0.2, 0.5], dtype=F64)
    cube = torch.cartesian_prod(*[torch.tensor([-1.0, 1.0], dtype=F64)] * 3).repeat(2, 1)
    same = torch.full((16, 3), 0.25, dtype=F64)
    hoods = torch.stack([grid, line, cube, same, 1e-15 * grid, grid @ torch.linalg.qr(torch.randn(3, 3, dtype=F64))[0]])
    ours = _kernel_normals(hoods, dtype).double()
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(hoods), dtype=F64), rtol=0, atol=1e-6)
    tol = 1e-12 if dtype == F64 else 1e-6
    torch.testing.assert_close(ours[[0, 4]].abs(), torch.tensor([[0.0, 0.0, 1.0]] * 2, dtype=F64), rtol=0, atol=tol)
    assert (ours[1] @ line[1]).abs() < tol * line[1].norm()  # any direction orthogonal to the line
    torch.testing.assert_close(ours[[2, 3]], torch.tensor([[1.0, 0.0, 0.0]] * 2, dtype=F64), rtol=0, atol=0)  # eigh's first axis
    torch.testing.assert_close(ours[5].abs(), _torch_normals(hoods[5:], dtype)[0].double().abs(), rtol=0, atol=tol)


@pytest.mark.parametrize("kind", CLOUDS)
def test_without_gradient_the_kernel_gives_the_differentiable_paths_normals(gen, kind):
    # no gradient asked for: one Warp kernel (covariance from the indices, closed-form smallest
    # eigenvector, sign); asked for: the torch path with its custom backward. Same normals, signs included.
    _, p, _ = cloud(kind, gen)
    view = torch.tensor([0.1, 2.0, -3.0], dtype=F64)
    for orient_to in (None, view):
        fast = pcops.estimate_normals(p, 9, orient_to=orient_to)
        differentiable = pcops.estimate_normals(p.clone().requires_grad_(), 9, orient_to=orient_to)
        assert differentiable.requires_grad and not fast.requires_grad
        _, values = reference.normals(p, 9)
        ok = values[:, 1] - values[:, 0] > 1e-9 * values[:, 2]  # where the normal is defined
        torch.testing.assert_close(fast[ok], differentiable.detach()[ok], rtol=0, atol=1e-8)
        torch.testing.assert_close(fast.norm(dim=1), torch.ones(len(p), dtype=F64), rtol=0, atol=1e-12)


def test_kernel_op_passes_opcheck(gen):
    from pcops.ops.geometry.normals import _knn_normals

    pts = torch.rand(12, 3, generator=gen, dtype=F64)
    idx = torch.randint(0, 12, (12, 4), generator=gen)
    idx[3, 2:] = -1  # absent neighbours
    idx[5] = -1  # a padding row
    for scale in (1.0, 2.0**-70):
        for view in (None, torch.rand(1, 3, generator=gen, dtype=F64), torch.rand(12, 3, generator=gen, dtype=F64)):
            torch.library.opcheck(_knn_normals, (pts, idx, torch.tensor([scale], dtype=F64), view))
    assert torch.all(_knn_normals(pts, idx, torch.ones(1, dtype=F64), None)[5] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_normals_do_not_depend_on_the_clouds_scale(gen, dtype, monkeypatch):
    # a cloud times a power of two has the same normals, bit for bit, on every path and layout:
    # at scales whose squared spreads leave the dtype's range (float32 clouds of 1e-30 and 1e30,
    # float64 of 1e-160 and 1e160) the search and the covariances ran on values that under- or
    # overflowed, and every normal was wrong
    from pcops.ops.geometry import normals

    top = 127 if dtype == torch.float32 else 1023
    base = plane(gen, 60)[0].to(dtype)
    view = torch.tensor([0.4, -0.3, 2.0], dtype=dtype)
    padded, lengths = torch.stack([base, base.flip(0)]), torch.tensor([60, 41])
    packed, batch = torch.cat([base, base[:37]]), torch.tensor([0] * 60 + [1] * 37)
    cases = {
        "plain": lambda s: (base * s, 7, {}),
        "oriented": lambda s: (base * s, 7, dict(orient_to=view * s)),
        "padded": lambda s: (torch.where(torch.arange(60)[:, None] < lengths[:, None, None], padded * s, 1e30 if s < 1 else 1e-30), 7,
                             dict(lengths=lengths)),  # padding rows of another scale
        "packed": lambda s: (packed * s, 7, dict(batch=batch)),
    }
    exponents = (-100, -3, 0, 60, 100) if dtype == torch.float32 else (-1000, -531, -60, 0, 60, 531, 1000)
    assert 2 * max(exponents) > top and 2 * min(exponents) < -top  # squares beyond the dtype's range
    for name, case in cases.items():
        for plain in (True, False):
            monkeypatch.setattr(normals, "PLAIN", [plain])
            for grad in (False, True):
                want = None
                for e in exponents:
                    points, k, kw = case(2.0**e)
                    assert torch.isfinite(points).all()
                    got = pcops.estimate_normals(points.clone().requires_grad_(grad), k, **kw).detach()
                    if want is None:  # the smallest scale's: the plane's normal up to sign (zeros: padding)
                        want, rows = got, got.reshape(-1, 3).double()
                        rows = rows[rows.abs().sum(1) > 0]
                        assert len(rows) == {"padded": 60 + 41, "packed": 60 + 37}.get(name, 60)
                        assert ((rows @ plane(torch.Generator(), 1)[1]).abs() - 1).abs().max() < 1e-5
                    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} plain={plain} grad={grad} 2^{e}")


def test_nan_points_without_validation_do_not_set_the_scale(gen, monkeypatch):
    # the scale is the largest finite coordinate's: a NaN or inf point (validate=False) leaves
    # the other points' normals those of the unit-scale cloud, on both paths
    from pcops.ops.geometry import normals

    base = plane(gen, 60)[0].float()
    for bad in (float("nan"), float("inf")):
        for plain in (True, False):
            monkeypatch.setattr(normals, "PLAIN", [plain])
            got = []
            for e in (0, 100):
                points = base * 2.0**e
                points[0, 1] = bad
                got.append(pcops.estimate_normals(points, 7, validate=False)[1:])
            torch.testing.assert_close(got[1], got[0], rtol=0, atol=0, msg=f"{bad} plain={plain}")


def test_orient_to_a_point_flips_towards_it(gen):
    pts, normal = plane(gen)
    above = pcops.estimate_normals(pts, 8, orient_to=torch.tensor([0.0, 0.0, 5.0], dtype=F64))
    below = pcops.estimate_normals(pts, 8, orient_to=torch.tensor([0.0, 0.0, -5.0], dtype=F64))
    torch.testing.assert_close(above @ normal, torch.ones(len(pts), dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(below, -above, rtol=0, atol=0)


def test_sphere_normals_are_radial_and_point_inwards_to_the_centre(gen):
    pts, radial, centre = sphere(gen)
    n = pcops.estimate_normals(pts, 10, orient_to=centre)
    cos = (n * radial).sum(1)
    assert cos.max() < 0  # towards the centre
    angle = torch.rad2deg(torch.acos((-cos).clamp(max=1)))
    assert angle.median() < 2.0 and angle.max() < 10.0  # curvature bias of one-sided random neighbourhoods


def test_noisy_plane_is_close_to_the_analytic_normal(gen):
    pts, normal = plane(gen, n=3000, noise=0.005)
    n = pcops.estimate_normals(pts, 30)
    angle = torch.rad2deg(torch.acos((n @ normal).abs().clamp(max=1)))
    assert angle.median() < 2.0 and angle.max() < 10.0


def test_unoriented_sign_rule_largest_component_positive(gen):
    pts, _, _ = sphere(gen, n=300)
    n = pcops.estimate_normals(pts, 8)
    assert torch.all(n.gather(1, n.abs().argmax(1, keepdim=True)) > 0)


@pytest.mark.parametrize("backend", ["warp", "scipy", "torch"])
@pytest.mark.parametrize("kind", CLOUDS)
def test_matches_the_float64_reference_up_to_sign(gen, backend, kind):
    _, p, _ = cloud(kind, gen)
    n = pcops.estimate_normals(p, 9, backend=backend)
    ref, values = reference.normals(p, 9)
    # defined where the smallest eigenvalue is simple (in the duplicates cloud a point and its
    # copies fill 3 of the 9 places: some neighbourhoods hold only two distinct points)
    ok = values[:, 1] - values[:, 0] > 1e-9 * values[:, 2]
    assert ok.float().mean() > 0.3
    torch.testing.assert_close((n * ref).sum(1).abs()[ok], torch.ones(int(ok.sum()), dtype=F64), rtol=0, atol=1e-8)


def test_matches_open3d_where_installed(gen):
    o3d = pytest.importorskip("open3d", reason="open3d is not installed or does not load here", exc_type=ImportError)
    pts, _, _ = sphere(gen, n=1000)
    pc = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(pts.numpy()))
    pc.estimate_normals(o3d.geometry.KDTreeSearchParamKNN(12))
    theirs = torch.from_numpy(__import__("numpy").asarray(pc.normals))
    ours = pcops.estimate_normals(pts, 12)
    torch.testing.assert_close((ours * theirs).sum(1).abs(), torch.ones(len(pts), dtype=F64), rtol=0, atol=1e-6)


def _batch(gen):
    pts = torch.rand(4, 9, 3, generator=gen, dtype=F64)
    return pts, torch.tensor([9, 0, 5, 2])  # an empty sample and one smaller than k


def test_padded_and_packed_equal_a_loop(gen):
    pts, lengths = _batch(gen)
    k = 4
    view = torch.rand(4, 3, generator=gen, dtype=F64) * 4 - 2
    out = pcops.estimate_normals(pts, k, lengths=lengths, orient_to=view)
    rows, ids, expected = [], [], []
    for b, n in enumerate(lengths.tolist()):
        if n:
            expected.append(pcops.estimate_normals(pts[b, :n], min(k, n), orient_to=view[b]))
            torch.testing.assert_close(out[b, :n], expected[-1])
        assert torch.all(out[b, n:] == 0)
        rows += [pts[b, i] for i in range(n)]
        ids += [b] * n
    perm = torch.randperm(len(rows), generator=gen)
    packed = torch.stack(rows)[perm]
    batch = torch.tensor(ids)[perm]
    out = pcops.estimate_normals(packed, k, batch=batch, orient_to=view)
    torch.testing.assert_close(out, torch.cat(expected)[perm])


def test_gradcheck(gen):
    pts, _ = plane(gen, n=30, noise=0.05)
    pts.requires_grad_()
    view = torch.tensor([0.0, 0.0, 3.0], dtype=F64)
    assert torch.autograd.gradcheck(lambda p: pcops.estimate_normals(p, 6, orient_to=view), (pts,))


def test_gradcheck_padded_batch(gen):
    pts = torch.rand(2, 8, 3, generator=gen, dtype=F64).requires_grad_()
    lengths = torch.tensor([8, 6])
    assert torch.autograd.gradcheck(lambda p: pcops.estimate_normals(p, 5, lengths=lengths), (pts,))


def test_gradient_is_finite_on_a_regular_grid(gen):
    # every neighbourhood of a square grid is symmetric: the two larger eigenvalues are equal
    g = torch.arange(6, dtype=F64)
    pts = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    pts = torch.cat([pts, torch.zeros(len(pts), 1, dtype=F64)], 1).requires_grad_()
    n = pcops.estimate_normals(pts, 5, orient_to=torch.tensor([0.0, 0.0, 1.0], dtype=F64))
    torch.testing.assert_close(n, torch.tensor([0.0, 0.0, 1.0], dtype=F64).expand_as(n), rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad((n * torch.randn(n.shape, generator=gen, dtype=F64)).sum(), pts)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(gen, dtype):
    pts, normal = plane(gen)
    n = pcops.estimate_normals(pts.to(dtype), 8)
    assert n.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((n.double() @ normal).abs() - 1).abs().max() < tol


def _bad():
    p = torch.rand(10, 3)
    nan = p.clone()
    nan[3, 1] = float("nan")
    return [
        (lambda: pcops.estimate_normals(p, 11), ValueError, "k must be <= the number of points"),
        (lambda: pcops.estimate_normals(p, 0), ValueError, "k must be >= 1"),
        (lambda: pcops.estimate_normals(p, 3.0), TypeError, "k must be an int"),
        (lambda: pcops.estimate_normals(p[:, :2], 3), ValueError, "points must be a tensor of shape"),
        (lambda: pcops.estimate_normals(p.long(), 3), TypeError, "points"),
        (lambda: pcops.estimate_normals(nan, 3), ValueError, "contains NaN"),
        (lambda: pcops.estimate_normals(p, 3, orient_to=torch.zeros(2)), ValueError, "orient_to must be a tensor of shape"),
        (lambda: pcops.estimate_normals(p, 3, orient_to=torch.zeros(2, 3)), ValueError, "orient_to"),
        (lambda: pcops.estimate_normals(p[None], 3, lengths=torch.tensor([11])), ValueError, "lengths values"),
        (lambda: pcops.estimate_normals(p[None], 3, lengths=torch.tensor([1.0])), TypeError, "lengths"),
        (lambda: pcops.estimate_normals(p, 3, batch=torch.zeros(9, dtype=torch.int64)), ValueError, "batch must be a tensor of shape"),
        (lambda: pcops.estimate_normals(p, 3, batch=torch.full((10,), -1)), ValueError, "batch values must be >= 0"),
        (lambda: pcops.estimate_normals(p, 3, batch=torch.ones(10, dtype=torch.int64), orient_to=torch.zeros(1, 3)), ValueError, "batch values"),
        (lambda: pcops.estimate_normals(p[None], 3, batch=torch.zeros(10, dtype=torch.int64)), ValueError, "padded"),
    ]


@pytest.mark.parametrize("call,error,match", _bad())
def test_bad_input_raises_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


class _Normals(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.move = torch.nn.Linear(3, 3)

    def forward(self, query, ref):
        moved = self.move(ref)
        n = pcops.estimate_normals(query, 6, orient_to=moved.mean(0))
        padded = pcops.estimate_normals(torch.stack([moved, moved.flip(0)]), 5, lengths=torch.tensor([ref.shape[0], ref.shape[0] - 4]))
        return n.sum(0) + padded.sum((0, 1))


def test_compile_fullgraph_matches_eager_without_recompiling_per_size(gen):
    assert_compiles_like_eager(_Normals(), [(30, 50), (45, 80)], gen)


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    pts, normal = plane(gen, n=2000, noise=0.01)
    view = torch.tensor([0.0, 0.0, 5.0], dtype=F64)
    out = pcops.estimate_normals(pts.cuda(), 12, orient_to=view.cuda())
    torch.testing.assert_close(out.cpu(), pcops.estimate_normals(pts, 12, orient_to=view), rtol=1e-9, atol=1e-9)
