"""The sign of signed ``mesh_distance`` without a winding-number walk, on closed meshes (CPU).

On a closed mesh (``pcops::mesh_closed``: every edge used as often in each direction), take
the faces whose edges are each used once in each direction (each has its twin) and that meet
no other face but along their shared edges and corners (no face crosses or touches them
elsewhere: the test below), joined into pieces by the edges two of them share. The space next
to a piece has one winding number on its faces' outer side (their normals,
``(b - a) x (c - a)``, point there) and one more on their inner side: no other face passes
between a piece's faces and the space next to them. So a query whose closest point
lies inside such a face, or inside an edge of two of them, has the winding number of that
side: the outer one of its piece, plus one when it lies behind the face's plane (behind the
plane through the edge whose normal is the sum of the two faces' unit normals, for an edge:
Baerentzen and Aanaes 2005), decided in float64 from the exact coordinates.

Queries closest to a corner, to a face of poor shape (height under ``SOUND`` times its longest
edge), to a knife edge (faces folded onto each other), tied with several faces, or closest to a
face that crosses, touches or folds onto another take the winding number just off the centroid
of the face found plus the faces crossed on the way from there (:mod:`._crossings`); where a
crossing is unclear, or the face's reference unknown, they are walked (:mod:`._search`), as
are all queries of a mesh that is not closed (but a kept one, closed first by caps:
:mod:`._caps`). (On a simple mesh, whose faces meet only along their shared edges and
corners, every face is in a piece: the connected pieces of the surface.)

``pcops::mesh_simple`` analyses a mesh (one mesh or a batch), once per kept ``MeshBVH`` in eager
mode (:func:`analysis`):

* ``crossing`` (a thread per face): the face against every face of its sample whose box meets
  its own (the hierarchy's boxes), in float64 with a margin of ``MARGIN`` times the mesh's size:
  faces with no shared corner must be separated by one of the separating-axis test's axes
  (normals, edge pairs, and in-plane axes for faces in one plane); faces sharing one corner by
  a plane through it (one face's plane, a plane through an edge along a normal or along an edge
  of the other, the plane between the faces' middle directions) or cross each other's planes
  along opposite rays from it; the two faces of an edge must not fold onto each other.
  Anything else counts as a crossing (the test errs on the safe side): both faces are
  ``crossed``.
* ``components`` (one thread): the pieces (union-find over the twins of faces not crossed) and
  each piece's best-shaped face. A face with an edge that has no twin (an edge used more than
  once each way: two solids sharing an edge; or a face with a repeated corner) counts as
  crossed: other faces meet it along that edge.
* ``outside`` (a thread per piece): the winding number on its outer side, from one walk at the
  centroid of its best-shaped face with that face left out (an integer plus 1/2 there: the face
  itself adds -1/2 on its outer side); a value not within 1/4 of that (a walk's error) makes
  every query walked. The same walk at the centroid of each face in no piece gives its own
  reference (inf where not within 1/4), where such faces are at most a share of the mesh's or
  a count (``CROSSED``; more, as in a soup of faces through each other: their queries walked,
  cheaper than a walk per face).

``pcops::mesh_sides`` (``sides``, a thread per query) gives the winding number of its closest
face's side, else from the faces crossed (:mod:`._crossings`, down the mesh's hierarchy: the
search's, or the capped mesh's own; not for a query ``FAR`` times the mesh's radius or more from
the mesh, whose walk costs less), inf where it must be walked. The search's face may only tie with
the truly nearest (float32 rounding, larger for thin faces' planes): the search reports the
other face within that band, widened by the mesh's worst shape factor
(:func:`._search.closest`), the two are compared in float64 (``feature``) and the nearer
decides; a query with two or more others in the band counts its crossings.

GPUs walk every query (the pieces are found by one thread here), and so does a call with fewer
queries than faces on a hierarchy built in the call (the analysis would cost more than their
walks).
"""

import weakref
from typing import Optional

import torch
import warp as wp

from ... import _threads, _warp, _warp_funcs
from . import _caps, _crossings, _search, _tree

SOUND = 1e-4  # a face whose height is under this times its longest edge: its queries are walked
MARGIN = 1e-9  # times the mesh's size (and lengths): what faces must be apart by to count as apart
KNIFE = 1e-6  # two faces of an edge whose unit normals sum to less than this (folded): walked
# A query this many times its mesh's radius (the root's ball, :mod:`._tree`) or farther from the
# mesh is walked where its closest face's side does not decide it (no crossings counted), and on
# an open mesh always (no caps' check): far from the mesh a walk opens few nodes, while the
# crossings and the caps' check cost more there (docs/benchmarks.md, meshes)
FAR = 0.1
CROSSED = (0.25, 4096)  # faces in no piece at most this share of a mesh's, or this many: each walked once for its reference (more: their queries walked)
_STACK = 64
_V = wp.vec3d


