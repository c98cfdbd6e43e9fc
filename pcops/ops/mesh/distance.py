"""Distance and signed distance from points to triangle meshes, with closest points, faces and
barycentric coordinates; a mesh's hierarchy built once (:func:`mesh_bvh`) serves many queries.

For a query p and the faces t of its mesh, with dist(p, t) the Euclidean distance from p to
the triangle t (its interior, edges and corners):

    face[p]    = the t with the smallest dist(p, t); ties (faces that share the closest edge or
                 corner, distances equal to rounding) by the smaller index; -1 when no face is
                 within ``max_dist``
    dists[p]   = dist(p, face[p]); with ``signed=True`` negative inside, inside meaning a
                 generalised winding number w(p) >= 1/2 (Jacobson et al. 2013): right on open,
                 non-manifold and self-intersecting meshes, where ray parity and normal tests
                 flip; +-inf (by the sign) beyond ``max_dist``
    closest[p] = the point of face[p] nearest to p, bary[p] its barycentric weights (NaN
                 beyond ``max_dist``)

The search (Warp, :mod:`._search`) returns the face; distance, closest point and weights are
computed from it in torch (:mod:`._triangle`), so they are differentiable with respect to the
points and the vertices, to any order (eikonal losses take gradients of gradients). A call
with no gradient to keep (``torch.no_grad()``, or inputs that do not require grad) computes the
closest point and weights with the same formula in one Warp kernel instead. The
winding number is the hierarchical fast winding number (Barill et al. 2018), or on closed
meshes the side of the closest face where no other face crosses it, else the faces crossed
from a face's centroid (:mod:`._sides`),
and on an open mesh kept as a :class:`MeshBVH`, the side on the mesh closed by caps over its
holes less the caps' own winding number (:mod:`._caps`), for queries nearer the mesh than a
tenth of its radius (farther ones are walked where their face's side does not decide); the sign agrees with the exact
winding number wherever |w - 1/2| >= 0.1. Degenerate faces (zero area, repeated
corners) are measured by their edges, exactly, without a repair step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ... import _threads, _validate, _vml
from ... import _layout
from . import _search, _sides, _tree, _triangle


class MeshBVH(NamedTuple):
    """A mesh (or a batch of meshes) with its bounding volume hierarchy, from :func:`mesh_bvh`.

    Pass it as ``vertices`` of :func:`mesh_distance` to query one mesh many times (its faces
    must then be None): the hierarchy is built once. ``vertices`` keep their autograd graph;
    build a new one when they change.
    """

    vertices: torch.Tensor  # (V, 3) flat
    faces: torch.Tensor  # (F, 3) int64 rows of ``vertices``
    face_group: torch.Tensor  # (F,) int64 sample ids
    tree: _tree.Tree
    batch: int  # B of padded meshes, -1 packed, 0 one mesh
    face_rows: int  # F of padded meshes, else 0

    @property
    def layout(self) -> _layout.FlatMesh:
        return _layout.FlatMesh(self.vertices, self.faces, self.face_group, self.batch, self.face_rows)


class MeshDistance(NamedTuple):
    """Result of :func:`mesh_distance`: ``dists`` (...), ``closest`` (..., 3), ``face`` (...) int64,
    ``bary`` (..., 3)."""

    dists: torch.Tensor
    closest: torch.Tensor
    face: torch.Tensor
    bary: torch.Tensor


def _build(flat: _layout.FlatMesh, dtype: Optional[torch.dtype] = None, winding: bool = True) -> MeshBVH:
    """The hierarchy of the flat mesh, searched in ``dtype`` (default: the vertices' compute
    dtype); ``winding=False``: for unsigned searches only (without the winding number's data)."""
    dtype = dtype or _validate.compute_dtype(flat.vertices)[0]
    tree = _search.tree(flat.vertices.to(dtype), flat.faces, flat.face_group, one=flat.batch == 0, winding=winding)
    return MeshBVH(flat.vertices, flat.faces, flat.face_group, tree, flat.batch, flat.face_rows)


@_threads.limits
def mesh_bvh(vertices: torch.Tensor, faces: torch.Tensor, *, vertices_lengths: Optional[torch.Tensor] = None,
             faces_lengths: Optional[torch.Tensor] = None, vertices_batch: Optional[torch.Tensor] = None,
             validate: bool = True) -> MeshBVH:
    """A mesh's bounding volume hierarchy, built once for many :func:`mesh_distance` queries.

    Args:
        vertices: (V, 3) one mesh; (B, V, 3) padded; or (V_total, 3) packed with ``vertices_batch``.
        faces: int (F, 3) vertex indices; (B, F, 3) padded (indices local to each mesh); or
            (F_total, 3) into the packed vertices.
        vertices_lengths, faces_lengths: optional int (B,) of padded meshes; faces past a
            mesh's length are padding, whatever they hold.
        vertices_batch: int (V_total,) sample ids of packed vertices (a face's sample is its
            vertices').
        validate: check vertices for NaN/inf and indices, lengths and ids for range (one host read).

    Returns:
        MeshBVH, to pass as ``vertices`` of :func:`mesh_distance`. It is searched in its
        vertices' dtype (float32 for float32 or half vertices): build it from float64 vertices
        for float64 queries to be searched in float64, as :func:`mesh_distance` does with a mesh.

    Example:
        >>> import torch, pcops
        >>> vertices = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
        >>> bvh = pcops.mesh_bvh(vertices, torch.tensor([[0, 1, 2]]))
        >>> pcops.mesh_distance(torch.tensor([[0.2, 0.2, 1.0]]), bvh).dists
        tensor([1.])
    """
    checks = _validate.checks(validate)
    flat = _layout.mesh(vertices, faces, vertices_lengths=vertices_lengths, faces_lengths=faces_lengths,
                        vertices_batch=vertices_batch, checks=checks)
    if checks is not None:
        checks.run()
    return _build(flat)


@_threads.limits
def mesh_distance(
    points: torch.Tensor,
    vertices,
    faces: Optional[torch.Tensor] = None,
    *,
    signed: bool = False,
    max_dist: Optional[float] = None,
    points_lengths: Optional[torch.Tensor] = None,
    points_batch: Optional[torch.Tensor] = None,
    vertices_lengths: Optional[torch.Tensor] = None,
    faces_lengths: Optional[torch.Tensor] = None,
    vertices_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> MeshDistance:
    """The distance from each point to its mesh, with the closest point, face and barycentric weights.

    Args:
        points: (M, 3) for one mesh; (B, M, 3) padded for padded meshes; (M_total, 3) packed
            with ``points_batch`` for packed meshes.
        vertices: the mesh's vertices (see :func:`mesh_bvh` for the layouts), or a
            :class:`MeshBVH` built once (then ``faces`` and the mesh's batch keywords are None).
        faces: int vertex indices (F, 3), (B, F, 3) or (F_total, 3).
        signed: negative inside the mesh (generalised winding number >= 1/2).
        max_dist: a band: points farther than this from every face get face -1, distance
            +inf (or -inf inside when signed) and NaN closest points; None for no band.
        points_lengths: optional int (B,) of padded points (rows past a length: face -1).
        points_batch: int (M_total,) sample ids of packed points.
        vertices_lengths, faces_lengths, vertices_batch: the mesh's layout, as in :func:`mesh_bvh`.
        validate: check every input for NaN/inf and range (one host read).

    Returns:
        MeshDistance(dists, closest, face, bary): ``dists`` (M,) / (B, M) Euclidean (not
        squared); ``closest`` and ``bary`` (..., 3); ``face`` int64 rows of ``faces`` (per mesh
        for padded meshes, into the packed faces for packed ones). Float dtype of the points
        and vertices (float16/bfloat16 computed in float32); differentiable with respect to
        ``points`` and ``vertices``, to any order.

    Example:
        >>> import torch, pcops
        >>> vertices = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
        >>> faces = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])  # a tetrahedron
        >>> out = pcops.mesh_distance(torch.tensor([[0.1, 0.1, 0.1], [2.0, 0.0, 0.0]]), vertices, faces, signed=True)
        >>> out.dists
        tensor([-0.1000,  1.0000])
        >>> out.face
        tensor([0, 0])
    """
    _validate.flag(signed=signed, validate=validate)
    max_dist = _validate.plain(max_dist)
    if max_dist is not None:
        _validate.positive_number("max_dist", max_dist)
    checks = _validate.checks(validate)
    if isinstance(vertices, MeshBVH):
        if faces is not None or vertices_lengths is not None or faces_lengths is not None or vertices_batch is not None:
            raise ValueError("a MeshBVH holds its faces and layout: pass faces, vertices_lengths, faces_lengths and vertices_batch to mesh_bvh")
        flat = vertices.layout
        bvh = vertices
    else:
        if faces is None:
            raise TypeError("mesh_distance needs faces (or a MeshBVH from pcops.mesh_bvh as vertices)")
        flat = _layout.mesh(vertices, faces, vertices_lengths=vertices_lengths, faces_lengths=faces_lengths,
                            vertices_batch=vertices_batch, checks=checks)
        bvh = None
    query = _layout.mesh_points("points", points, flat, lengths=points_lengths, batch=points_batch, checks=checks)
    if checks is not None:
        _layout.points_have_meshes(checks, query, flat)
        checks.run()
    kept = bvh is not None
    if bvh is None:  # searched in the points' and vertices' promoted dtype: float64 points, a float64 search
        bvh = _build(flat, _validate.compute_dtype(query.points, flat.vertices)[0], winding=signed)
    return _distance(query, bvh, signed, float("inf") if max_dist is None else max_dist, validate and checks is None, kept)


def _distance(query: _layout.FlatPoints, bvh: MeshBVH, signed: bool, max_dist: float, validate: bool, kept: bool = False) -> MeshDistance:
    """``kept``: ``bvh`` is the caller's, queried again later (its sign analysis is kept)."""
    dtype, out_dtype = _validate.compute_dtype(query.points, bvh.vertices)
    search = query.points.to(bvh.tree.a.dtype)
    if signed:  # the mesh's closedness and analysis (:mod:`._sides`), and the search's wider band for it
        padding = bvh.batch + 1 if bvh.batch > 0 else None
        closed, simple, capped = _sides.analysis(bvh.vertices, bvh.faces, bvh.face_group, padding, bvh.tree, search.shape[0], kept,
                                                 one=bvh.batch == 0)
    # (the band of the faces the sides compare, widened by the worst shape factor on analysed (closed) meshes only)
    face, rows, rival = _search.closest(search, query.group, bvh.tree, max_dist, validate, shape=closed[1] * simple[0] if signed else None,
                                        one=bvh.batch == 0)
    found = face >= 0
    p = query.points.to(dtype)
    if _threads.differentiable(p, bvh.vertices):
        dists, on, closest, bary, normal_part = _measured(p, bvh, face, dtype)
    else:  # nothing to differentiate: the same formulas in one kernel
        dists, closest, bary = _triangle.measure(p, bvh.vertices.to(dtype), bvh.faces, face)
        on, normal_part = None, None
    sign = torch.ones_like(dists)
    if signed:
        reach = torch.where(found if on is None else found & ~on, dists, 0)  # the distances to the mesh known so far
        known = _sides.known(search, face, rival, bvh.vertices, bvh.faces, closed, simple, capped, bvh.tree.scale, reach, bvh.tree.radius)
        sign = torch.where(_search.winding(search, query.group, bvh.tree, rows, reach, closed, known) >= 0.5, -1.0, 1.0).to(dtype)
        dists = dists * sign
    if on is not None:
        dists = torch.where(on, normal_part, dists)
        dists = torch.where(found, dists, sign * float("inf"))
        closest = torch.where(found[:, None], closest, float("nan"))
        bary = torch.where(found[:, None], bary, float("nan"))
    face = _layout.local_faces(bvh.layout, face)
    shape = query.batch_shape
    out = lambda t: (t.reshape(*shape, *t.shape[1:]) if shape else t)  # noqa: E731
    return MeshDistance(out(dists.to(out_dtype)), out(closest.to(out_dtype)), out(face), out(bary.to(out_dtype)))


def _measured(p: torch.Tensor, bvh: MeshBVH, face: torch.Tensor, dtype):
    """(unsigned distances, on the surface, closest points, weights, the normal's component of
    p - closest) of points p to their faces in torch operations: differentiable to any order
    (:func:`._triangle.measure` is the same without gradients)."""
    corners = bvh.vertices.to(dtype).index_select(0, bvh.faces.index_select(0, face.clamp(min=0)).reshape(-1)).view(-1, 3, 3)
    a, b, c = corners.unbind(1)
    near = _triangle._closest_torch(p, a, b, c)  # (only called where a derivative may be asked for)
    diff = p - near.point
    wide = _triangle.PLANE  # (a thin face's normal, see _triangle)
    normal = near.normal / _vml.root(near.normal.square().sum(-1, keepdim=True)).clamp_min(torch.finfo(wide).tiny)
    # A closest point inside a face (every weight > 0): the distance is the height over its plane,
    # whose gradient is the unit normal however close the point (p - near is rounding noise
    # there). Exactly on the surface: measured along the normal (by the vertex order): value 0,
    # first derivative that normal, second 0, where the norm's are 0 and NaN.
    on = (diff == 0).all(-1)
    height = ((p.to(wide) - a.to(wide)) * normal).sum(-1).to(dtype)
    planar = (near.bary > 0).all(-1)
    dists = torch.where(planar, height * torch.where(height >= 0, 1.0, -1.0),
                        _vml.root(torch.where(on[:, None], 1.0, diff).square().sum(-1)))  # (IEEE's roots, as the kernel's)
    return dists, on, near.point, near.bary, (diff.to(wide) * normal).sum(-1).to(dtype)


__all__ = ["MeshBVH", "MeshDistance", "mesh_bvh", "mesh_distance"]
