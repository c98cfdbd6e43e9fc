"""The level set of a dense grid of values as a triangle mesh (marching cubes), differentiable in the values.

For a grid ``values[i, j, k]`` sampled at ``origin + voxel_size * (i, j, k)`` (``torch.meshgrid(...,
indexing="ij")`` order, scikit-image's) and a ``level``:

    a corner is above the level where values > level, at or below it where values <= level
        (scikit-image's rule: a value equal to the level puts its vertices on that corner once,
        not once per edge it shares with corners below)
    a vertex lies on each grid edge (i, j, k) -> (i, j, k) + e_axis whose two corners are on
        either side, at t = (level - values[start]) / (values[end] - values[start]) along it:
        the linear interpolation of scikit-image's and PyTorch3D's marching cubes; one vertex
        per edge (vertices are not repeated between the cells that share an edge)
    each cell (2 x 2 x 2 corners) holds the triangles of its corners' configuration, derived in
        :mod:`._cubes`: on an ambiguous cell face the corners at or below the level are joined (a
        rule of the face alone, so that the cells' triangles meet without cracks), and no
        triangle edge lies in a cell face unless it is a contour segment (every mesh edge has
        two faces); each triangle's normal (v1 - v0) x (v2 - v0) points towards increasing values

so where the level set is closed inside the grid, the mesh is a closed, consistently oriented
manifold: the zero level set of a signed distance (negative inside) has outward normals and a
positive volume. Vertices are ordered by their edge (sample, i, j, k, axis), faces by their
cell (sample, i, j, k); both are the same on every device.

The custom op ``pcops::marching_cubes`` finds the crossing edges and the triangles (integer
results whose number depends on the data, declared as dynamic sizes in its fake); the vertices'
positions are computed from their edges' two values in torch, so they are differentiable with
respect to ``values`` (the faces are piecewise constant in them, as the case table is).

Bounded form (``max_vertices=V``, ``max_faces=F``): the op's sizes follow from the grid's shape
and the bounds alone, so default ``torch.compile`` keeps the call in one graph. Each sample's
first min(count, V) vertices and min(count, F) faces are kept, padded with zero vertices and
-1 faces; the true counts come back as ``vertices_lengths`` and ``faces_lengths`` (on overflow,
a count above its bound, the mesh is cut: a kept face that uses a dropped vertex is -1).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from ... import _layout, _threads, _validate
from .. import _bound
from . import _cubes


class MarchingCubes(NamedTuple):
    """Result of :func:`marching_cubes`: ``vertices`` (V, 3), ``faces`` (F, 3) int64 rows of the
    vertices; for a batch of grids the meshes packed, with ``vertices_batch`` (V,) and
    ``faces_batch`` (F,) int64 sample ids (None for one grid)."""

    vertices: torch.Tensor
    faces: torch.Tensor
    vertices_batch: Optional[torch.Tensor] = None
    faces_batch: Optional[torch.Tensor] = None


class MarchingCubesPadded(NamedTuple):
    """Result of :func:`marching_cubes` with ``max_vertices`` and ``max_faces``: ``vertices``
    (..., max_vertices, 3), zero past each mesh's count; ``faces`` (..., max_faces, 3) int64,
    indices local to each mesh, -1 past its count; ``vertices_lengths`` and ``faces_lengths``
    (...) int64, the true counts (may exceed the bounds)."""

    vertices: torch.Tensor
    faces: torch.Tensor
    vertices_lengths: torch.Tensor
    faces_lengths: torch.Tensor


# Edge e of a cell (see ._cubes): its start corner and its axis.
_EDGE_START = [_cubes.edge_corners(e)[0] for e in range(12)]
_EDGE_AXIS = [e // 4 for e in range(12)]


def _cases(above: torch.Tensor) -> torch.Tensor:
    """(B, D, H, W) bool -> (B, D-1, H-1, W-1) uint8: bit i + 2 j + 4 k set where the cell's
    corner at offset (i, j, k) is above the level."""
    a = above.view(torch.uint8)  # bools as 0 / 1 bytes: no copy
    a = torch.add(a[:, :-1], a[:, 1:], alpha=2)  # the bits never overlap: one add per axis
    a = torch.add(a[:, :, :-1], a[:, :, 1:], alpha=4)
    return torch.add(a[:, :, :, :-1], a[:, :, :, 1:], alpha=16)


def below(level: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` at or below ``level``: a value of that dtype is above it
    exactly where it is above ``level`` (``values > level`` would round the level to the dtype
    first: a float32 1.0 is not above the level 0.99999999999 there)."""
    if dtype == torch.float64:
        return level
    kind = np.float16 if dtype == torch.float16 else np.float32  # (the grid's compute dtypes: float32, float64)
    with np.errstate(over="ignore"):  # (a level beyond the dtype: inf, then its largest value)
        t = kind(level)
        if float(t) > level:
            t = np.nextafter(t, kind(-math.inf))
    return float(t)


