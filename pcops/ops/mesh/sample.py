"""Random points on the surface of triangle meshes, area-weighted, differentiable in the vertices.

For each mesh, ``n_samples`` independent draws (PyTorch3D's ``sample_points_from_meshes``):

    face[s]    = a face of the mesh, chosen with probability area(face) / area(mesh); faces of
                 zero area are never chosen
    bary[s]    = (1 - sqrt(r1), sqrt(r1) (1 - r2), sqrt(r1) r2) for uniform r1, r2 in [0, 1):
                 uniform on the triangle (the square-root trick)
    points[s]  = bary[s, 0] v0 + bary[s, 1] v1 + bary[s, 2] v2, (v0, v1, v2) the face's corners
    normals[s] = (v1 - v0) x (v2 - v0) / |(v1 - v0) x (v2 - v0)|, the face's unit normal

The randomness is three float64 uniforms in [0, 1) per draw, (u0, r1, r2): u0 picks the face,
r1 and r2 place the point. Where they come from:

* ``seed=s`` (an int, or an integer tensor of shape () or (B,)): mesh b's seed is ``seed[b]``
  for a (B,) tensor, ``s + b`` for one seed; its draw j takes numbers 3j, 3j + 1 and 3j + 2 of
  the SplitMix64 stream keyed by that seed (a counter-based hash, computed in the kernel, the
  same on every device). Equal seeds give equal samples, a batch equals a loop over its meshes
  with their seeds, and the form compiles: no graph break under default ``torch.compile`` or
  with ``fullgraph=True``.
* ``generator=g`` (a ``torch.Generator`` on the vertices' device): ``torch.rand((B, n_samples,
  3), dtype=torch.float64, generator=g)``; reproducible, but a generator argument breaks the
  graph under ``torch.compile`` (torch 2.13).
* neither: the same draw from torch's global generator; compiles, with Inductor's own random
  numbers (compiled and eager calls then draw different numbers).

The face choice is exact integer arithmetic, so that it does not depend on the layout or the
device: each face's area (float64) becomes an integer number of units, ``round(2^32 area /
largest area of its mesh)``; the units of the meshes' faces are cumulated in int64, and draw u0
picks the face whose cumulated interval holds ``floor(u0 * total units of its mesh)``. A face
below 2^-33 of its mesh's largest (a probability below 2^-33) is never chosen, as faces of zero
area are not. The search starts from a guide table (Chen & Asau 1974: expected O(1) steps
whatever the areas). Face choices carry no gradient (they are piecewise constant in the
vertices); points and normals are differentiable with respect to the vertices through the
corners of the chosen faces, as PyTorch3D's.

Layouts (:mod:`._layout`): one mesh (V, 3) / (F, 3) gives (n_samples, ...) results; padded
(B, V, 3) / (B, F, 3) meshes with optional lengths give (B, n_samples, ...) with face indices
local to each mesh; packed (V_total, 3) vertices with ``vertices_batch`` give (B * n_samples, ...)
rows, mesh b's draws in rows b * n_samples ... (b + 1) * n_samples - 1, their sample ids in
``batch``, faces indexing the packed faces; B is ``batch_size``, or the largest id + 1 (a host
read; required under ``torch.compile``).
"""

from typing import NamedTuple, Optional

import torch
import warp as wp

from ... import _layout, _threads, _validate, _warp


class MeshSamples(NamedTuple):
    """Result of :func:`sample_points_on_mesh`: ``points``, ``bary`` and ``normals`` (..., 3),
    ``face`` (...) int64, and for packed meshes ``batch`` (B * n_samples,) int64 sample ids
    (None otherwise)."""

    points: torch.Tensor
    face: torch.Tensor
    bary: torch.Tensor
    normals: torch.Tensor
    batch: Optional[torch.Tensor] = None


# Each face's share of its mesh in integer units: 2^AREA_BITS for the mesh's largest face.
# Cumulated over at most 2^31 faces, the sums fit in int64.
AREA_BITS = 32

# SplitMix64 (Steele, Lea & Flood 2014): the increment and the two multipliers of its mix.
_GOLDEN = wp.constant(wp.uint64(0x9E3779B97F4A7C15))
_MIX1 = wp.constant(wp.uint64(0xBF58476D1CE4E5B9))
_MIX2 = wp.constant(wp.uint64(0x94D049BB133111EB))


@wp.func(module="unique")
def _mix(z: wp.uint64):
    z = (z ^ (z >> wp.uint64(30))) * _MIX1
    z = (z ^ (z >> wp.uint64(27))) * _MIX2
    return z ^ (z >> wp.uint64(31))


