"""The mesh layout: triangle meshes and the points queried against them, checked and flattened.

Three layouts of meshes reach the mesh ops, as the point layouts of :mod:`pcops._layout.points`:

* one mesh:  vertices (V, 3), faces (F, 3)
* padded:    vertices (B, V, 3), faces (B, F, 3) with vertex indices local to each mesh, optional
  ``vertices_lengths`` and ``faces_lengths`` (B,) (PyTorch3D's padded meshes; faces past a mesh's
  length are padding, whatever they hold, e.g. -1)
* packed:    vertices (V_total, 3) with ``vertices_batch`` (V_total,) sample ids, faces
  (F_total, 3) indexing the packed vertices (PyTorch3D's packed meshes, PyTorch Geometric's
  ``pos`` / ``face`` with ``batch``); a face's sample is its vertices' sample

:func:`mesh` turns any of them into flat vertices, faces of global vertex rows and an int64
sample id per face (:class:`FlatMesh`); :func:`mesh_points` lays out the query points to match
(one cloud, padded (B, M, 3) with ``points_lengths``, packed with ``points_batch``). Face indices
are clamped into the vertices, so that unchecked bad values (``validate=False``) give
unspecified results, never a read out of bounds.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import _threads, _validate
from . import points as _points


class FlatMesh(NamedTuple):
    """One or more meshes as one flat mesh (see the module docs)."""

    vertices: torch.Tensor  # (V, 3), the caller's dtype, differentiable
    faces: torch.Tensor  # (F, 3) int64 rows of ``vertices``
    face_group: torch.Tensor  # (F,) int64 sample ids; padding faces of a padded batch: B + 1
    batch: int  # B of padded meshes; -1 for packed ones; 0 for one mesh
    face_rows: int  # F of padded meshes (face indices are local to each mesh), else 0


class FlatPoints(NamedTuple):
    points: torch.Tensor  # (M, 3)
    group: torch.Tensor  # (M,) int64; padding rows of a padded batch: B
    batch_shape: tuple  # (B, M) for padded points, () otherwise


# The largest vertex coordinate of a mesh searched in float32 (float32, float16 and bfloat16
# vertices): a triangle's squared normal grows as its edges^4 and overflows float32 from edges of
# about 1e9, which made every distance 0.
FLOAT32_EXTENT = 1e8
# ... and the smallest largest coordinate (but 0): squared distances of a mesh whose coordinates
# all lie below it are near float32's subnormals (at 1e-30 every distance read 0).
FLOAT32_LEAST = 1e-15


def _vertex_values(checks: _validate.Checks, vertices: torch.Tensor, searched: bool) -> None:
    """No NaN/inf in the vertices, and, where the mesh is ``searched`` for distances, float32
    ones' largest coordinate within :data:`FLOAT32_EXTENT` and at least :data:`FLOAT32_LEAST`
    (or 0). (A mesh only sampled takes any finite vertices: its faces' edges are taken on corners
    scaled by their mesh's power of two, and its areas in float64.)"""
    checks.finite("vertices", vertices)
    if searched and vertices.dtype != torch.float64 and vertices.numel():
        largest = vertices.detach().abs().amax()
        checks.add(largest <= FLOAT32_EXTENT, lambda: (
            f"vertices has coordinates up to {float(largest):.3g}, but a {vertices.dtype} mesh is searched in "
            f"float32, where triangles this large overflow (|coordinates| <= {FLOAT32_EXTENT:.0e}): pass float64 vertices"))
        checks.add((largest >= FLOAT32_LEAST) | (largest == 0), lambda: (
            f"vertices has coordinates only up to {float(largest):.3g}, but a {vertices.dtype} mesh is searched in float32, where "
            f"squared distances this small underflow (the largest |coordinate| >= {FLOAT32_LEAST:.0e}): pass float64 vertices"))


def _plain_values(vertices: torch.Tensor, faces64: torch.Tensor, n_vertices: int, searched: bool) -> bool:
    """Whether one mesh of a plain eager CPU call (float32 or float64 vertices) passes every value
    check of :func:`mesh`, read from the extremes of its vertices and of its faces (two
    reductions, four reads: a fraction of the checks' own cost); False for any other call and
    where a check fails, which the checks then name."""
    if vertices.dtype not in (torch.float32, torch.float64) or _threads.plain_device((vertices, faces64), None, read_only=True) != "cpu":
        return False
    low, high = torch.aminmax(vertices.detach())
    first, last = torch.aminmax(faces64)
    low, high = low.item(), high.item()
    if not (math.isfinite(low) and math.isfinite(high) and first.item() >= 0 and last.item() < n_vertices):
        return False
    if searched and vertices.dtype == torch.float32:
        largest = max(-low, high)
        return largest <= FLOAT32_EXTENT and (largest >= FLOAT32_LEAST or largest == 0)
    return True


def mesh(vertices, faces, *, vertices_lengths=None, faces_lengths=None, vertices_batch=None,
         checks: Optional[_validate.Checks] = None, searched: bool = True) -> FlatMesh:
    """The eager checks of a mesh layout, its value checks added to ``checks`` (None: no value
    checks; one plain CPU mesh's read here at once, :func:`_plain_values`, and added only where
    one fails), and the flat mesh; ``searched``: for a distance search (see :func:`_vertex_values`)."""
    _validate.tensor("vertices", vertices)
    padded = vertices.dim() == 3
    if padded:
        _validate.tensor("vertices", vertices, ndim=3, last=3, shape_doc="(B, V, 3)")
        _validate.integer("faces", faces, what="vertex indices")
        if faces.dim() != 3 or faces.shape[-1] != 3 or faces.shape[0] != vertices.shape[0]:
            raise ValueError(f"faces must be a tensor of shape (B, F, 3) for vertices of shape (B, V, 3), got faces {tuple(faces.shape)} "
                             f"and vertices {tuple(vertices.shape)}")
        if vertices_batch is not None:
            raise ValueError("vertices_batch describes packed (V, 3) vertices; padded (B, V, 3) vertices take vertices_lengths and faces_lengths")
        if vertices.shape[0] == 0:  # (as a mesh needs faces: B = 0 would read as one mesh of no faces)
            raise ValueError(f"vertices must hold at least one mesh (B >= 1) when padded (B, V, 3), got shape {tuple(vertices.shape)}")
    else:
        _validate.tensor("vertices", vertices, ndim=2, last=3, shape_doc="(V, 3) or (B, V, 3)")
        _validate.integer("faces", faces, ndim=2, last=3, shape_doc="(F, 3)", what="vertex indices")
        for name, t in (("vertices_lengths", vertices_lengths), ("faces_lengths", faces_lengths)):
            if t is not None:
                raise ValueError(f"{name} describes padded (B, V, 3) vertices; packed (V, 3) vertices take vertices_batch")
    b = vertices.shape[0] if padded else 0
    _validate.ids("vertices_lengths", vertices_lengths, b, "(B,)")
    _validate.ids("faces_lengths", faces_lengths, b, "(B,)")
    _validate.ids("vertices_batch", vertices_batch, vertices.shape[0], "(V_total,)")
    _validate.same_device(vertices=vertices, faces=faces, vertices_lengths=vertices_lengths, faces_lengths=faces_lengths,
                          vertices_batch=vertices_batch)
    n_vertices, n_faces = vertices.shape[-2], faces.shape[-2]
    if n_vertices == 0 or n_faces == 0:
        raise ValueError(f"a mesh needs vertices and faces, got {n_vertices} vertices and {n_faces} faces")
    device = vertices.device
    if not padded:
        faces64 = faces.to(torch.int64)
        # one plain CPU mesh: its values read at once (then its faces are in range: no clamp)
        plain = checks is not None and vertices_batch is None and _plain_values(vertices, faces64, n_vertices, searched)
        if checks is not None and not plain:
            _vertex_values(checks, vertices, searched)
            checks.in_range("faces", faces64, 0, n_vertices - 1)
            checks.in_range("vertices_batch", vertices_batch, 0, None)
        rows = faces64 if plain else faces64.clamp(0, n_vertices - 1)
        if vertices_batch is None:
            return FlatMesh(vertices, rows, torch.zeros(n_faces, dtype=torch.int64, device=device), 0, 0)
        ids = vertices_batch.to(torch.int64)[rows]  # (F, 3): each face's vertices' samples
        if checks is not None:
            checks.add((ids == ids[:, :1]).all(), lambda: "faces must join vertices of one sample each (vertices_batch differs within a face)")
        return FlatMesh(vertices, rows, ids[:, 0].contiguous(), -1, 0)
    valid = torch.arange(n_faces, device=device)[None, :] < (n_faces if faces_lengths is None else faces_lengths[:, None])
    faces64 = faces.to(torch.int64)
    if checks is not None:
        _vertex_values(checks, vertices, searched)
        checks.in_range("faces_lengths", faces_lengths, 1, n_faces, lambda: f"in [1, F] (every mesh needs a face; F = {n_faces})")
        checks.in_range("vertices_lengths", vertices_lengths, 1, n_vertices)
        high = n_vertices if vertices_lengths is None else vertices_lengths[:, None, None]
        ok = ((faces64 >= 0) & (faces64 < high)).all(-1) | ~valid
        checks.add(ok.all(), lambda: "faces values must be in [0, V) (vertices_lengths where given) for every face within faces_lengths")
    local = faces64.clamp(0, n_vertices - 1)
    offsets = torch.arange(b, device=device, dtype=torch.int64) * n_vertices
    rows = (local + offsets[:, None, None]).reshape(b * n_faces, 3)
    group = torch.where(valid, torch.arange(b, device=device, dtype=torch.int64)[:, None], b + 1).reshape(-1)
    return FlatMesh(vertices.reshape(b * n_vertices, 3), rows, group, b, n_faces)


def mesh_points(name: str, points, flat: FlatMesh, *, lengths=None, batch=None, lengths_name: str = "points_lengths",
                batch_name: str = "points_batch", checks: Optional[_validate.Checks] = None) -> FlatPoints:
    """The query points laid out as the mesh is: (M, 3) for one mesh, (B, M, 3) with ``lengths``
    for padded meshes, packed (M, 3) with ``batch`` for packed ones."""
    _validate.tensor(name, points)
    if flat.batch > 0:
        _validate.tensor(name, points, ndim=3, last=3, shape_doc="(B, M, 3) (the meshes are padded)")
        if points.shape[0] != flat.batch:
            raise ValueError(f"{name} and the meshes must have the same batch size B, got {points.shape[0]} and {flat.batch}")
        if batch is not None:
            raise ValueError(f"{batch_name} describes packed points; padded meshes take padded (B, M, 3) {name} with {lengths_name}")
    else:
        _validate.tensor(name, points, ndim=2, last=3, shape_doc="(M, 3)")
        if lengths is not None:
            raise ValueError(f"{lengths_name} describes padded points; pass padded (B, V, 3) vertices with them")
        if flat.batch < 0 if batch is None else flat.batch >= 0:  # (no bool against flat.batch: a SymInt under dynamic=True)
            raise ValueError(f"packed meshes (vertices_batch) and packed points ({batch_name}) go together: give both or neither")
    b = points.shape[0] if flat.batch > 0 else 0
    _validate.ids(lengths_name, lengths, b, "(B,)")
    _validate.ids(batch_name, batch, points.shape[0], "(M_total,)")
    _validate.same_device(**{name: points, lengths_name: lengths, batch_name: batch, "vertices": flat.vertices})
    if checks is not None:
        checks.finite(name, points)
        checks.in_range(lengths_name, lengths, 0, points.shape[1] if flat.batch > 0 else 0)
        checks.in_range(batch_name, batch, 0, None)
    if flat.batch > 0:
        m = points.shape[1]
        group = _points.padded_groups(b, m, lengths, b, points.device).to(torch.int64)
        return FlatPoints(points.reshape(b * m, 3), group, (b, m))
    if batch is None:
        return FlatPoints(points, torch.zeros(points.shape[0], dtype=torch.int64, device=points.device), ())
    return FlatPoints(points, batch.to(torch.int64), ())


def mesh_count(flat: FlatMesh, vertices_batch, batch_size) -> int:
    """B: 1 for one mesh, the padded batch, or packed meshes' ``batch_size`` (or largest id + 1, a host read)."""
    if flat.batch >= 0:
        if batch_size is not None:
            raise ValueError("batch_size is the number of packed meshes (vertices_batch); one mesh or padded meshes have theirs")
        return max(flat.batch, 1)
    if batch_size is not None:
        return _validate.count("batch_size", batch_size)
    _validate.compile_needs("batch_size", batch_size, "the number of packed meshes, else read from vertices_batch")
    return max(int(vertices_batch.max()) + 1, 1) if vertices_batch.numel() else 1


def every_in(checks: _validate.Checks, ids: torch.Tensor, among: torch.Tensor, message) -> None:
    """A check that every value of ``ids`` is one of ``among`` (``message(i)`` names the first that is not)."""
    ordered = torch.sort(among).values
    at = torch.searchsorted(ordered, ids).clamp(max=max(ordered.numel() - 1, 0))
    found = ordered[at] == ids if ordered.numel() else torch.zeros_like(ids, dtype=torch.bool)
    checks.add(found.all(), lambda: message(int(ids[~found].min())))


def points_have_meshes(checks: _validate.Checks, query: FlatPoints, flat: FlatMesh) -> None:
    """Packed points: a check that each point's sample has mesh faces."""
    if flat.batch < 0:
        every_in(checks, query.group, flat.face_group, lambda i: f"points_batch: sample {i} has points but no mesh faces")


def local_faces(flat: FlatMesh, face: torch.Tensor) -> torch.Tensor:
    """Face rows of the flat mesh as the caller indexes faces (per mesh for padded meshes), -1 kept."""
    if flat.batch <= 0:
        return face
    return torch.where(face >= 0, face % flat.face_rows, -1)
