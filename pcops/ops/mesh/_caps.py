"""The sign of signed ``mesh_distance`` on an open mesh without a winding-number walk, from caps
over its holes (CPU, one kept mesh, eager mode).

An open mesh M has edges used more often one way than the other (its boundary: the holes of a
scan, the open ends of a part). Caps C, triangles spanning each hole, close it: every edge of
M + C is used as often each way, so the winding number W of M + C is an integer, constant
between its faces, and the side analysis of closed meshes (:mod:`._sides`) gives it from the
side of a query's closest face. Winding numbers add over faces, so the open mesh's own is

    w(q) = W(q) - w_C(q),

where w_C is the caps' winding number. Any caps will do for this identity, whatever their
shape, crossings or folds: the analysis flags the faces that cross or touch others (their
queries are walked), and well-shaped caps leave fewer of those and a narrower band of rivals.

* the caps (:func:`caps`): the unmatched edge uses, reversed, chained into loops; each loop
  triangulated by clipping its best-shaped ear first (the smallest squared longest edge over
  twice the area), for at most ``EDGES`` unmatched edges (more: no caps, every query walked);
* the analysis (:func:`._sides.analysis`, once per kept mesh): the closed mesh M + C's, on a
  hierarchy of its own built for it, and the caps' hierarchy (:func:`capped`), kept; for each
  face of M, its box widened by ``RHO`` times the mesh's size (every query nearer than that to
  the face lies in it): the squared distance from it to the caps' boxes and a bound on
  4 pi |w_C| in it, as below but from box to box (``_descent_func``, one pass for both);
* per query (``pcops::mesh_capped``, a thread per query whose side gave W): the closest face
  of M was found by the usual search (and its rival within the rounding band, :mod:`._sides`),
  so W is the side of that face's only if no cap face is as near as the mesh: within ``1 +
  WIDE`` times that distance (plus ``WIDE`` times the mesh's size), measured in float64, such
  a face makes the side of the mesh's face unreliable (queries closest to a hole's rim among
  them: a cap shares the rim's edges): W is then counted from that face's centroid through the
  faces of M + C crossed on the way (:mod:`._crossings`; unclear crossings: the query walked),
  and the caps' winding number walked, as below. A query nearer than the widening to its face,
  whose neighbourhood's caps lie beyond that band and whose bound there is under ``BOUND``,
  takes W at once. For the
  others, one pass down the caps' boxes looks for a cap face in the band and bounds |w_C| by
  the area of each face over 4 pi times its squared distance (a solid angle is at most that),
  or of each node far enough for its size (``OPEN``, ``SHARE``) over its box's: under
  ``BOUND`` (< 1/2), W - w_C lies on W's side of 1/2, and w = W. Otherwise w_C is walked (the
  fast winding number of :mod:`._search`) coarsely, and again with ``BETA`` where W - w_C lies
  within ``MARGIN`` of 1/2, as the whole mesh's walk is: the same sign as the exact winding
  number wherever |w - 1/2| >= 0.1.

GPUs, padded or packed batches, meshes built in the call and compiled graphs walk every query
of an open mesh as before (the caps are made on the host, of a size the data decides).
"""

import heapq
import math
from typing import NamedTuple, Optional

import numpy as np
import torch
import warp as wp

from ... import _threads, _warp, _warp_funcs
from . import _crossings, _search, _tree

EDGES = 1 << 12  # unmatched edge uses at most (the caps are clipped in Python, once per kept mesh)
WIDE = 1e-6  # a cap face this much nearer than the mesh's closest face, relatively, counts as as near
BOUND = 0.45  # the caps' winding number bounded below this: the capped mesh's side decides (it is an integer)
OPEN = 1.0  # a node of the caps' boxes is bounded as a whole when farther than this times its box's diagonal,
SHARE = 1 / 8  # ... or when its bound is under this share of 4 pi BOUND (a leaf: whenever no face may be in the band)
RHO = 1 / 64  # times the mesh's size: each face's neighbourhood bounded once (queries nearer than this to their face)
_STACK = 64


class Caps(NamedTuple):
    """An open mesh capped: ``faces`` the mesh's faces then the caps' (rows of the same vertices),
    ``tree`` the caps' own hierarchy (searched in the mesh's dtype)."""

    faces: torch.Tensor
    tree: _tree.Tree
    area: torch.Tensor  # (nodes,) float64: the area of each node's faces
    gap: torch.Tensor  # (F,) float64: each mesh face's neighbourhood, the squared distance its caps are at least
    far: torch.Tensor  # (F,) float64: ... and a bound on 4 pi |w_C| in it (inf: none)
    rho2: torch.Tensor  # (1,) float64: the squared widening of the neighbourhoods (a query nearer its face lies in it)