@wp.func(module="unique")
def _uniform(key: wp.uint64, counter: wp.int64):
    """The float64 uniform in [0, 1) number ``counter`` of the stream ``key``: 53 bits of a SplitMix64 hash."""
    h = _mix(key + wp.uint64(counter + wp.int64(1)) * _GOLDEN)
    return wp.float64(h >> wp.uint64(11)) * wp.float64(1.1102230246251565e-16)  # 2^-53


@_warp.kernels
def _draw_kernel(dtype: torch.dtype, from_seeds: bool):
    """One thread per draw ``tid`` = mesh g * n + j: its three uniforms (u0, r1, r2), from mesh g's
    seed (``from_seeds``: numbers 3j, 3j + 1, 3j + 2 of the SplitMix64 stream keyed by the mixed
    seed) or read from ``uniform``; the face whose cumulated units (``cum``, int64, the meshes'
    faces in a row) first exceed start[g] + floor(u0 * total[g]), found from the guide table's
    entry for u0 (Chen & Asau's: a face at or near the answer, expected O(1) steps on any
    distribution of areas) by a scan that ends on the exact answer; the barycentric weights
    (1 - sqrt(r1), sqrt(r1) (1 - r2), sqrt(r1) r2) in ``dtype``; the point (the weighted
    corners of the face) and the face's normal."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def draw(
        begin: int,
        n: wp.int64,
        seeds: wp.array(dtype=wp.int64),
        uniform: wp.array2d(dtype=wp.float64),
        cum: wp.array(dtype=wp.int64),
        guide: wp.array(dtype=wp.int64),
        first: wp.array(dtype=wp.int64),
        last: wp.array(dtype=wp.int64),
        total: wp.array(dtype=wp.int64),
        corners: wp.array(dtype=v),
        normals: wp.array(dtype=v),
        chosen: wp.array(dtype=wp.int64),
        bary: wp.array2d(dtype=s),
        points: wp.array(dtype=v),
        point_normals: wp.array(dtype=v),
    ):
        tid = wp.int64(wp.tid() + begin)
        g = tid // n
        u0 = wp.float64(0.0)
        r1 = wp.float64(0.0)
        r2 = wp.float64(0.0)
        if wp.static(from_seeds):
            key = _mix(wp.uint64(seeds[g]))
            j = (tid - g * n) * wp.int64(3)
            u0 = _uniform(key, j)
            r1 = _uniform(key, j + wp.int64(1))
            r2 = _uniform(key, j + wp.int64(2))
        else:
            u0 = uniform[tid, 0]
            r1 = uniform[tid, 1]
            r2 = uniform[tid, 2]
        lo = first[g]
        hi = last[g] - wp.int64(1)
        i = lo
        units = total[g]
        if units > wp.int64(0) and hi >= lo:
            target = wp.min(wp.int64(u0 * wp.float64(units)), units - wp.int64(1))
            if lo > wp.int64(0):
                target = target + cum[lo - wp.int64(1)]
            i = wp.clamp(guide[lo + wp.min(wp.int64(u0 * wp.float64(hi - lo + wp.int64(1))), hi - lo)], lo, hi)
            while i > lo and cum[i - wp.int64(1)] > target:
                i = i - wp.int64(1)
            while i < hi and cum[i] <= target:
                i = i + wp.int64(1)
        i = wp.clamp(i, wp.int64(0), wp.int64(cum.shape[0] - 1))  # in range for unchecked values
        chosen[tid] = i
        root = wp.sqrt(s(r1))
        w0 = s(1.0) - root
        w1 = root * (s(1.0) - s(r2))
        w2 = root * s(r2)
        bary[tid, 0] = w0
        bary[tid, 1] = w1
        bary[tid, 2] = w2
        points[tid] = w0 * corners[i * wp.int64(3)] + w1 * corners[i * wp.int64(3) + wp.int64(1)] + w2 * corners[i * wp.int64(3) + wp.int64(2)]
        point_normals[tid] = normals[i]

    return draw


@_threads.custom_op("pcops::mesh_sample", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _sample(area: torch.Tensor, owner: torch.Tensor, corners: torch.Tensor, normals: torch.Tensor, seeds: Optional[torch.Tensor],
            uniform: Optional[torch.Tensor], n: int, validate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """n draws per mesh on the faces of B meshes in a row: ``area`` (F,) float64 (owner (F,) int64
    their mesh, ascending), ``corners`` (F, 3, 3) and unit ``normals`` (F, 3) in the compute
    dtype; draws from ``seeds`` (B,) int64 (hashed in the kernel) or ``uniform`` (B, n, 3)
    float64. Returns points (B * n, 3), their normals (B * n, 3), chosen rows (B * n,) int64,
    weights (B * n, 3), and each mesh's total units (B,) int64 (0: no face of positive area).
    ``validate``: check the corners for NaN/inf and every mesh for a face of positive area (the
    value checks the caller could not run: under torch.compile)."""
    b = (seeds if seeds is not None else uniform).shape[0]
    device, dtype = area.device, corners.dtype
    if validate:
        _validate.finite(vertices=corners)
    meshes = torch.arange(b, device=device)
    first = torch.searchsorted(owner, meshes)
    last = torch.searchsorted(owner, meshes, right=True)
    faces = area.shape[0]
    g = owner.clamp(0, b - 1)
    if b == 1:  # one mesh: per-mesh values broadcast, no gathers
        largest = area.max().reshape(1) if faces else area.new_zeros(1)
        per_face = lambda t: t  # noqa: E731
    else:
        largest = area.new_zeros(b).scatter_reduce_(0, g, area, "amax")
        per_face = lambda t: t.index_select(0, g)  # noqa: E731
    scale = (2.0**AREA_BITS) / torch.where(largest > 0, largest, 1.0)
    cum = torch.cumsum(torch.floor(area * per_face(scale) + 0.5).to(torch.int64), 0)
    cum0 = torch.cat([cum.new_zeros(1), cum])
    start = cum0.index_select(0, first)
    total = cum0.index_select(0, last) - start
    # the guide table: bucket k of the K faces of mesh g (u0 in [k / K, (k + 1) / K)) holds the
    # last face whose interval starts in bucket k or before (O(F): a scatter and a running max)
    size = (last - first).to(torch.float64)
    bucket = torch.floor((cum0[:-1] - per_face(start)).to(torch.float64) * per_face(size / torch.where(total > 0, total, 1)))
    at = per_face(first) + torch.minimum(bucket.to(torch.int64), per_face(size.to(torch.int64) - 1).clamp_min(0))
    rows = torch.arange(faces, device=device)
    guide = torch.zeros_like(rows).scatter_reduce_(0, at.clamp(0, max(faces - 1, 0)), rows, "amax").cummax(0).values
    if validate and not bool((total > 0).all()):
        raise ValueError(_no_area(total))
    chosen = torch.empty(b * n, dtype=torch.int64, device=device)
    bary = torch.empty((b * n, 3), dtype=dtype, device=device)
    points = torch.empty((b * n, 3), dtype=dtype, device=device)
    point_normals = torch.empty((b * n, 3), dtype=dtype, device=device)
    if b * n and area.shape[0]:
        _warp.init()
        empty = lambda *shape, dtype: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731  the unused source of draws
        draws = [seeds, empty(0, 3, dtype=torch.float64)] if seeds is not None else [empty(0, dtype=torch.int64), uniform.reshape(b * n, 3)]
        args = [n, *draws, cum, guide, first, last, total, corners.reshape(-1, 3), normals, chosen, bary, points, point_normals]
        _warp.launch(_draw_kernel(dtype, seeds is not None), b * n, args, like=area)
    return points, point_normals, chosen, bary, total


def _no_area(total: torch.Tensor) -> str:
    """The message for meshes without a face of positive area (their ``total`` units 0)."""
    where = f"mesh {int((total <= 0).nonzero()[0, 0])} of {total.shape[0]}" if total.shape[0] > 1 else "the mesh"
    return f"faces must include a face of positive area in every mesh: {where} has none (zero-area faces are never sampled)"


@_sample.register_fake
def _(area, owner, corners, normals, seeds, uniform, n, validate):
    b = (seeds if seeds is not None else uniform).shape[0]
    rows = lambda *shape, dtype=corners.dtype: corners.new_empty(shape, dtype=dtype)  # noqa: E731
    return rows(b * n, 3), rows(b * n, 3), rows(b * n, dtype=torch.int64), rows(b * n, 3), rows(b, dtype=torch.int64)


def _setup(ctx, inputs, output):
    ctx.faces = inputs[2].shape[0]
    ctx.mark_non_differentiable(output[3])  # the weights are drawn, not computed from the vertices
    ctx.save_for_backward(output[2], output[3])


def _backward(ctx, grad_points, grad_normals, *_):
    """The points are the weighted corners of their faces and the normals copies of their faces':
    the gradients of the faces' corners and normals are sums over the draws of each face."""
    chosen, bary = ctx.saved_tensors
    corners = normals = None
    if grad_points is not None:
        corners = grad_points.new_zeros(ctx.faces, 3, 3).index_add(0, chosen, bary[:, :, None] * grad_points[:, None, :])
    if grad_normals is not None:
        normals = grad_normals.new_zeros(ctx.faces, 3).index_add(0, chosen, grad_normals)
    return None, None, corners, normals, None, None, None, None