@_warp.kernels
def _analysis_kernels():
    """(components, crossing): the float64 kernels of a mesh's analysis (see the module docs)."""
    _nodes = wp.types.vector(length=_STACK, dtype=wp.int32)

    @wp.func(module="unique")
    def _corner(x0: _V, x1: _V, x2: _V, i: int):
        out = x0
        if i == 1:
            out = x1
        elif i == 2:
            out = x2
        return out


    @wp.func(module="unique")
    def _apart(a0: _V, a1: _V, a2: _V, b0: _V, b1: _V, b2: _V, axis: _V, margin: wp.float64):
        """Whether the projections of triangles a and b on ``axis`` are apart by more than the margin."""
        p0, p1, p2 = wp.dot(a0 - a0, axis), wp.dot(a1 - a0, axis), wp.dot(a2 - a0, axis)
        q0, q1, q2 = wp.dot(b0 - a0, axis), wp.dot(b1 - a0, axis), wp.dot(b2 - a0, axis)
        gap = margin * wp.length(axis)
        low_a, high_a = wp.min(p0, wp.min(p1, p2)), wp.max(p0, wp.max(p1, p2))
        low_b, high_b = wp.min(q0, wp.min(q1, q2)), wp.max(q0, wp.max(q1, q2))
        return high_a < low_b - gap or high_b < low_a - gap


    @wp.func(module="unique")
    def _separated(a0: _V, a1: _V, a2: _V, b0: _V, b1: _V, b2: _V, margin: wp.float64):
        """Triangles with no shared corner: apart along their normals, an edge-edge axis, or (one
        plane) an axis in a face's plane across one of its edges."""
        na, nb = wp.cross(a1 - a0, a2 - a0), wp.cross(b1 - b0, b2 - b0)
        if _apart(a0, a1, a2, b0, b1, b2, na, margin) or _apart(a0, a1, a2, b0, b1, b2, nb, margin):
            return True
        for i in range(3):
            ea = _corner(a0, a1, a2, (i + 1) % 3) - _corner(a0, a1, a2, i)
            eb = _corner(b0, b1, b2, (i + 1) % 3) - _corner(b0, b1, b2, i)
            if _apart(a0, a1, a2, b0, b1, b2, wp.cross(na, ea), margin) or _apart(a0, a1, a2, b0, b1, b2, wp.cross(nb, eb), margin):
                return True
            for j in range(3):
                eb = _corner(b0, b1, b2, (j + 1) % 3) - _corner(b0, b1, b2, j)
                if _apart(a0, a1, a2, b0, b1, b2, wp.cross(ea, eb), margin):
                    return True
        return False


    @wp.func(module="unique")
    def _beyond(v: _V, end: _V, inner: _V, x1: _V, x2: _V, n: _V, rel: wp.float64):
        """In the plane of unit normal n: x1 and x2 strictly on the other side of the line from v
        through ``end`` than ``inner``."""
        e = end - v
        h0 = wp.dot(wp.cross(e, inner - v), n)
        h1, h2 = wp.dot(wp.cross(e, x1 - v), n), wp.dot(wp.cross(e, x2 - v), n)
        m = rel * wp.length(e) * wp.max(wp.length(x1 - v), wp.length(x2 - v))
        return (h0 > wp.float64(0.0) and h1 < -m and h2 < -m) or (h0 < wp.float64(0.0) and h1 > m and h2 > m)


    @wp.func(module="unique")
    def _split(v: _V, a1: _V, a2: _V, b1: _V, b2: _V, k: _V, rel: wp.float64, near: wp.float64):
        """The plane through v of normal k leaves a1 and a2 on one side (beyond it by at most
        ``near`` times the margin: rounding, for corners on it by construction; a negative
        ``near``: strictly on their side) and b1, b2 strictly on the other (apart by more than
        the margin)."""
        ha = wp.max(wp.dot(a1 - v, k), wp.dot(a2 - v, k))
        la = wp.min(wp.dot(a1 - v, k), wp.dot(a2 - v, k))
        hb = wp.max(wp.dot(b1 - v, k), wp.dot(b2 - v, k))
        lb = wp.min(wp.dot(b1 - v, k), wp.dot(b2 - v, k))
        m = rel * wp.length(k) * wp.max(wp.max(wp.length(a1 - v), wp.length(a2 - v)), wp.max(wp.length(b1 - v), wp.length(b2 - v)))
        return (ha <= m * near and lb > m) or (la >= -m * near and hb < -m)

    @wp.func(module="unique")
    def _corner_only(v: _V, p1: _V, p2: _V, q1: _V, q2: _V, rel: wp.float64):
        """Triangles (v, p1, p2) and (v, q1, q2) meet at v only: a plane through v separates
        them (one face's plane; a plane through an edge at v, along one face's normal or along
        an edge of the other; or across the difference of their middle directions), or each crosses
        the other's plane along opposite rays from v."""
        na, nb = wp.normalize(wp.cross(p1 - v, p2 - v)), wp.normalize(wp.cross(q1 - v, q2 - v))
        on = wp.float64(1e-3)  # p1, p2 lie on na's plane, q1, q2 on nb's: rounding only
        if _split(v, p1, p2, q1, q2, na, rel, on) or _split(v, q1, q2, p1, p2, nb, rel, on):
            return True
        if _beyond(v, p1, p2, q1, q2, na, rel) or _beyond(v, p2, p1, q1, q2, na, rel):
            return True
        if _beyond(v, q1, q2, p1, p2, nb, rel) or _beyond(v, q2, q1, p1, p2, nb, rel):
            return True
        bisect = wp.normalize(p1 - v) + wp.normalize(p2 - v) - wp.normalize(q1 - v) - wp.normalize(q2 - v)
        if _split(v, q1, q2, p1, p2, bisect, rel, wp.float64(-1.0)):  # the plane between the faces' middle directions
            return True
        for i in range(2):
            pi, po = p1, p2
            if i == 1:
                pi, po = p2, p1
            for j in range(2):
                qj, qo = q1, q2
                if j == 1:
                    qj, qo = q2, q1
                k = wp.cross(pi - v, qj - v)  # the plane of an edge of each: the other corners on either side
                m = rel * wp.length(k) * wp.max(wp.length(po - v), wp.length(qo - v))
                hp, hq = wp.dot(po - v, k), wp.dot(qo - v, k)
                if (hp > m and hq < -m) or (hp < -m and hq > m):
                    return True
        sq1, sq2 = wp.dot(q1 - v, na), wp.dot(q2 - v, na)
        sp1, sp2 = wp.dot(p1 - v, nb), wp.dot(p2 - v, nb)
        mq = rel * wp.max(wp.length(q1 - v), wp.length(q2 - v))
        mp = rel * wp.max(wp.length(p1 - v), wp.length(p2 - v))
        if ((sq1 > mq and sq2 < -mq) or (sq1 < -mq and sq2 > mq)) and ((sp1 > mp and sp2 < -mp) or (sp1 < -mp and sp2 > mp)):
            # each crosses the other's plane: along the planes' common line, from v, opposite ways
            xa = p1 + (p2 - p1) * (sp1 / (sp1 - sp2)) - v
            xb = q1 + (q2 - q1) * (sq1 / (sq1 - sq2)) - v
            return wp.dot(xa, xb) < wp.float64(-0.5) * wp.length(xa) * wp.length(xb)
        return False

    @wp.func(module="unique")
    def _unfolded(u: _V, w: _V, ca: _V, cb: _V, rel: wp.float64):
        """Triangles (u, w, ca) and (w, u, cb) meet along their edge only: cb off the first's plane,
        or in it on the other side of the edge."""
        na = wp.normalize(wp.cross(w - u, ca - u))
        if wp.abs(wp.dot(cb - u, na)) > rel * wp.length(cb - u):
            return True
        ha, hb = wp.dot(wp.cross(w - u, ca - u), na), wp.dot(wp.cross(w - u, cb - u), na)
        m = rel * wp.length(w - u) * wp.length(cb - u)
        return (ha > wp.float64(0.0) and hb < -m) or (ha < wp.float64(0.0) and hb > m)


    @wp.func(module="unique")
    def _apart_faces(a0: _V, a1: _V, a2: _V, ia: wp.vec3l, b0: _V, b1: _V, b2: _V, ib: wp.vec3l, margin: wp.float64, rel: wp.float64):
        """Whether two faces (corners, vertex indices) meet at most along their shared corners and edge."""
        shared = int(0)
        sa, sb, other_a, other_b = int(0), int(0), int(3), int(3)
        for i in range(3):
            for j in range(3):
                if ia[i] == ib[j]:
                    shared = shared + 1
                    sa = i
                    sb = j
                    other_a = other_a - i
                    other_b = other_b - j
        if shared == 0:
            return _separated(a0, a1, a2, b0, b1, b2, margin)
        if shared == 1:
            return _corner_only(_corner(a0, a1, a2, sa), _corner(a0, a1, a2, (sa + 1) % 3), _corner(a0, a1, a2, (sa + 2) % 3),
                                _corner(b0, b1, b2, (sb + 1) % 3), _corner(b0, b1, b2, (sb + 2) % 3), rel)
        if shared == 2:  # other_x: the corner not shared (3 less the two shared ones' positions)
            return _unfolded(_corner(a0, a1, a2, (other_a + 1) % 3), _corner(a0, a1, a2, (other_a + 2) % 3),
                             _corner(a0, a1, a2, other_a), _corner(b0, b1, b2, other_b), rel)
        return False


    @wp.func(module="unique")
    def _root(parent: wp.array(dtype=wp.int64), x: wp.int64):
        y = x
        while parent[int(y)] != y:
            parent[int(y)] = parent[int(parent[int(y)])]
            y = parent[int(y)]
        return y


    @wp.func(module="unique")
    def _shape(a: _V, b: _V, c: _V):
        """Twice the area over the squared longest edge (0 for a flat face)."""
        longest = wp.max(wp.length_sq(b - a), wp.max(wp.length_sq(c - b), wp.length_sq(a - c)))
        area2 = wp.length(wp.cross(b - a, c - a))
        out = wp.float64(0.0)
        if longest > wp.float64(0.0):
            out = area2 / longest
        return out


    @wp.kernel(enable_backward=False, module="unique")
    def _components(start: int, vertices: wp.array(dtype=_V), faces: wp.array2d(dtype=wp.int64), group: wp.array(dtype=wp.int64),
                    padded: int, padding: wp.int64, closed: wp.array(dtype=wp.int32), twin: wp.array2d(dtype=wp.int64),
                    crossed: wp.array(dtype=wp.int32), parent: wp.array(dtype=wp.int64), best: wp.array(dtype=wp.float64),
                    rep: wp.array(dtype=wp.int64), ok: wp.array(dtype=wp.int32)):
        """One thread: ``parent[f]`` the root face of f's piece (the faces joined by the edges of
        two faces that are not ``crossed``; -1 for a crossed face), ``rep[root]`` its best-shaped
        face (-1 for faces that are no root); ``ok[0]`` 1 if the mesh is closed. A face with an
        edge without a twin (used more than once each way, or between a repeated corner) is
        crossed too."""
        ok[0] = 0
        if closed[0] == 0:
            return
        nf = faces.shape[0]
        for f in range(nf):
            parent[f] = wp.int64(f)
            rep[f] = wp.int64(-1)
        for f in range(nf):
            if padded == 0 or group[f] != padding:
                for e in range(3):
                    if twin[f, e] < wp.int64(0):  # (other faces meet it along that edge)
                        crossed[f] = 1
        for f in range(nf):
            if padded == 0 or group[f] != padding:
                for e in range(3):
                    g = twin[f, e]
                    if g < wp.int64(0):
                        continue
                    if crossed[f] == 0 and crossed[int(g)] == 0:
                        ra, rb = _root(parent, wp.int64(f)), _root(parent, g)
                        if ra != rb:
                            parent[int(wp.max(ra, rb))] = wp.min(ra, rb)
        for f in range(nf):  # (a crossed face is no other face's root: setting its parent to -1 breaks no walk to a root)
            if crossed[f] != 0:
                parent[f] = wp.int64(-1)
            elif padded == 0 or group[f] != padding:
                r = _root(parent, wp.int64(f))
                parent[f] = r
                q = _shape(vertices[int(faces[f, 0])], vertices[int(faces[f, 1])], vertices[int(faces[f, 2])])
                if rep[int(r)] < wp.int64(0) or q > best[int(r)]:
                    best[int(r)] = q
                    rep[int(r)] = wp.int64(f)
        ok[0] = 1


    @wp.kernel(enable_backward=False, module="unique")
    def _crossing(start: int, depth: int, closed: wp.array(dtype=wp.int32), order: wp.array(dtype=wp.int64), faces: wp.array2d(dtype=wp.int64),
                  vertices: wp.array(dtype=_V), group: wp.array(dtype=wp.int64), padded: int, padding: wp.int64,
                  lo: wp.array(dtype=_V), hi: wp.array(dtype=_V), glo: wp.array(dtype=wp.int64), ghi: wp.array(dtype=wp.int64),
                  size: wp.array(dtype=wp.float64), rel: wp.float64, crossed: wp.array(dtype=wp.int32)):
        """Sorted face j against the later sorted faces of its sample whose boxes meet its own:
        ``crossed`` 1 at both faces (rows of ``faces``) of each pair that may meet elsewhere than
        along their shared corners and edge (zeros in; a face's flag is only ever set to 1)."""
        j = wp.tid() + start
        g = group[j]
        if closed[0] == 0 or (padded != 0 and g == padding):
            return
        margin = rel * size[0]
        f = int(order[j])
        ia = wp.vec3l(faces[f, 0], faces[f, 1], faces[f, 2])
        a0, a1, a2 = vertices[int(ia[0])], vertices[int(ia[1])], vertices[int(ia[2])]
        pad = _V(margin, margin, margin)
        box_lo, box_hi = wp.min(a0, wp.min(a1, a2)) - pad, wp.max(a0, wp.max(a1, a2)) + pad
        n = wp.int64(order.shape[0])
        stack_node = _nodes()
        stack_depth = _nodes()
        top = int(1)
        while top > 0:
            top = top - 1
            node = stack_node[top]
            d = stack_depth[top]
            if g < glo[node] or g > ghi[node]:
                continue
            l, h = lo[node], hi[node]
            if l[0] > box_hi[0] or l[1] > box_hi[1] or l[2] > box_hi[2] or h[0] < box_lo[0] or h[1] < box_lo[1] or h[2] < box_lo[2]:
                continue
            if d == depth:
                k = node + 1 - (1 << d)
                for r in range(wp.max(_warp_funcs.part(k, n, depth), j + 1), _warp_funcs.part(k + 1, n, depth)):
                    if group[r] == g:
                        fb = int(order[r])
                        ib = wp.vec3l(faces[fb, 0], faces[fb, 1], faces[fb, 2])
                        b0, b1, b2 = vertices[int(ib[0])], vertices[int(ib[1])], vertices[int(ib[2])]
                        if not _apart_faces(a0, a1, a2, ia, b0, b1, b2, ib, margin, rel):
                            crossed[f] = 1
                            crossed[fb] = 1
                continue
            stack_node[top] = 2 * node + 1
            stack_depth[top] = d + 1
            stack_node[top + 1] = 2 * node + 2
            stack_depth[top + 1] = d + 1
            top = top + 2

    return _components, _crossing