def _cells(values: torch.Tensor, level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The cells the level set crosses: (corner 0's flat index into ``values``, case), each (A,)
    int64, in flat order."""
    b, d, h, w = values.shape
    case = _cases(values > below(level, values.dtype))
    cell = ((case - 1) < 254).view(-1).nonzero().squeeze(1)  # neither 0 nor 255 (uint8: 0 - 1 wraps to 255)
    k = cell % (w - 1)
    rest = cell // (w - 1)
    j = rest % (h - 1)
    rest = rest // (h - 1)
    i = rest % (d - 1)
    sample = rest // (d - 1)
    return ((sample * d + i) * h + j) * w + k, case.view(-1)[cell].to(torch.int64)


def _mesh(values: torch.Tensor, level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """values (B, D, H, W) -> (crossing edges' keys (V,) in increasing order, faces (F, 3) rows
    of the keys); an edge's key is 3 * (the flat index of its start corner) + its axis."""
    b, d, h, w = values.shape
    device = values.device
    if min(d, h, w) < 2 or b == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty.reshape(0, 3)
    corner, case = _cells(values, level)
    triangles, count = _cubes.table(device)
    n = count[case]
    edges = triangles[case][torch.arange(_cubes.MAX_TRIANGLES, device=device) < n[:, None]]  # (F, 3) edge ids
    starts = torch.tensor([(o[0] * h + o[1]) * w + o[2] for o in map(_cubes.corner_offset, _EDGE_START)], device=device)
    axes = torch.tensor(_EDGE_AXIS, device=device)
    keys = 3 * (corner.repeat_interleave(n)[:, None] + starts[edges]) + axes[edges]
    unique, faces = torch.unique(keys.view(-1), sorted=True, return_inverse=True)
    return unique, faces.view(-1, 3)


def _per_sample(sample: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (b,), each row's index within its sample) of rows ordered by ``sample``."""
    count = torch.zeros(b, dtype=torch.int64, device=sample.device).index_add_(0, sample, torch.ones_like(sample))
    first = torch.cumsum(count, 0) - count
    return count, torch.arange(sample.shape[0], device=sample.device) - first[sample]


@_threads.custom_op("pcops::marching_cubes", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _marching_cubes(
    values: torch.Tensor, level: float, max_vertices: int = -1, max_faces: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """values (B, D, H, W) -> (edges (V, 2) int64: the flat indices of each vertex's two corners,
    start then end; faces (F, 3) int64 rows of the edges; vertex and face counts (B,) int64).

    With bounds (both >= 1): edges (B * max_vertices, 2) and faces (B * max_faces, 3), sample s's
    rows s * max ... s * max + count - 1 (cut at the bound), faces local to the sample, -1
    padding (a face that uses a cut vertex is -1 too); the counts are not cut."""
    b, d, h, w = values.shape
    keys, faces = _mesh(values, level)
    start = keys // 3
    stride = torch.tensor([h * w, w, 1], device=values.device)
    edges = torch.stack([start, start + stride[keys % 3]], 1)
    vertex_sample = start // max(d * h * w, 1)
    face_sample = vertex_sample[faces[:, 0]]
    vertex_count, vertex_at = _per_sample(vertex_sample, b)
    face_count, face_at = _per_sample(face_sample, b)
    if max_vertices < 0:
        return edges, faces, vertex_count, face_count
    first = torch.arange(keys.shape[0], device=keys.device) - vertex_at  # each vertex's sample's first row
    faces = faces - first[faces[:, :1]]  # local to each sample
    faces = torch.where((faces < max_vertices).all(1, keepdim=True), faces, -1)
    kept = vertex_at < max_vertices
    out_edges = edges.new_full((b * max_vertices, 2), -1)
    out_edges[(vertex_sample * max_vertices + vertex_at)[kept]] = edges[kept]
    kept = face_at < max_faces
    out_faces = faces.new_full((b * max_faces, 3), -1)
    out_faces[(face_sample * max_faces + face_at)[kept]] = faces[kept]
    return out_edges, out_faces, vertex_count, face_count


@_marching_cubes.register_fake
def _(values, level, max_vertices=-1, max_faces=-1):
    b = values.shape[0]
    if max_vertices < 0:
        ctx = torch.library.get_ctx()
        v, f = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    else:
        v, f = b * max_vertices, b * max_faces
    like = values.new_empty((0,), dtype=torch.int64)
    return like.new_empty((v, 2)), like.new_empty((f, 3)), like.new_empty((b,)), like.new_empty((b,))


def _positions(grid: _layout.Grid, edges: torch.Tensor, level: float, padded: bool) -> torch.Tensor:
    """The vertices on ``edges`` (R, 2) (-1 rows: padding, zero vertices), differentiable in the
    values; measured in float64 (a float32 grid's ``values[end] - values[start]`` overflows from
    about 1.7e38, and the level is then not rounded to float32), returned in float64."""
    values = grid.values
    _, d, h, w = values.shape
    start, end = edges.unbind(1)
    real = start >= 0
    if padded:
        start, end = start.clamp(min=0), end.clamp(min=0)
    flat = values.reshape(-1)
    if flat.shape[0] == 0:  # padding rows of an empty grid (a shape test, not a data read)
        flat = flat.new_zeros(1)
    low, high = flat[start].to(torch.float64), flat[end].to(torch.float64)
    across = high - low
    if padded:
        across = torch.where(real, across, 1)
    t = ((level - low) / across)[:, None]

    def index(at: torch.Tensor) -> torch.Tensor:
        at = at % max(d * h * w, 1)
        return torch.stack([at // max(h * w, 1), at // max(w, 1) % max(h, 1), at % max(w, 1)], 1).to(torch.float64)

    first = index(start)
    at = first + t * (index(end) - first)
    out = grid.origin + torch.tensor(grid.voxel_size, dtype=torch.float64, device=values.device) * at
    return torch.where(real[:, None], out, 0) if padded else out


@_threads.limits
def marching_cubes(
    volume: torch.Tensor,
    level: float = 0.0,
    *,
    origin=0.0,
    voxel_size=1.0,
    validate: bool = True,
    max_vertices: Optional[int] = None,
    max_faces: Optional[int] = None,
) -> Union[MarchingCubes, MarchingCubesPadded]:
    """The surface where ``volume`` equals ``level``, as a triangle mesh (marching cubes).

    Args:
        volume: Tensor of shape (D, H, W), or (B, D, H, W) for a batch of grids: the value at
            ``origin + voxel_size * (i, j, k)`` in ``volume[..., i, j, k]`` (the order of
            ``torch.meshgrid(x, y, z, indexing="ij")``).
        level: Python number, the value of the surface.
        origin: a number or three, or a real tensor of shape (3,) or () on ``volume``'s device
            (the vertices are then differentiable with respect to it too): the position of
            ``volume[..., 0, 0, 0]``.
        voxel_size: a number or three (> 0), the grid's step along each axis.
        validate: check the values (and a tensor origin) for NaN/inf (one host read).
        max_vertices, max_faces: optional ints >= 1, given together: bounds on each mesh's
            vertices and faces, for a result of static shape (one whole graph under
            ``torch.compile``). None: the meshes' own sizes (data-dependent).

    Returns:
        MarchingCubes(vertices, faces, vertices_batch, faces_batch): ``vertices`` (V, 3) in
        ``volume``'s dtype, on the grid edges where the values cross ``level`` (linear
        interpolation, one vertex per edge), differentiable with respect to ``volume``;
        ``faces`` (F, 3) int64, oriented so that (v1 - v0) x (v2 - v0) points towards
        increasing values: a signed distance's zero level set (negative inside) has outward
        normals. For a batch the meshes are packed (faces index the packed vertices), with
        sample ids ``vertices_batch`` (V,) and ``faces_batch`` (F,) (None for one grid): the
        packed layout of :func:`pcops.mesh_distance` and the other mesh ops. V and F depend on
        the data (dynamic sizes under ``torch.compile``).

        With ``max_vertices`` and ``max_faces``: MarchingCubesPadded(vertices, faces,
        vertices_lengths, faces_lengths), ``vertices`` (B, max_vertices, 3) and ``faces``
        (B, max_faces, 3) (no B for one grid), zero vertices and -1 faces past each mesh's
        count, faces local to each mesh; the lengths (B,) (0-dim for one grid) are the true
        counts, which may exceed the bounds: the mesh is then cut, and a kept face that uses a
        cut vertex is -1. The padded layout of the mesh ops.

    Example:
        >>> import torch, pcops
        >>> x = torch.linspace(-1, 1, 32)
        >>> sdf = torch.stack(torch.meshgrid(x, x, x, indexing="ij")).norm(dim=0) - 0.8  # a sphere
        >>> mesh = pcops.marching_cubes(sdf, 0.0, origin=-1.0, voxel_size=2 / 31)
        >>> mesh.vertices.shape, mesh.faces.shape
        (torch.Size([2904, 3]), torch.Size([5804, 3]))
        >>> round(float(mesh.vertices.norm(dim=1).mean()), 2)  # on the sphere of radius 0.8
        0.8
    """
    level = _validate.plain(level)
    _validate.finite_number("level", level)
    _validate.flag(validate=validate)
    max_vertices = _bound.bound("max_vertices", max_vertices)
    max_faces = _bound.bound("max_faces", max_faces)
    _validate.together(" (both: a padded result)", max_vertices=max_vertices, max_faces=max_faces)
    checks = _validate.checks(validate)
    grid = _layout.grid("volume", volume, origin, voxel_size, checks=checks)
    if checks is not None:
        checks.run()
    padded = max_vertices is not None
    edges, faces, vertex_count, face_count = _marching_cubes(grid.values, float(level), max_vertices or -1, max_faces or -1)
    vertices = _positions(grid, edges, float(level), padded).to(volume.dtype)
    b = grid.values.shape[0]
    if padded:
        if grid.batched:
            return MarchingCubesPadded(vertices.view(b, max_vertices, 3), faces.view(b, max_faces, 3), vertex_count, face_count)
        return MarchingCubesPadded(vertices, faces, vertex_count[0], face_count[0])
    if not grid.batched:
        return MarchingCubes(vertices, faces)
    _, d, h, w = grid.values.shape
    vertices_batch = edges[:, 0] // (d * h * w)
    return MarchingCubes(vertices, faces, vertices_batch, vertices_batch[faces[:, 0]])