_sample.register_autograd(_backward, setup_context=_setup)


def _seeds(seed, b: int, device) -> torch.Tensor:
    """The per-mesh seeds (B,) int64 on ``device`` of ``seed`` (an int, or an integer tensor of
    shape () or (B,)); an int is filled in on the device (no copy from the host)."""
    if isinstance(seed, torch.Tensor):
        _validate.integer("seed", seed, what="random seeds")
        if seed.dim() > 1 or (seed.dim() == 1 and seed.shape[0] not in (1, b)):
            raise ValueError(f"seed must be an int, a 0-d integer tensor or one seed per mesh (B,) = ({b},), got shape {tuple(seed.shape)}")
        seeds = seed.to(device=device, dtype=torch.int64).reshape(-1)
        if seed.dim() == 1 and seed.shape[0] == b:
            return seeds
    elif isinstance(seed, (int, torch.SymInt)) and not isinstance(seed, bool):
        _validate.int_option("seed", seed, -2**63, 2**63 - 1, note=" (an int64)")
        seeds = torch.full((1,), seed, dtype=torch.int64, device=device)
    else:
        raise TypeError(f"seed must be an int or an integer tensor, got {type(seed).__name__}")
    return seeds + torch.arange(b, dtype=torch.int64, device=seeds.device)  # mesh b: seed + b