@_warp.kernels
def _outside_kernel():
    """The pieces' walks and the crossed faces' reference walks, in float64 whatever the
    tree's dtype (its arrays widened: a float32 centroid may lie off its face's plane by more
    than ``MARGIN``, on the far side of a face that close, and its walk's winding number be one
    off)."""
    s, v, m = wp.float64, wp.vec3d, wp.mat33d
    walk = _search.walk_func(torch.float64)
    fine2 = s(_search.BETA * _search.BETA)

    @wp.kernel(enable_backward=False, module="unique")
    def outside(start: int, depth: int, ok: wp.array(dtype=wp.int32), bad: wp.array(dtype=wp.int32), rep: wp.array(dtype=wp.int64),
                parent: wp.array(dtype=wp.int64), references: wp.array(dtype=wp.int32), padding: wp.int64, vertices: wp.array(dtype=v), faces: wp.array2d(dtype=wp.int64),
                row_of: wp.array(dtype=wp.int64), ta: wp.array(dtype=v), tb: wp.array(dtype=v), tc: wp.array(dtype=v),
                group: wp.array(dtype=wp.int64), glo: wp.array(dtype=wp.int64), ghi: wp.array(dtype=wp.int64),
                center: wp.array(dtype=v), normal: wp.array(dtype=v), moment: wp.array(dtype=m), radius: wp.array(dtype=s),
                wout: wp.array(dtype=wp.float64)):
        """Root face f: the winding number on the outer side of its piece (``bad[0]`` = 1 if a
        walk's value is not near an integer there). A face that meets another (no piece): the
        winding number just in front of its centroid (inf if its walk's value is not near an
        integer plus 1/2: another face through or next to the centroid; with ``references[0]`` 0
        none: inf)."""
        f = wp.tid() + start
        if ok[0] == 0 or bad[0] != 0:
            return
        own = parent[f] < wp.int64(0)  # a face in no piece: its own reference
        if own:
            wout[f] = wp.float64(wp.inf)
            if references[0] == 0 or group[int(row_of[f])] == padding:
                return
        elif rep[f] < wp.int64(0):
            return
        g = f
        if not own:
            g = int(rep[f])
        row = int(row_of[g])
        c = _crossings.centroid(vertices[int(faces[g, 0])], vertices[int(faces[g, 1])], vertices[int(faces[g, 2])])
        w = wp.float64(walk(c, group[row], fine2, depth, ta, tb, tc, group, glo, ghi, center, normal, moment, radius, row)) - wp.float64(0.5)
        k = wp.round(w)
        near = wp.abs(w - k) <= wp.float64(0.25)
        if own:
            wout[f] = wp.where(near, k, wp.float64(wp.inf))
        else:
            if not near:
                bad[0] = 1
            wout[f] = k

    return outside


