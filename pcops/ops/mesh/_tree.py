"""The bounding volume hierarchy of the mesh ops, built in torch (no Warp object outlives a call).

The faces are sorted by sample id, then by the Morton code of their centroids (10 bits per
axis over the box of all centroids), and split at the middle index as the kd-tree of
:mod:`pcops.ops.neighbours.nearest._kdtree` splits its points: node ``i`` at depth ``d`` holds
the sorted faces ``F i / 2^d .. F (i + 1) / 2^d`` (integer division) and its children are the
halves, so no pointer is stored; the leaves, at depth ``depth(F)``, hold at most ``LEAF`` faces.
Node ``i`` at depth ``d`` is entry ``2^d - 1 + i`` of the node arrays, whose length is bounded
by ``4 ceil(F / LEAF)`` (the exact fake's size; entries past ``2^(depth + 1) - 1`` are unused).

Every node stores the box of its faces, its sample range (the faces are sorted by sample, so a
query skips the nodes of other meshes) and the data of the hierarchical fast winding number
(Barill et al. 2018): the area-weighted centroid ``center``, the sum of the area vectors
``normal`` (area times unit normal), the first moment ``moment`` = sum of a_t n_t (c_t -
center)^T, and the radius of a ball about ``center`` holding the node's box. All of it is
computed in float64 and stored in the compute dtype; the triangles are stored sorted, three
(F, 3) arrays of corners, with their sample ids and their rows in the caller's faces.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import _morton

LEAF = 4  # faces per leaf at most


class Tree(NamedTuple):
    """The tensors of a mesh's hierarchy (see the module docs); ``scale`` (0-d): the largest
    absolute coordinate of the mesh, the size its rounding is measured against."""

    order: torch.Tensor  # (F,) int64: the caller's face row of each sorted face
    a: torch.Tensor  # (F, 3) first corners of the sorted faces
    b: torch.Tensor
    c: torch.Tensor
    group: torch.Tensor  # (F,) int64 sample id of each sorted face
    lo: torch.Tensor  # (nodes, 3) boxes
    hi: torch.Tensor
    glo: torch.Tensor  # (nodes,) int64 sample range
    ghi: torch.Tensor
    center: torch.Tensor  # (nodes, 3)
    normal: torch.Tensor  # (nodes, 3)
    moment: torch.Tensor  # (nodes, 3, 3)
    radius: torch.Tensor  # (nodes,)
    scale: torch.Tensor  # () the largest absolute coordinate


def depth(n_faces: int) -> int:
    """The depth of the leaves: the smallest d with n_faces <= LEAF 2^d."""
    return _morton.leaf_depth(n_faces, LEAF)


def node_count(n_faces):
    """The length of the node arrays (works on symbolic sizes: the fake's shapes)."""
    return 4 * ((n_faces + LEAF - 1) // LEAF)


def morton_order(points: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """The order of points (M, 3) by sample id, then by Morton code (10 bits per axis over their box):
    the faces' order (by centroid) and the queries' (neighbouring threads walk the same nodes)."""
    centroid = torch.nan_to_num(points, nan=0.0, posinf=0.0, neginf=0.0)
    low, high = centroid.amin(0), centroid.amax(0)
    cells = ((centroid - low) / (high - low).clamp_min(1e-300) * 1023.0).nan_to_num(0.0).clamp(0, 1023).to(torch.int64)
    code = _morton.codes(cells)
    order = torch.argsort(code, stable=True)
    return order[torch.argsort(group[order], stable=True)]


def build(vertices: torch.Tensor, faces: torch.Tensor, group: torch.Tensor, dtype: torch.dtype) -> Tree:
    """The hierarchy of faces (F, 3) (rows of vertices (V, 3)) with sample ids ``group`` (F,)."""
    n = faces.shape[0]
    d = depth(n)
    device = vertices.device
    corners = vertices.detach().to(torch.float64).index_select(0, faces.reshape(-1)).view(n, 3, 3)
    order = morton_order(corners.mean(1), group)
    corners, group = corners.index_select(0, order), group.index_select(0, order)
    # per face: box, area vector, area, centroid (in float64)
    area_vec = 0.5 * torch.linalg.cross(corners[:, 1] - corners[:, 0], corners[:, 2] - corners[:, 0])
    area = torch.linalg.vector_norm(area_vec, dim=1)
    centroid = corners.mean(1)
    # the leaves: sorted faces F i / 2^d .. F (i + 1) / 2^d, as a (leaves, LEAF) table of rows
    # (row n: padding), so that every reduction is a gather and a reduction over a short axis
    # (scatters and index_add stall when another process holds a core: docs/benchmarks.md, design choices)
    leaves = 1 << d
    bounds = (n * torch.arange(leaves + 1, device=device, dtype=torch.int64)) >> d
    table = bounds[:-1, None] + torch.arange(LEAF, device=device)
    table = torch.where(table < bounds[1:, None], table, n)

    def per_leaf(values: torch.Tensor, pad: float) -> torch.Tensor:  # (n, ...) -> (leaves, LEAF, ...)
        padded = torch.cat([values, values.new_full((1, *values.shape[1:]), pad)])
        return padded.index_select(0, table.reshape(-1)).view(leaves, LEAF, *values.shape[1:])

    lo = per_leaf(corners.amin(1), float("inf")).amin(1)
    hi = per_leaf(corners.amax(1), float("-inf")).amax(1)
    sums = torch.cat([area[:, None], area[:, None] * centroid, area_vec, (area_vec[:, :, None] * centroid[:, None, :]).reshape(n, 9)], 1)
    sums = per_leaf(sums, 0.0).sum(1)
    glo, ghi = group[bounds[:-1]], group[bounds[1:] - 1]
    levels = [(lo, hi, glo, ghi, sums)]
    for _ in range(d):  # parents from pairs of children, up to the root
        lo, hi, glo, ghi, sums = levels[-1]
        levels.append((torch.minimum(lo[0::2], lo[1::2]), torch.maximum(hi[0::2], hi[1::2]), glo[0::2], ghi[1::2], sums[0::2] + sums[1::2]))
    lo, hi, glo, ghi, sums = (torch.cat(parts) for parts in zip(*reversed(levels)))  # entry 2^depth - 1 + i
    area, weighted, normal, second = sums[:, 0], sums[:, 1:4], sums[:, 4:7], sums[:, 7:].reshape(-1, 3, 3)
    center = torch.where(area[:, None] > 0, weighted / area.clamp_min(1e-300)[:, None], 0.5 * (lo + hi))
    moment = second - normal[:, :, None] * center[:, None, :]  # sum a n (c - center)^T
    # the radius: the farthest corner of the node's faces from its center. Node i of depth l holds
    # leaves i 2^(d - l) .. (i + 1) 2^(d - l) - 1: per depth, each leaf's farthest corner from its
    # ancestor's center, then the largest over the node's leaves
    leaf_corners = per_leaf(corners, float("nan")).reshape(leaves, 3 * LEAF, 3)
    radius = []
    for level in range(d + 1):
        first = (1 << level) - 1
        ancestors = center[first : first + (1 << level)].repeat_interleave(1 << (d - level), 0)
        reach = torch.linalg.vector_norm(leaf_corners - ancestors[:, None], dim=-1).nan_to_num(nan=0.0, posinf=0.0).amax(1)
        radius.append(reach.view(1 << level, -1).amax(1))
    radius = torch.cat(radius)
    size = node_count(n)

    def out(t, fill=0):
        t = t.to(dtype) if t.dtype == torch.float64 else t
        pad = t.new_full((size - t.shape[0], *t.shape[1:]), fill)
        return torch.cat([t, pad]).contiguous()

    scale = torch.nan_to_num(corners.abs(), nan=0.0, posinf=0.0).amax().to(dtype)
    cast = lambda t: t.to(dtype, copy=True, memory_format=torch.contiguous_format)  # noqa: E731  (a copy: views of one tensor would alias)
    return Tree(order, cast(corners[:, 0]), cast(corners[:, 1]), cast(corners[:, 2]), group.contiguous(),
                out(lo), out(hi), out(glo), out(ghi), out(center), out(normal), out(moment), out(radius), scale)


def empty_like(vertices: torch.Tensor, faces: torch.Tensor, dtype: torch.dtype) -> Tree:
    """A tree's tensors with the exact shapes of :func:`build` (the fake)."""
    n = faces.shape[0]
    size = node_count(n)
    f = lambda *shape: vertices.new_empty(shape, dtype=dtype)  # noqa: E731
    i = lambda *shape: vertices.new_empty(shape, dtype=torch.int64)  # noqa: E731
    return Tree(i(n), f(n, 3), f(n, 3), f(n, 3), i(n), f(size, 3), f(size, 3), i(size), i(size), f(size, 3), f(size, 3),
                f(size, 3, 3), f(size), f())