def _faces(vertices: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, owner: torch.Tensor, meshes: int, real=None):
    """Per face: corners (F, 3, 3) and unit normals (F, 3) in ``dtype``, differentiable, and twice
    the area (F,) times its mesh's power of two, in float64, without a graph (NaN/inf from
    unchecked values as 0). ``owner`` (F,): each face's mesh, of ``meshes``; ``real`` (F,) bool:
    the faces that are not padding (None: all)."""
    corners = _layout.select_rows(vertices.to(dtype), rows)
    # the corners times 2^-e, 2^e the largest coordinate's power of two in the face's mesh (of its
    # real faces), before the edges are taken: the edges of huge meshes do not overflow, nor the
    # cross products of tiny ones underflow, whatever the other meshes of a batch hold, and a
    # power of two changes no bit of a unit normal or of the ratios of a mesh's areas, their only use
    face_big = torch.nan_to_num(corners.detach().abs(), 0.0, 0.0, 0.0).amax((1, 2))
    if real is not None:
        face_big = torch.where(real, face_big, 0.0)
    big = face_big.new_zeros(meshes).scatter_reduce(0, owner, face_big, "amax")
    shrink = torch.where(big > 0, torch.exp2(-torch.floor(torch.log2(big))), 1.0)[owner][:, None, None]
    edges = corners[:, 1:] * shrink - corners[:, :1] * shrink
    normal = torch.linalg.cross(edges[:, 0], edges[:, 1])
    length = torch.linalg.vector_norm(normal, dim=-1, keepdim=True)
    normals = normal / torch.where(length > 0, length, 1.0)  # zero-area faces are never chosen
    exact = edges.detach().to(torch.float64)
    area = torch.linalg.vector_norm(torch.linalg.cross(exact[:, 0], exact[:, 1]), dim=-1)
    return corners, normals, torch.nan_to_num(area, 0.0, 0.0, 0.0)