@_warp.kernels
def _sides_kernel(dtype: torch.dtype):
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    sound2, knife, zero = wp.float64(SOUND * SOUND), wp.float64(KNIFE - 1.0), wp.float64(0.0)
    reference = _crossings.reference_func(dtype)

    @wp.func(module="unique")
    def feature(q: _V, a: _V, b: _V, c: _V):
        """(the feature of triangle abc nearest to q: -1 its interior, 0..2 edge e (corners e, e + 1),
        3 a corner, 4 a face of poor shape; q's squared distance to it), in float64 (Ericson
        2005, 5.1.5)."""
        ab, ac = b - a, c - a
        n = wp.cross(ab, ac)
        nn = wp.dot(n, n)
        longest = wp.max(wp.dot(ab, ab), wp.max(wp.length_sq(c - b), wp.dot(ac, ac)))
        kind = int(4)
        d2 = wp.float64(0.0)
        ap, bp, cp = q - a, q - b, q - c
        d1, d2_, d3, d4, d5, d6 = wp.dot(ab, ap), wp.dot(ac, ap), wp.dot(ab, bp), wp.dot(ac, bp), wp.dot(ab, cp), wp.dot(ac, cp)
        vc, vb, va = d1 * d4 - d3 * d2_, d5 * d2_ - d1 * d6, d3 * d6 - d5 * d4
        if not (nn > sound2 * longest * longest):
            kind = 4
        elif d1 <= zero and d2_ <= zero:
            kind = 3
            d2 = wp.dot(ap, ap)
        elif d3 >= zero and d4 <= d3:
            kind = 3
            d2 = wp.dot(bp, bp)
        elif d6 >= zero and d5 <= d6:
            kind = 3
            d2 = wp.dot(cp, cp)
        elif vc <= zero and d1 >= zero and d3 <= zero:
            kind = 0
            e = ap - ab * (d1 / (d1 - d3))
            d2 = wp.dot(e, e)
        elif vb <= zero and d2_ >= zero and d6 <= zero:
            kind = 2
            e = ap - ac * (d2_ / (d2_ - d6))
            d2 = wp.dot(e, e)
        elif va <= zero and d4 - d3 >= zero and d5 - d6 >= zero:
            kind = 1
            e = bp - (c - b) * ((d4 - d3) / ((d4 - d3) + (d5 - d6)))
            d2 = wp.dot(e, e)
        else:
            kind = -1
            h = wp.dot(ap, n)
            d2 = h * (h / nn)  # (h h / nn: size^6, which overflows)
        return kind, d2

    @wp.func(module="unique")
    def side(q: _V, f: int, r: int, vertices: wp.array(dtype=_V), faces: wp.array2d(dtype=wp.int64), twin: wp.array2d(dtype=wp.int64),
             parent: wp.array(dtype=wp.int64), wout: wp.array(dtype=wp.float64)):
        """(the winding number on q's side of its closest face or edge, inf where that does not
        decide it; the nearer of the face found and its rival r)."""
        inf = wp.float64(wp.inf)
        kind, d2 = feature(q, vertices[int(faces[f, 0])], vertices[int(faces[f, 1])], vertices[int(faces[f, 2])])
        if r >= 0:
            kind_r, d2_r = feature(q, vertices[int(faces[r, 0])], vertices[int(faces[r, 1])], vertices[int(faces[r, 2])])
            if kind_r == 4:
                return inf, f
            if d2_r < d2:
                f = r
                kind = kind_r
        if r < -1 or kind > 2 or parent[f] < wp.int64(0):  # tied with several, a corner, a face of poor shape, or one that meets another
            return inf, f
        a, b, c = vertices[int(faces[f, 0])], vertices[int(faces[f, 1])], vertices[int(faces[f, 2])]
        n = wp.cross(b - a, c - a)
        side = wp.dot(q - a, n)
        if kind >= 0:
            g = int(twin[f, kind])
            if g < 0 or parent[g] < wp.int64(0):
                return inf, f
            ga, gb, gc = vertices[int(faces[g, 0])], vertices[int(faces[g, 1])], vertices[int(faces[g, 2])]
            m = wp.cross(gb - ga, gc - ga)
            mm = wp.dot(m, m)
            glong = wp.max(wp.length_sq(gb - ga), wp.max(wp.length_sq(gc - gb), wp.length_sq(ga - gc)))
            if not (mm > sound2 * glong * glong):
                return inf, f
            nf, ng = wp.normalize(n), m / wp.sqrt(mm)
            if wp.dot(nf, ng) < knife:
                return inf, f
            side = wp.dot(q - vertices[int(faces[f, kind])], nf + ng)
        w = wout[int(parent[f])]
        if side < zero:
            w = w + wp.float64(1.0)
        return w, f

    @wp.kernel(enable_backward=False, module="unique")
    def sides(start: int, depth: int, ok: wp.array(dtype=wp.int32), query: wp.array(dtype=v), face: wp.array(dtype=wp.int64),
              rival: wp.array(dtype=wp.int64), vertices: wp.array(dtype=_V), faces: wp.array2d(dtype=wp.int64),
              twin: wp.array2d(dtype=wp.int64), parent: wp.array(dtype=wp.int64), wout: wp.array(dtype=wp.float64),
              face_group: wp.array(dtype=wp.int64), order: wp.array(dtype=wp.int64), group: wp.array(dtype=wp.int64),
              lo: wp.array(dtype=v), hi: wp.array(dtype=v), glo: wp.array(dtype=wp.int64), ghi: wp.array(dtype=wp.int64),
              scale: wp.array(dtype=s), cut: int, near: wp.array(dtype=wp.bool), out: wp.array(dtype=s)):
        """Query i: the winding number on its side of its closest face or edge, else the
        winding number just off its face's centroid on its side plus the faces crossed on the
        way from there (with ``cut``, only where ``near``); inf: walk it. Of the face found and the other face the search tied
        with it (within its rounding), the nearer in float64."""
        i = wp.tid() + start
        out[i] = s(wp.inf)
        f = int(face[i])
        if ok[0] == 0 or f < 0:
            return
        p = query[i]
        q = _V(wp.float64(p[0]), wp.float64(p[1]), wp.float64(p[2]))
        w, f = side(q, f, int(rival[i]), vertices, faces, twin, parent, wout)
        if w < wp.float64(wp.inf):
            out[i] = s(w)
            return
        if cut != 0 and not near[i]:  # far from the mesh: its walk costs less than the crossings
            return
        out[i] = s(reference(q, f, depth, vertices, faces, parent, wout, face_group, order, group, lo, hi, glo, ghi, scale))

    return sides


