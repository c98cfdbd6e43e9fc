"""PyTorch3D's ``point_mesh_face_distance`` on pcops' mesh search: a loss between point clouds
and triangle meshes.

For each sample b with points P_b and faces F_b, with dist(p, t) the Euclidean distance from a
point to a triangle:

    point_term_b = mean over p in P_b of  min over t in F_b of dist(p, t)^2
    face_term_b  = mean over t in F_b of  min over p in P_b of dist(p, t)^2
    loss         = mean over samples b of (point_term_b + face_term_b)

as PyTorch3D's ``point_mesh_face_distance(meshes, pcls)``, except that pcops measures every
triangle exactly where PyTorch3D measures triangles smaller than ``min_triangle_area`` (5e-3 by
default) by their edges only. Both searches run on hierarchies (:mod:`._tree`): the faces' for
the points, the points' (as faces of three equal corners) for the faces; no (P, F) matrix. The
squared distances are computed in torch from the pairs found: gradients to the points and the
vertices.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import _threads, _validate
from ... import _layout
from . import _search, _triangle


def _per_sample(ids: torch.Tensor) -> torch.Tensor:
    """For each row, how many rows share its sample id (static shapes: sorts, no unique)."""
    ordered = torch.sort(ids).values
    return torch.searchsorted(ordered, ids, right=True) - torch.searchsorted(ordered, ids)


@_threads.limits
def point_mesh_face_distance(
    points: torch.Tensor,
    vertices: torch.Tensor,
    faces: torch.Tensor,
    *,
    points_lengths: Optional[torch.Tensor] = None,
    points_batch: Optional[torch.Tensor] = None,
    vertices_lengths: Optional[torch.Tensor] = None,
    faces_lengths: Optional[torch.Tensor] = None,
    vertices_batch: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> torch.Tensor:
    """PyTorch3D's point-to-mesh loss: squared point-to-face plus face-to-point distances.

    Args:
        points: (P, 3) for one mesh; (B, P, 3) padded for padded meshes; (P_total, 3) packed
            with ``points_batch`` for packed meshes. Every sample needs a point.
        vertices, faces: the meshes, as :func:`pcops.mesh_distance` takes them.
        points_lengths, points_batch, vertices_lengths, faces_lengths, vertices_batch: the
            layouts, as :func:`pcops.mesh_distance` takes them.
        validate: check every input for NaN/inf and range (one host read).

    Returns:
        A 0-d tensor: the mean over samples of each sample's mean squared point-to-face
        distance plus its mean squared face-to-point distance; differentiable with respect to
        ``points`` and ``vertices``. float16/bfloat16 are computed in float32.

    Example:
        >>> import torch, pcops
        >>> vertices = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
        >>> points = torch.tensor([[0.0, 0.0, 0.5]])  # above the corner: 0.25 both ways
        >>> pcops.point_mesh_face_distance(points, vertices, torch.tensor([[0, 1, 2]]))
        tensor(0.5000)
    """
    checks = _validate.checks(validate)
    flat = _layout.mesh(vertices, faces, vertices_lengths=vertices_lengths, faces_lengths=faces_lengths,
                        vertices_batch=vertices_batch, checks=checks)
    query = _layout.mesh_points("points", points, flat, lengths=points_lengths, batch=points_batch, checks=checks)
    if checks is not None:
        checks.in_range("points_lengths", points_lengths, 1, points.shape[-2], lambda: "in [1, M] (every sample needs a point)")
        if query.points.shape[0] == 0:
            raise ValueError("points is empty: every sample needs a point")
        if flat.batch < 0:  # packed: the samples of the points and of the faces must be the same
            _layout.points_have_meshes(checks, query, flat)
            _layout.every_in(checks, flat.face_group, query.group, lambda i: f"points_batch: sample {i} has a mesh but no points (every sample needs a point)")
        checks.run()
    dtype, out_dtype = _validate.compute_dtype(query.points, flat.vertices)
    p, v = query.points.to(dtype), flat.vertices.to(dtype)
    corners = v.index_select(0, flat.faces.reshape(-1)).view(-1, 3, 3)
    valid_p = query.group != (flat.batch if flat.batch > 0 else -1)  # padding rows of padded points: group B
    valid_f = flat.face_group != (flat.batch + 1 if flat.batch > 0 else -1)
    # points to their nearest faces
    faces_tree = _search.tree(v, flat.faces, flat.face_group, one=flat.batch == 0, winding=False)
    face = _search.closest(p, query.group, faces_tree, float("inf"), validate and checks is None, one=flat.batch == 0)[0].clamp(min=0)
    near = _triangle.closest(p, *corners.index_select(0, face).unbind(1)).point
    d_points = (p - near).pow(2).sum(-1)
    # faces to their nearest points: the points as a hierarchy of faces with three equal corners
    rows = torch.arange(p.shape[0], device=p.device)[:, None].expand(-1, 3)
    points_tree = _search.tree(p, rows, query.group, winding=False)
    a, b, c = corners.unbind(1)
    point = _search.closest(a, flat.face_group, points_tree, float("inf"), False, triangles=(a, b, c), one=flat.batch == 0)[0].clamp(min=0)
    found = p.index_select(0, point)
    d_faces = (found - _triangle.closest(found, a, b, c).point).pow(2).sum(-1)
    # means per sample, then over samples (a packed sample's size from its ids: static shapes)
    gp = torch.where(valid_p, query.group, -1)
    gf = torch.where(valid_f, flat.face_group, -2)
    wp_ = torch.where(valid_p, 1.0 / _per_sample(gp).to(dtype), 0.0)
    wf = torch.where(valid_f, 1.0 / _per_sample(gf).to(dtype), 0.0)
    n = wf.sum()  # the number of meshes: each contributes its faces' weights, 1 in all
    point_term = (torch.where(valid_p, d_points, 0.0) * wp_).sum()
    face_term = (torch.where(valid_f, d_faces, 0.0) * wf).sum()
    return ((point_term + face_term) / n).to(out_dtype)


__all__ = ["point_mesh_face_distance"]