@_threads.limits
def sample_points_on_mesh(
    vertices: torch.Tensor,
    faces: torch.Tensor,
    n_samples: int,
    *,
    generator: Optional[torch.Generator] = None,
    seed=None,
    vertices_lengths: Optional[torch.Tensor] = None,
    faces_lengths: Optional[torch.Tensor] = None,
    vertices_batch: Optional[torch.Tensor] = None,
    batch_size: Optional[int] = None,
    validate: bool = True,
) -> MeshSamples:
    """Area-weighted random points on the surface of each mesh, with their faces, barycentric
    weights and face normals (PyTorch3D's ``sample_points_from_meshes``, with the face and the
    weights of each point).

    Args:
        vertices: (V, 3) one mesh; (B, V, 3) padded; or (V_total, 3) packed with ``vertices_batch``.
        faces: int (F, 3) vertex indices; (B, F, 3) padded (indices local to each mesh); or
            (F_total, 3) into the packed vertices.
        n_samples: points per mesh (>= 1).
        generator: a ``torch.Generator`` on the vertices' device to draw from (breaks the graph
            under ``torch.compile``).
        seed: an int, or an integer tensor of shape () or (B,) (a seed per mesh): mesh b's draws
            are a counter-based hash (SplitMix64) of its seed, ``seed[b]`` (one seed s: s + b), the
            same on every device. Compiles without a graph break. With neither ``seed`` nor
            ``generator``, torch's global generator.
        vertices_lengths, faces_lengths: optional int (B,) of padded meshes; faces past a
            mesh's length are padding, whatever they hold.
        vertices_batch: int (V_total,) sample ids of packed vertices, in [0, B) (a face's mesh is
            its vertices').
        batch_size: B of packed meshes; by default the largest id + 1 (a host read; required
            under ``torch.compile``).
        validate: check vertices for NaN/inf, indices, lengths and ids for range, and that each
            mesh has a face of positive area (one host read).

    Returns:
        MeshSamples(points, face, bary, normals, batch): (n_samples, ...) for one mesh,
        (B, n_samples, ...) padded, (B * n_samples, ...) packed (mesh b's rows b * n_samples
        onwards, their ids in ``batch``; None for the other layouts). ``face`` int64 rows of
        ``faces`` (per mesh for padded meshes, into the packed faces for packed ones);
        ``points``, ``bary`` and ``normals`` in the vertices' dtype (float16/bfloat16 computed in
        float32); ``points`` and ``normals`` differentiable with respect to ``vertices``.

    Example:
        >>> import torch, pcops
        >>> vertices = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
        >>> faces = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])  # a tetrahedron
        >>> out = pcops.sample_points_on_mesh(vertices, faces, 1000, seed=0)
        >>> out.points.shape, out.face.shape
        (torch.Size([1000, 3]), torch.Size([1000]))
        >>> bool(torch.allclose(out.bary.sum(-1), torch.ones(1000)))
        True
    """
    n_samples = _validate.count("n_samples", _validate.plain(n_samples))
    seed, batch_size = _validate.plain(seed), _validate.plain(batch_size)
    _validate.at_most_one(seed=seed, generator=generator)
    if generator is not None:
        _validate.instance("generator", generator, torch.Generator, "torch.Generator")
    checks = _validate.checks(validate)
    flat = _layout.mesh(vertices, faces, vertices_lengths=vertices_lengths, faces_lengths=faces_lengths,
                        vertices_batch=vertices_batch, checks=checks, searched=False)
    b = _layout.mesh_count(flat, vertices_batch, batch_size)
    device = vertices.device
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator must be on the vertices' device, got a generator on {generator.device} and vertices on {device}")
    seeds = None if seed is None else _seeds(seed, b, device)

    rows, order = flat.faces, None
    if flat.batch == 0:
        owner = torch.zeros(rows.shape[0], dtype=torch.int64, device=device)
    elif flat.batch > 0:
        owner = torch.arange(b, device=device).repeat_interleave(flat.face_rows)
    else:
        if checks is not None and batch_size is not None:
            checks.in_range("vertices_batch", vertices_batch, 0, batch_size - 1, lambda: f"in [0, batch_size) = [0, {batch_size})")
        owner, order = torch.sort(flat.face_group.clamp(0, b - 1), stable=True)
        rows = rows.index_select(0, order)
    dtype, out_dtype = _validate.compute_dtype(vertices)
    real = flat.face_group == owner if flat.batch > 0 else None  # (padding faces (faces_lengths) are never chosen)
    corners, normals, area = _faces(flat.vertices, rows, dtype, owner, b, real)
    if real is not None:
        area = torch.where(real, area, 0.0)

    uniform = None
    if seeds is None:
        uniform = torch.rand((b, n_samples, 3), dtype=torch.float64, device=device, generator=generator)
    _threads.reverse_only("sample_points_on_mesh", corners, normals)
    points, normals, chosen, bary, total = _sample(area, owner, corners, normals, seeds, uniform, n_samples, validate and checks is None)
    if checks is not None:
        checks.add((total > 0).all(), lambda: _no_area(total))
        checks.run()

    face = chosen if order is None else order.index_select(0, chosen)
    face = _layout.local_faces(flat, face)
    batch = None
    if flat.batch < 0:
        batch = torch.arange(b, device=device).repeat_interleave(n_samples)
    shape = (b, n_samples) if flat.batch > 0 else (-1,)
    out = lambda t: t.reshape(*shape, *t.shape[1:])  # noqa: E731
    return MeshSamples(out(points.to(out_dtype)), out(face), out(bary.to(out_dtype)), out(normals.to(out_dtype)), batch)


__all__ = ["MeshSamples", "sample_points_on_mesh"]