@_threads.custom_op("pcops::mesh_simple", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _mesh_simple(
    vertices: torch.Tensor, faces: torch.Tensor, face_group: torch.Tensor, padded: bool, padding: int, queries: int,
    closed: torch.Tensor, twin: torch.Tensor, order: torch.Tensor, ta: torch.Tensor, tb: torch.Tensor, tc: torch.Tensor, group: torch.Tensor,
    lo: torch.Tensor, hi: torch.Tensor, glo: torch.Tensor, ghi: torch.Tensor, center: torch.Tensor, normal: torch.Tensor,
    moment: torch.Tensor, radius: torch.Tensor, scale: torch.Tensor,
) -> list[torch.Tensor]:
    """The mesh (vertices (V, 3), faces (F, 3), face_group (F,), a padded batch's ``padding`` id),
    ``closed`` (1,) and ``twin`` (F, 3) from :func:`._search.closed` and the tree's tensors ->
    [(1,) int32: 1 if the mesh was analysed (closed; see the module docs), (F,) int64: the root
    face of each face's piece (-1: a face that crosses, touches or folds onto another), (F,)
    float64: at each root, the outer winding number of its piece, and at each face in no piece
    the winding number just in front of its centroid (inf: unknown)]. Nothing analysed on a GPU, or
    for a call of fewer ``queries`` than faces (their walks cost less than the analysis)."""
    nf, dev = faces.shape[0], faces.device
    ok, parent, wout = (torch.zeros(size, dtype=dtype, device=dev) for size, dtype in ((1, torch.int32), (nf, torch.int64), (nf, torch.float64)))
    if queries < max(nf, 1) or dev.type != "cpu":
        return [ok, parent, wout]  # made on the device (no copy from the host)
    _warp.init()
    v64, faces = vertices.to(torch.float64).contiguous(), faces.contiguous()
    bad, rep, best = torch.zeros(1, dtype=torch.int32), torch.empty(nf, dtype=torch.int64), torch.empty(nf, dtype=torch.float64)
    crossed = torch.zeros(nf, dtype=torch.int32)
    components, crossing = _analysis_kernels()
    depth = _tree.depth(nf)
    _warp.launch(crossing, nf, [depth, closed, order, faces, v64, group, int(padded), padding, _warp.array(lo.to(torch.float64).contiguous(), dtype=_V),
                                _warp.array(hi.to(torch.float64).contiguous(), dtype=_V), glo, ghi, scale.reshape(1).to(torch.float64), MARGIN,
                                crossed], like=faces, min_chunk=64)
    _warp.launch(components, 1, [v64, faces, face_group.contiguous(), int(padded), padding, closed, twin, crossed, parent, best, rep, ok],
                 like=faces, work=0)
    row_of = torch.empty_like(order).index_copy_(0, order, torch.arange(nf))
    references = (((parent < 0) & (face_group != padding)).sum() <= max(CROSSED[0] * nf, CROSSED[1])).to(torch.int32).reshape(1)
    wide = [x.to(torch.float64).contiguous() for x in (ta, tb, tc, center, normal, moment, radius)]  # (float32 values: exact)
    _warp.launch(_outside_kernel(), nf, [depth, ok, bad, rep, parent, references, padding, v64, faces, row_of, *wide[:3], group, glo, ghi, wide[3], wide[4],
                                         _warp.Typed(wide[5], wp.mat33d), wide[6], wout], like=faces, min_chunk=64)
    return [ok * (1 - bad), parent, wout]


@_mesh_simple.register_fake
def _(vertices, faces, face_group, padded, padding, queries, closed, twin, order, ta, tb, tc, group, lo, hi, glo, ghi, center, normal,
      moment, radius, scale):
    nf = faces.shape[0]
    return [faces.new_empty((1,), dtype=torch.int32), faces.new_empty((nf,)), faces.new_empty((nf,), dtype=torch.float64)]


@_threads.custom_op("pcops::mesh_sides", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _mesh_sides(query: torch.Tensor, face: torch.Tensor, rival: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor, twin: torch.Tensor,
                simple: torch.Tensor, parent: torch.Tensor, wout: torch.Tensor, face_group: torch.Tensor, order: torch.Tensor,
                group: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, glo: torch.Tensor, ghi: torch.Tensor,
                scale: torch.Tensor, near: Optional[torch.Tensor] = None) -> torch.Tensor:
    """query (M, 3) in the tree's dtype, face (M,) each query's closest face (-1: none) and rival
    (M,) the face the search tied with it (-1: none, -2: several; :func:`._search.closest`), the mesh
    (vertices, faces, face_group), ``twin`` from :func:`._search.closed`, ``simple``, ``parent`` and
    ``wout`` from :func:`_mesh_simple`, the mesh's tree (its order, sorted groups, boxes, sample
    ranges and scale) -> (M,) the winding number of each query found from its closest face's side
    or the faces crossed from its centroid, inf where it must be walked (every query of a mesh
    that is not closed); given ``near`` (M,) bool, no faces crossed are counted for the queries
    where it is False (far from the mesh, walked: see :data:`FAR`)."""
    m = query.shape[0]
    out = query.new_full((m,), float("inf"))
    if m == 0 or faces.shape[0] == 0 or query.device.type != "cpu":
        return out
    _warp.init()
    cut = int(near is not None)
    args = [_tree.depth(faces.shape[0]), simple, query.contiguous(), face, rival, vertices.to(torch.float64).contiguous(), faces.contiguous(),
            twin, parent, wout, face_group.contiguous(), order, group, lo, hi, glo, ghi, scale.reshape(1), cut,
            near.contiguous() if cut else face.new_empty(0, dtype=torch.bool), out]
    _warp.launch(_sides_kernel(query.dtype), m, args, like=query, min_chunk=64, kept=True)
    return out


@_mesh_sides.register_fake
def _(query, face, rival, vertices, faces, twin, simple, parent, wout, face_group, order, group, lo, hi, glo, ghi, scale, near=None):
    return query.new_empty((query.shape[0],))


# (id(a tree's first tensor), one) -> (a weak reference to it, its mesh's closed and simple data, its caps):
# kept hierarchies analysed once (eager mode)
_ANALYSED: dict = {}


def analysis(vertices: torch.Tensor, faces: torch.Tensor, face_group: torch.Tensor, padding, t: _tree.Tree, queries, kept: bool,
             one: bool = False):
    """(closed, simple, caps): :func:`._search.closed` and :func:`_mesh_simple` of a mesh and its
    tree. A kept hierarchy (a :class:`MeshBVH` queried many times) is analysed whatever the
    number of queries, once: in eager mode the result is kept as long as its tree lives; an
    open kept CPU mesh (``one``) is analysed capped (:mod:`._caps`): ``closed`` holds its own
    closedness and worst shape factor with the capped mesh's twins, ``simple`` the capped mesh's
    analysis and ``caps`` the :class:`._caps.Caps` (else None). ``simple``: :func:`_mesh_simple`'s
    three tensors, then the analysed mesh's face groups and its tree's order, sorted groups,
    boxes, sample ranges and scale (the crossings' walk, :mod:`._crossings`)."""
    cache = kept and not torch.compiler.is_compiling()
    if cache:
        hit = _ANALYSED.get((id(t.a), one))
        if hit is not None and hit[0]() is t.a:
            return hit[1], hit[2], hit[3]
    vertices = vertices.detach()
    searched = vertices.to(t.a.dtype)
    closed = _search.closed(searched, faces, face_group, padding)
    capped = None
    if cache and one and faces.device.type == "cpu" and faces.shape[0] > 0 and not bool(closed[0]):  # (a host read, once per kept mesh)
        capped = _caps.capped(vertices, faces, t.a.dtype)
    if capped is None:
        whole, group, tree, shut = faces, face_group, t, closed
        padded, pad, count = padding is not None, -1 if padding is None else padding, max(faces.shape[0], 1) if kept else queries
    else:  # the capped mesh, on a hierarchy of its own (not one: the thread's kept builds of the user's meshes stay)
        whole = capped.faces
        group = torch.zeros(whole.shape[0], dtype=torch.int64)
        tree, shut = _search.tree(searched, whole, group), _search.closed(searched, whole, group, None)
        padded, pad, count = False, -1, whole.shape[0]
        closed = [closed[0], closed[1], shut[2]]
    simple = _mesh_simple(vertices, whole, group, padded, pad, count, shut[0], shut[2], tree.order, tree.a, tree.b, tree.c, tree.group,
                          tree.lo, tree.hi, tree.glo, tree.ghi, tree.center, tree.normal, tree.moment, tree.radius, tree.scale)
    simple = [*simple, group, tree.order, tree.group, tree.lo, tree.hi, tree.glo, tree.ghi, tree.scale]  # (and the tree its crossings walk)
    if cache:
        key = (id(t.a), one)
        _ANALYSED[key] = (weakref.ref(t.a, lambda _, key=key: _ANALYSED.pop(key, None)), closed, simple, capped)
    return closed, simple, capped


def known(query: torch.Tensor, face: torch.Tensor, rival: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor,
          closed: list[torch.Tensor], simple: list[torch.Tensor], capped=None, scale: Optional[torch.Tensor] = None,
          reach: Optional[torch.Tensor] = None, radius: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(M,) the winding numbers of the queries that their closest face's side decides (inf where
    a walk must: see the module docs); ``face`` and ``rival`` from :func:`._search.closest`,
    ``closed``, ``simple`` and ``capped`` from :func:`analysis` (an open mesh's caps: the
    capped mesh's side less the caps' winding number, :mod:`._caps`; ``scale`` its tree's).
    Given ``reach`` (M,), each query's distance to its mesh, and ``radius``, the tree's node
    radii, the queries ``FAR`` or more times the root's radius from the mesh are left to the walk:
    on an open mesh all of them, on a closed one those its closest face's side does not decide."""
    near = None
    if reach is not None and radius is not None and radius.numel():
        near = reach.detach() < FAR * radius[0]
        if capped is not None:  # (the caps' check costs more than their walks)
            face = torch.where(near, face, -1)
    whole = faces if capped is None else capped.faces
    sides = _mesh_sides(query.detach().contiguous(), face, rival, vertices.detach(), whole, closed[2], *simple, near)
    return sides if capped is None else _caps.known(query, face, rival, vertices, faces, sides, capped, scale, simple)
