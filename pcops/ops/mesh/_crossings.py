"""The winding number of a query about a closed mesh from a reference point and the faces
crossed on the way (CPU; float64).

On a closed mesh the winding number is an integer, constant off the faces, and changes by one
across each face: up going from its front (where its normal ``(b - a) x (c - a)`` points) to
its back. So for any face f, the winding number at q is the winding number just off f's
centroid on q's side plus the signed count of the faces the segment from that centroid to q
crosses; f itself it never crosses (both ends lie on q's side of f's plane). The winding number
just in front of f's centroid (``wout``, by piece or by face: :mod:`._sides`) is the
reference; behind it, one more.

Each face's crossing is decided by orientation determinants in float64 (:func:`orient`): the
segment's ends on either side of the face's plane, and the segment's line through the face
(the three determinants of the line with the face's edges of one sign) or beside it (of both
signs). A determinant within ``ORIENT`` times its permanent of zero leaves it unclear (the
segment through an edge, a corner or along the plane, to rounding), and so does q on f's plane,
an unknown reference, or a segment longer than ``REACH`` times f's longest edge (a query far
from the mesh: its segment would meet many boxes, and the walk shares such queries' walks):
the query is then walked. The faces tested are those whose boxes, down
the mesh's hierarchy (:mod:`._tree`), meet the segment's box widened by ``PAD`` times the
mesh's size.
"""

import torch
import warp as wp

from ... import _warp, _warp_funcs

REACH = 2.0  # a segment longer than this times its face's longest edge: the query walked (far queries share walks)
PAD = 2.0**-20  # times the mesh's size: the segment's box widened by this against the tree's boxes
ORIENT = 1e-14  # times the permanent of a float64 orientation determinant: a smaller one's sign is unclear
_STACK = 64
_V = wp.vec3d


@wp.func(module="unique")
def centroid(a: _V, b: _V, c: _V):
    """The centroid of a face in float64: the reference point (one formula for the walk that
    measures it and the queries that use it)."""
    return (a + b + c) / wp.float64(3.0)


@wp.func(module="unique")
def orient(p: _V, a: _V, b: _V, c: _V):
    """The sign of det[a - p, b - p, c - p], which is -(p - a).((b - a) x (c - a)): 1 with p
    behind the plane of abc (opposite its normal), -1 in front; 0 where the determinant is
    within ``ORIENT`` times its permanent (rounding may decide it; Shewchuk's bound for
    float64 is under 1e-15), or not finite."""
    ax, ay, az = a[0] - p[0], a[1] - p[1], a[2] - p[2]
    bx, by, bz = b[0] - p[0], b[1] - p[1], b[2] - p[2]
    cx, cy, cz = c[0] - p[0], c[1] - p[1], c[2] - p[2]
    det = ax * (by * cz - bz * cy) + bx * (cy * az - cz * ay) + cx * (ay * bz - az * by)
    perm = (wp.abs(ax) * (wp.abs(by * cz) + wp.abs(bz * cy)) + wp.abs(bx) * (wp.abs(cy * az) + wp.abs(cz * ay))
            + wp.abs(cx) * (wp.abs(ay * bz) + wp.abs(az * by)))
    bound = wp.float64(ORIENT) * perm
    out = int(0)
    if det > bound:
        out = 1
    elif det < -bound:
        out = -1
    return out