def loops(faces: np.ndarray, limit: Optional[int] = None) -> Optional[list[list[int]]]:
    """The unmatched edge uses of faces (F, 3), reversed, as closed loops of vertices: each
    directed edge (a, b) used more often than (b, a) gives that many uses of (b, a), chained
    end to start (every vertex ends as many as it starts: a boundary has none); None where there
    are more than ``limit`` of them (counted before any is chained)."""
    if faces.shape[0] == 0:
        return []
    edges = np.stack([faces, np.roll(faces, -1, axis=1)], -1).reshape(-1, 2)
    edges = edges[edges[:, 0] != edges[:, 1]]
    low, high = edges.min(1), edges.max(1)
    up = np.where(edges[:, 0] < edges[:, 1], 1, -1)
    width = int(high.max()) + 1 if high.size else 1
    keys, inverse = np.unique(low.astype(np.int64) * width + high, return_inverse=True)
    net = np.bincount(inverse.reshape(-1), weights=up, minlength=len(keys)).astype(np.int64)
    if limit is not None and int(np.abs(net).sum()) > limit:
        return None
    pairs = np.stack([keys // width, keys % width], 1)
    nexts: dict[int, list[int]] = {}
    for (lo, hi), k in zip(pairs[net != 0].tolist(), net[net != 0].tolist()):
        start, end = (hi, lo) if k > 0 else (lo, hi)  # used lo -> hi k times more: the caps use hi -> lo
        nexts.setdefault(start, []).extend([end] * abs(k))
    out = []
    for first in list(nexts):
        while nexts[first]:
            loop, at = [first], nexts[first].pop()
            while at != first:
                loop.append(at)
                at = nexts[at].pop()
            out.append(loop)
    return out


def _factor(v, a: int, b: int, c: int) -> float:
    """Squared longest edge over twice the area of triangle abc (inf when flat); ``v`` rows of
    three coordinates (plain floats: a loop's ears are measured one at a time)."""
    (ax, ay, az), (bx, by, bz), (cx, cy, cz) = v[a], v[b], v[c]
    ux, uy, uz, wx, wy, wz = bx - ax, by - ay, bz - az, cx - ax, cy - ay, cz - az
    nx, ny, nz = uy * wz - uz * wy, uz * wx - ux * wz, ux * wy - uy * wx
    area2 = math.sqrt(nx * nx + ny * ny + nz * nz)
    longest = max(ux * ux + uy * uy + uz * uz, wx * wx + wy * wy + wz * wz, (cx - bx) ** 2 + (cy - by) ** 2 + (cz - bz) ** 2)
    return longest / area2 if area2 > 0 else math.inf


def clip(vertices, loop: list[int]) -> list[tuple[int, int, int]]:
    """Loop (v0, ..., vL-1) (the caps' edges v_k -> v_k+1; ``vertices`` rows of three floats) as
    L - 2 triangles, the best-shaped ear (v_k-1, v_k, v_k+1) first: each ear uses two of the
    loop's edges and leaves the third, reversed, to the loop that remains, so the triangles use
    every inner edge once each way."""
    n = len(loop)
    if n < 3:
        return []
    prev, nxt = [(k - 1) % n for k in range(n)], [(k + 1) % n for k in range(n)]
    stamp = [0] * n
    heap = [(_factor(vertices, loop[prev[k]], loop[k], loop[nxt[k]]), k, 0) for k in range(n)]
    heapq.heapify(heap)
    out, left = [], n
    while left > 3:
        _, k, seen = heapq.heappop(heap)
        if seen != stamp[k]:
            continue
        a, b = prev[k], nxt[k]
        out.append((loop[a], loop[k], loop[b]))
        nxt[a], prev[b], stamp[k] = b, a, -1
        left -= 1
        for j in (a, b):
            stamp[j] += 1
            heapq.heappush(heap, (_factor(vertices, loop[prev[j]], loop[j], loop[nxt[j]]), j, stamp[j]))
    k = next(j for j in range(n) if stamp[j] >= 0)
    out.append((loop[prev[k]], loop[k], loop[nxt[k]]))
    return out


def caps(vertices: torch.Tensor, faces: torch.Tensor) -> Optional[torch.Tensor]:
    """(C, 3) int64 triangles over the holes of one mesh (rows of ``vertices``); None where it
    has more than ``EDGES`` unmatched edge uses or a row out of range (the mesh must be open: at
    least one unmatched use)."""
    f = faces.cpu().numpy()
    if f.size and (f.min() < 0 or f.max() >= vertices.shape[0]):  # (unvalidated rows out of range: walked, as before)
        return None
    holes = loops(f, EDGES)
    if holes is None:
        return None
    v = vertices.detach().cpu().to(torch.float64).tolist()
    triangles = [t for loop in holes for t in clip(v, loop)]
    return torch.tensor(triangles, dtype=torch.int64).reshape(-1, 3)


@_warp.kernels
def _descent_func(dtype: torch.dtype, points: bool):
    """``descent(lo, hi, band, depth, <the caps' corners, boxes and node areas>)``: (the smallest
    squared distance measured from the box [lo, hi] to the caps, a bound on 4 pi |w_C| anywhere
    in it), one pass down the caps' boxes in float64. A node beyond squared distance ``band``
    and far for its size (``OPEN``, ``SHARE``) counts as a whole: its box's distance, and its
    area over that distance squared (a solid angle is at most a face's area over its squared
    distance); the others are opened down to their faces. ``points``: the box is a query point,
    each face is measured exactly, the pass stops at a face within the band, every leaf beyond
    the band counts by its box, and the bound's sum stops at 4 pi ``BOUND`` (past which it
    decides nothing); else each face counts by its own box."""
    v = _warp.vec3(dtype)
    triangle_d2, _ = _search._funcs(torch.float64)
    budget, open2 = wp.float64(BOUND * 4.0 * math.pi), wp.float64(OPEN * OPEN)
    share = budget * wp.float64(SHARE)
    zero = wp.vec3d(0.0, 0.0, 0.0)
    _nodes = wp.types.vector(length=_STACK, dtype=wp.int32)

    @wp.func(module="unique")
    def descent(blo: wp.vec3d, bhi: wp.vec3d, band: wp.float64, depth: int, ca: wp.array(dtype=v), cb: wp.array(dtype=v),
                cc: wp.array(dtype=v), lo: wp.array(dtype=v), hi: wp.array(dtype=v), area: wp.array(dtype=wp.float64)):
        nearest = wp.float64(wp.inf)
        bound = wp.float64(0.0)
        n = wp.int64(ca.shape[0])
        stack_node = _nodes()
        stack_depth = _nodes()
        top = int(1)
        stack_node[0] = 0
        stack_depth[0] = 0
        while top > 0 and not (nearest <= band):
            top = top - 1
            node = stack_node[top]
            d = stack_depth[top]
            l, h = wp.vec3d(lo[node]), wp.vec3d(hi[node])
            e = wp.max(wp.max(l - bhi, blo - h), zero)
            g2 = wp.dot(e, e)
            if g2 > band:
                if wp.static(points):
                    if bound >= budget:
                        continue
                    if d == depth or area[node] < share * g2 or g2 > open2 * wp.length_sq(h - l):
                        bound += area[node] / g2  # (a point's nearest counts only where a face is in the band)
                        continue
                elif area[node] < share * g2 or g2 > open2 * wp.length_sq(h - l):
                    nearest = wp.min(nearest, g2)
                    bound += area[node] / g2
                    continue
            if d == depth:
                k = node + 1 - (1 << d)
                for j in range(_warp_funcs.part(k, n, depth), _warp_funcs.part(k + 1, n, depth)):
                    a, b, c = wp.vec3d(ca[j]), wp.vec3d(cb[j]), wp.vec3d(cc[j])
                    t2 = wp.float64(0.0)
                    if wp.static(points):
                        t2 = triangle_d2(blo, a, b, c)
                    else:
                        f = wp.max(wp.max(wp.min(a, wp.min(b, c)) - bhi, blo - wp.max(a, wp.max(b, c))), zero)
                        t2 = wp.dot(f, f)
                    nearest = wp.min(nearest, t2)
                    twice = wp.length(wp.cross(b - a, c - a))
                    if wp.static(points):
                        bound += twice / (wp.float64(2.0) * t2)  # (t2 = 0 is in the band: the pass stops)
                    else:
                        bound += wp.where(t2 > wp.float64(0.0), twice / (wp.float64(2.0) * t2), wp.float64(wp.inf))
                continue
            stack_node[top] = 2 * node + 1
            stack_depth[top] = d + 1
            stack_node[top + 1] = 2 * node + 2
            stack_depth[top + 1] = d + 1
            top = top + 2
        return nearest, bound

    return descent


@_warp.kernels
def _neighbourhood_kernel(dtype: torch.dtype):
    v = _warp.vec3(dtype)
    descent = _descent_func(dtype, False)

    @wp.kernel(enable_backward=False, module="unique")
    def neighbourhood(start: int, depth: int, vertices: wp.array(dtype=wp.vec3d), faces: wp.array2d(dtype=wp.int64), rho: wp.float64,
                      ca: wp.array(dtype=v), cb: wp.array(dtype=v), cc: wp.array(dtype=v),
                      lo: wp.array(dtype=v), hi: wp.array(dtype=v), area: wp.array(dtype=wp.float64),
                      gap: wp.array(dtype=wp.float64), far: wp.array(dtype=wp.float64)):
        """Face f's box widened by rho on every side (where every query within rho of the face
        lies): the squared distance from it to the caps' boxes (a lower bound of any of its
        points' to the caps) and a bound on 4 pi |w_C| at any of its points (inf where a cap
        face's box meets it)."""
        f = wp.tid() + start
        x0, x1, x2 = vertices[int(faces[f, 0])], vertices[int(faces[f, 1])], vertices[int(faces[f, 2])]
        pad = wp.vec3d(rho, rho, rho)
        nearest, bound = descent(wp.min(x0, wp.min(x1, x2)) - pad, wp.max(x0, wp.max(x1, x2)) + pad, wp.float64(-1.0), depth,
                                 ca, cb, cc, lo, hi, area)
        gap[f] = nearest
        far[f] = bound

    return neighbourhood


@_warp.kernels
def _check_func(dtype: torch.dtype):
    """``check(q, band, depth, <the caps' corners, boxes and node areas>)``: (whether a cap face
    lies within squared distance ``band`` of q, a bound on 4 pi |w_C(q)| that decides nothing
    from 4 pi ``BOUND`` on): :func:`_descent_func` of the point q."""
    v = _warp.vec3(dtype)
    descent = _descent_func(dtype, True)

    @wp.func(module="unique")
    def check(q64: wp.vec3d, band: wp.float64, depth: int, ca: wp.array(dtype=v), cb: wp.array(dtype=v), cc: wp.array(dtype=v),
              lo: wp.array(dtype=v), hi: wp.array(dtype=v), area: wp.array(dtype=wp.float64)):
        nearest, bound = descent(q64, q64, band, depth, ca, cb, cc, lo, hi, area)
        return nearest <= band, bound

    return check


@_warp.kernels
def _capped_kernel(dtype: torch.dtype):
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    m = wp.mat33f if dtype == torch.float32 else wp.mat33d
    walk = _search.walk_func(dtype)
    check = _check_func(dtype)
    reference = _crossings.reference_func(dtype)
    triangle_d2, _ = _search._funcs(torch.float64)
    coarse2, fine2, margin = s(_search.COARSE**2), s(_search.BETA**2), s(_search.MARGIN)
    wide, slack = wp.float64(WIDE), wp.float64(1.0 + 1e-12)
    budget = wp.float64(BOUND * 4.0 * math.pi)

    @wp.func(module="unique")
    def corner_d2(q: wp.vec3d, vertices: wp.array(dtype=wp.vec3d), faces: wp.array2d(dtype=wp.int64), f: int):
        return triangle_d2(q, vertices[int(faces[f, 0])], vertices[int(faces[f, 1])], vertices[int(faces[f, 2])])

    @wp.kernel(enable_backward=False, module="unique")
    def capped(start: int, depth: int, query: wp.array(dtype=v), face: wp.array(dtype=wp.int64), rival: wp.array(dtype=wp.int64),
               vertices: wp.array(dtype=wp.vec3d), faces: wp.array2d(dtype=wp.int64), known: wp.array(dtype=s),
               ca: wp.array(dtype=v), cb: wp.array(dtype=v), cc: wp.array(dtype=v), group: wp.array(dtype=wp.int64),
               lo: wp.array(dtype=v), hi: wp.array(dtype=v), glo: wp.array(dtype=wp.int64), ghi: wp.array(dtype=wp.int64),
               center: wp.array(dtype=v), normal: wp.array(dtype=v), moment: wp.array(dtype=m), radius: wp.array(dtype=s),
               area: wp.array(dtype=wp.float64), gap: wp.array(dtype=wp.float64), far: wp.array(dtype=wp.float64),
               rho2: wp.array(dtype=wp.float64), scale: wp.array(dtype=s), wdepth: int, whole: wp.array2d(dtype=wp.int64),
               parent: wp.array(dtype=wp.int64), wout: wp.array(dtype=wp.float64), wgroup: wp.array(dtype=wp.int64),
               worder: wp.array(dtype=wp.int64), wsorted: wp.array(dtype=wp.int64), wlo: wp.array(dtype=v), whi: wp.array(dtype=v),
               wglo: wp.array(dtype=wp.int64), wghi: wp.array(dtype=wp.int64), wscale: wp.array(dtype=s), out: wp.array(dtype=s)):
        """Query i whose closest face's side on the capped mesh gave ``known`` W: W less the
        caps' winding number; where a cap face is as near as the mesh, W from the faces of the
        capped mesh crossed from its face's centroid (:mod:`._crossings`) less the caps'
        walked winding number; inf (walk it) where that is unclear."""
        i = wp.tid() + start
        big = known[i]
        out[i] = s(wp.inf)
        if not (big < s(wp.inf)):
            return
        q = query[i]
        q64 = wp.vec3d(q)
        f = int(face[i])
        own = corner_d2(q64, vertices, faces, f)
        d2 = own
        if rival[i] >= wp.int64(0):
            d2 = wp.min(d2, corner_d2(q64, vertices, faces, int(rival[i])))
        r = wp.sqrt(d2) * (wp.float64(1.0) + wide) + wide * wp.float64(scale[0])
        band = r * r * slack
        if own <= rho2[0] and gap[f] > band and far[f] < budget:  # its face's neighbourhood, where the query lies, decides
            out[i] = big
            return
        hit, bound = check(q64, band, depth, ca, cb, cc, lo, hi, area)
        if hit:  # a cap face as near as the mesh: the side of the mesh's face may not be W's
            big = s(reference(q64, f, wdepth, vertices, whole, parent, wout, wgroup, worder, wsorted, wlo, whi, wglo, wghi, wscale))
            if not (big < s(wp.inf)):
                return
        elif bound < budget:  # |w_C| < BOUND: W's side of 1/2
            out[i] = big
            return
        w = big - walk(q, wp.int64(0), coarse2, depth, ca, cb, cc, group, glo, ghi, center, normal, moment, radius, -1)
        if wp.abs(w - s(0.5)) < margin:
            w = big - walk(q, wp.int64(0), fine2, depth, ca, cb, cc, group, glo, ghi, center, normal, moment, radius, -1)
        out[i] = w

    return capped


@_threads.custom_op("pcops::mesh_capped", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _mesh_capped(query: torch.Tensor, face: torch.Tensor, rival: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor,
                 known: torch.Tensor, ta: torch.Tensor, tb: torch.Tensor, tc: torch.Tensor, group: torch.Tensor, lo: torch.Tensor,
                 hi: torch.Tensor, glo: torch.Tensor, ghi: torch.Tensor, center: torch.Tensor, normal: torch.Tensor, moment: torch.Tensor,
                 radius: torch.Tensor, area: torch.Tensor, gap: torch.Tensor, far: torch.Tensor, rho2: torch.Tensor,
                 scale: torch.Tensor, whole: torch.Tensor, parent: torch.Tensor, wout: torch.Tensor, wgroup: torch.Tensor,
                 worder: torch.Tensor, wsorted: torch.Tensor, wlo: torch.Tensor, whi: torch.Tensor, wglo: torch.Tensor, wghi: torch.Tensor,
                 wscale: torch.Tensor) -> torch.Tensor:
    """query (M, 3) in the caps' tree's dtype, face and rival (M,) from :func:`._search.closest` on
    the open mesh (vertices, faces), ``known`` (M,) the capped mesh's winding number from the
    side of each query's closest face (inf: none), the caps' tree, the capped mesh (``whole``
    faces) with its analysis (``parent``, ``wout``: :func:`._sides._mesh_simple`) and tree
    (``wgroup`` by face, order, sorted groups, boxes, sample ranges, scale) -> (M,) the open
    mesh's winding number, inf where the query must be walked (see the module docs)."""
    m = query.shape[0]
    out = query.new_full((m,), float("inf"))
    if m == 0 or ta.shape[0] == 0 or query.device.type != "cpu":
        return out
    _warp.init()
    m33 = wp.mat33f if query.dtype == torch.float32 else wp.mat33d
    args = [_tree.depth(ta.shape[0]), query.contiguous(), face, rival, vertices.to(torch.float64).contiguous(), faces.contiguous(),
            known.contiguous(), ta, tb, tc, group, lo, hi, glo, ghi, center, normal, _warp.Typed(moment, m33), radius, area,
            gap, far, rho2, scale.reshape(1), _tree.depth(whole.shape[0]), whole.contiguous(), parent, wout, wgroup, worder, wsorted, wlo, whi,
            wglo, wghi, wscale.reshape(1), out]
    _warp.launch(_capped_kernel(query.dtype), m, args, like=query, min_chunk=64, kept=True)
    return out


@_mesh_capped.register_fake
def _(query, face, rival, vertices, faces, known, ta, tb, tc, group, lo, hi, glo, ghi, center, normal, moment, radius, area, gap, far, rho2,
      scale, whole, parent, wout, wgroup, worder, wsorted, wlo, whi, wglo, wghi, wscale):
    return query.new_empty((query.shape[0],))


def known(query: torch.Tensor, face: torch.Tensor, rival: torch.Tensor, vertices: torch.Tensor, faces: torch.Tensor,
          sides: torch.Tensor, capped: Caps, scale: torch.Tensor, simple: list) -> torch.Tensor:
    """(M,) the open mesh's winding numbers found without its walk (inf elsewhere): ``sides`` the
    capped mesh's from :func:`._sides.known`, ``faces`` the open mesh's, ``scale`` its tree's,
    ``simple`` the capped mesh's analysis and tree (:func:`._sides.analysis`)."""
    t = capped.tree
    return _mesh_capped(query.detach().contiguous(), face, rival, vertices.detach(), faces, sides.to(query.dtype), t.a, t.b, t.c, t.group,
                        t.lo, t.hi, t.glo, t.ghi, t.center, t.normal, t.moment, t.radius, capped.area, capped.gap, capped.far,
                        capped.rho2, scale, capped.faces, *simple[1:])


def capped(vertices: torch.Tensor, faces: torch.Tensor, dtype: torch.dtype) -> Optional[Caps]:
    """One open CPU mesh's :class:`Caps` (its caps' tree in ``dtype``), None where it has too
    many unmatched edges (:func:`caps`)."""
    c = caps(vertices, faces)
    if c is None or c.shape[0] == 0:
        return None
    tree = _search.tree(vertices.detach().to(dtype), c, torch.zeros(c.shape[0], dtype=torch.int64))  # (not one: no kept build)
    area = _node_areas(tree)
    v64 = vertices.detach().to(torch.float64).contiguous()
    rho = RHO * float((v64.amax(0) - v64.amin(0)).amax()) if v64.shape[0] else 0.0
    gap, far = (v64.new_empty(faces.shape[0]) for _ in range(2))
    args = [_tree.depth(c.shape[0]), v64, faces.contiguous(), rho, tree.a, tree.b, tree.c, tree.lo, tree.hi, area, gap, far]
    _warp.launch(_neighbourhood_kernel(dtype), faces.shape[0], args, like=v64, min_chunk=64)
    return Caps(torch.cat([faces, c]), tree, area, gap, far, v64.new_full((1,), (rho * (1 - 1e-9)) ** 2))


def _node_areas(t: _tree.Tree) -> torch.Tensor:
    """(nodes,) float64: the summed area of each node's faces (node k of depth d holds the sorted
    faces floor(k F / 2^d) .. floor((k + 1) F / 2^d)), from differences of a running sum: widened
    by 2^-40 of each and by (F + 1) 2^-50 of the total (the sum's cancellation) for rounding."""
    a, b, c = (x.to(torch.float64) for x in (t.a, t.b, t.c))
    sums = torch.cat([a.new_zeros(1), torch.cumsum(torch.linalg.vector_norm(torch.linalg.cross(b - a, c - a), dim=-1) / 2, 0)])
    n, out = a.shape[0], a.new_zeros(t.lo.shape[0])
    for d in range(_tree.depth(n) + 1):
        k = torch.arange(1 << d)
        out[(1 << d) - 1 + k] = sums[((k + 1) * n) >> d] - sums[(k * n) >> d]
    return out * (1 + 2.0**-40) + (n + 1) * 2.0**-50 * float(sums[-1])