@_warp.kernels
def reference_func(dtype: torch.dtype):
    """``reference(q, f, depth, vertices, faces, parent, wout, face_group, <the mesh's tree:
    order, sorted groups, boxes, sample ranges, scale>)``: the winding number at q (float64)
    about the closed mesh (vertices, faces) from face f's reference and the faces crossed,
    inf where unclear (see the module docs); ``parent`` and ``wout`` from
    :func:`._sides._mesh_simple`, the boxes in ``dtype``."""
    v, s = _warp.vec3(dtype), _warp.scalar(dtype)
    zero, zero3, reach2 = wp.float64(0.0), _V(0.0, 0.0, 0.0), wp.float64(REACH * REACH)
    _nodes = wp.types.vector(length=_STACK, dtype=wp.int32)

    @wp.func(module="unique")
    def crossed(p: _V, c0: _V, f: int, g: wp.int64, depth: int, vertices: wp.array(dtype=_V), faces: wp.array2d(dtype=wp.int64),
                order: wp.array(dtype=wp.int64), group: wp.array(dtype=wp.int64), lo: wp.array(dtype=v), hi: wp.array(dtype=v),
                glo: wp.array(dtype=wp.int64), ghi: wp.array(dtype=wp.int64), pad: wp.float64):
        """(the faces of sample g but f crossed on the way from c0 to p, each +1 from its front to
        its back and -1 the other way; 1 if a crossing is unclear)."""
        n = wp.int64(order.shape[0])
        single = glo[0] == ghi[0] and glo[0] == g
        wide = _V(pad, pad, pad)
        slo, shi = wp.min(p, c0) - wide, wp.max(p, c0) + wide
        count = int(0)
        stack_node = _nodes()
        stack_depth = _nodes()
        top = int(1)
        stack_node[0] = 0
        stack_depth[0] = 0
        while top > 0:
            top = top - 1
            node = stack_node[top]
            d = stack_depth[top]
            if not single and (g < glo[node] or g > ghi[node]):
                continue
            e = wp.max(wp.max(_V(lo[node]) - shi, slo - _V(hi[node])), zero3)
            if wp.dot(e, e) > zero:
                continue
            if d < depth:
                stack_node[top] = 2 * node + 1
                stack_depth[top] = d + 1
                stack_node[top + 1] = 2 * node + 2
                stack_depth[top + 1] = d + 1
                top = top + 2
                continue
            k = node + 1 - (1 << d)
            for j in range(_warp_funcs.part(k, n, depth), _warp_funcs.part(k + 1, n, depth)):
                row = int(order[j])
                if row == f or (not single and group[j] != g):
                    continue
                a, b, c = vertices[int(faces[row, 0])], vertices[int(faces[row, 1])], vertices[int(faces[row, 2])]
                e = wp.max(wp.max(wp.min(a, wp.min(b, c)) - shi, slo - wp.max(a, wp.max(b, c))), zero3)
                if wp.dot(e, e) > zero:
                    continue
                sp, sc = orient(p, a, b, c), orient(c0, a, b, c)
                if sp != 0 and sp == sc:  # both ends on one side of its plane
                    continue
                e1, e2, e3 = orient(p, c0, a, b), orient(p, c0, b, c), orient(p, c0, c, a)
                if wp.max(e1, wp.max(e2, e3)) > 0 and wp.min(e1, wp.min(e2, e3)) < 0:  # the line passes beside it
                    continue
                if sp == 0 or sc == 0 or e1 == 0 or e2 == 0 or e3 == 0:
                    return count, 1
                count += sp
        return count, 0

    @wp.func(module="unique")
    def reference(q: _V, f: int, depth: int, vertices: wp.array(dtype=_V), faces: wp.array2d(dtype=wp.int64),
                  parent: wp.array(dtype=wp.int64), wout: wp.array(dtype=wp.float64), face_group: wp.array(dtype=wp.int64),
                  order: wp.array(dtype=wp.int64), group: wp.array(dtype=wp.int64), lo: wp.array(dtype=v), hi: wp.array(dtype=v),
                  glo: wp.array(dtype=wp.int64), ghi: wp.array(dtype=wp.int64), scale: wp.array(dtype=s)):
        a, b, c = vertices[int(faces[f, 0])], vertices[int(faces[f, 1])], vertices[int(faces[f, 2])]
        behind = orient(q, a, b, c)
        ref = wout[f]
        if parent[f] >= wp.int64(0):
            ref = wout[int(parent[f])]
        out = wp.float64(wp.inf)
        c0 = centroid(a, b, c)
        longest = wp.max(wp.length_sq(b - a), wp.max(wp.length_sq(c - b), wp.length_sq(a - c)))
        if behind != 0 and wp.abs(ref) < wp.float64(wp.inf) and wp.length_sq(q - c0) <= reach2 * longest:
            count, unclear = crossed(q, c0, f, face_group[f], depth, vertices, faces, order, group, lo, hi, glo, ghi,
                                     wp.float64(PAD) * wp.float64(scale[0]))
            if unclear == 0:
                out = ref + wp.float64(wp.max(behind, 0) + count)
        return out

    return reference
