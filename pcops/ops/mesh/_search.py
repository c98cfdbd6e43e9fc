"""Warp searches of a mesh's hierarchy (:mod:`._tree`), on CPU (all cores) and CUDA.

* ``pcops::mesh_closest``: for each query, the face at the smallest distance (or, with
  ``faces_to_points``, for each query triangle the point at the smallest distance: the same
  walk over a hierarchy of points stored as faces of three equal corners). One thread per
  query walks down to the nearer child first and stacks the farther one with its box distance;
  boxes farther than the best distance found are skipped. Distances that agree to rounding
  (within ``TIE`` eps times the size of the coordinates of the smallest: faces sharing the
  closest edge or vertex) are ties, won by the smaller face index, whatever order the walk
  takes. Nothing beyond ``max_dist`` is found (-1).
* ``pcops::mesh_winding``: the generalised winding number of each query (Jacobson et al.
  2013), by the hierarchical fast winding number (Barill et al. 2018): a node farther than
  ``BETA`` times its radius contributes its dipole expansion to second order, nearer nodes
  are opened, and the leaves' triangles contribute their exact solid angles. The sign only
  needs the side of 1/2, so each query is first walked with the coarser ``COARSE`` (fewer
  nodes opened; its error was at most 0.17 on the benchmark meshes, whose BETA walk's was
  0.05) and walked again with ``BETA`` where the coarse value is within ``MARGIN`` of 1/2: the
  sign is the BETA walk's wherever the coarse error stays below MARGIN + 0.1 = 0.4 and the
  winding number is 0.1 or more from 1/2 (a winding number within 0.1 of 1/2 may take either
  sign, as documented). On a closed mesh (``pcops::mesh_closed``: every edge used as often in
  one direction as in the other, so the winding number is an integer, constant between the
  faces) a query is not walked when the segment from the query before it (in the search's
  order, same sample) lies inside the ball about either of them whose radius is its distance to
  the mesh, less what rounding may have added to that distance (relatively, eps times the
  mesh's worst shape factor; absolutely, flat faces measured by their edges): no face lies
  between them, so it takes that query's winding number. Queries whose winding number
  :mod:`._sides` found from their closest face's side (``known``, finite) are not walked.

The kernels return indices and winding numbers only; distances, closest points and
barycentric coordinates are computed in torch from the faces found (:mod:`._triangle`),
which makes them differentiable, to any order, with respect to points and vertices.
"""

import math
from typing import Optional

import torch
import warp as wp

from ... import _threads, _validate, _warp, _warp_funcs
from . import _kept_tree, _tree

TIE = 8.0  # eps of the compute dtype, times the size of the coordinates: distances this close are ties
FLAT = 64.0  # eps: a triangle whose height is below this times its longest edge is measured by its edges
WELL = 0.1  # a triangle whose height is at least this times its longest edge is measured by its Voronoi regions
BETA = 2.0  # a node contributes its expansion when farther than BETA radii
COARSE = 1.2  # ... in the first, coarse walk; a coarse winding number within MARGIN of 1/2 is walked again with BETA
MARGIN = 0.3
REACH = 1.0 - 2.0**-10  # closed meshes: the share of a query's distance to the mesh held free of faces (rounding)
DEGREE = 512  # closed meshes: a vertex that is the lower end of more edge uses than this makes the mesh count as open
_STACK = 64
CHAIN = True  # CPU: a query starts from the face found by the query before it on its thread (tests compare with False)


@_warp.kernels
def _funcs(dtype: torch.dtype):
    """``triangle_d2(p, a, b, c)``: the squared distance from p to the triangle abc (exact for
    degenerate ones); ``solid_angle(p, a, b, c)``: the signed solid angle of abc seen from p."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    flat = wp.float64(FLAT * torch.finfo(dtype).eps)
    well = s(WELL * WELL)
    small = s(math.sqrt(torch.finfo(dtype).tiny) * 2.0**13)  # a longest squared edge below this: size^4 products near the subnormals
    near = s(torch.finfo(dtype).tiny ** (1 / 3) * 2.0**8)  # corners all nearer than this: size^3 products near them
    least = s(torch.finfo(dtype).tiny)  # (1 / a subnormal distance would overflow; corners at the query stay 0)
    normal = _warp_funcs.plane_normal(dtype)

    @wp.func(module="unique")
    def segment_d2(p: v, a: v, ab: v):
        length2 = wp.dot(ab, ab)
        t = s(0.0)
        if length2 > s(0.0):
            t = wp.clamp(wp.dot(p - a, ab) / length2, s(0.0), s(1.0))
        e = p - (a + t * ab)
        return wp.dot(e, e)

    @wp.func(module="unique")
    def edges_d2(p: v, a: v, b: v, c: v):
        """The nearest of the three edges, or the plane where p projects inside a solid triangle
        (height above ``FLAT`` eps of its longest edge). The plane in float64 (exact differences of
        float32 coordinates; float64 ones' from exact differences and products:
        :func:`pcops._warp_funcs.plane_normal`): a thin face's normal computed in its own precision
        is off by about eps over its shape factor, its height by that times p's distance from the corner."""
        ab, bc, ca = b - a, c - b, a - c
        best = wp.min(segment_d2(p, a, ab), wp.min(segment_d2(p, b, bc), segment_d2(p, c, ca)))
        pw, aw, bw, cw = wp.vec3d(p), wp.vec3d(a), wp.vec3d(b), wp.vec3d(c)
        abw, bcw, caw = bw - aw, cw - bw, aw - cw
        n = normal(aw, bw, cw)
        nn = wp.dot(n, n)
        longest = wp.max(wp.dot(abw, abw), wp.max(wp.dot(bcw, bcw), wp.dot(caw, caw)))
        if nn > flat * flat * longest * longest:  # p's side of each edge as in _triangle (the rounding of p - corner only)
            zero = wp.float64(0.0)
            if wp.dot(pw - bw, wp.cross(n, bcw)) >= zero and wp.dot(pw - cw, wp.cross(n, caw)) >= zero and wp.dot(pw - aw, wp.cross(n, abw)) >= zero:
                h = wp.dot(n, aw - pw)
                best = wp.min(best, s(h * (h / nn)))  # (h h / nn: size^6, which overflows)
        return best

    @wp.func(module="unique")
    def triangle_d2(p: v, a: v, b: v, c: v):
        ab, ac, bc = b - a, c - a, c - b
        n = wp.cross(ab, ac)
        nn = wp.dot(n, n)
        longest = wp.max(wp.dot(ab, ab), wp.max(wp.dot(bc, bc), wp.dot(ac, ac)))
        if not (nn > well * longest * longest) or longest < small:  # slivers, flat, degenerate and tiny triangles: edges and interior test
            return edges_d2(p, a, b, c)  # (whose plane is float64's: a float32 triangle of edges below about 3e-8 has size^4 products underflow)
        # a well-shaped triangle (height >= WELL times its longest edge): the Voronoi region of p
        # (vertex, edge or face; Ericson 2005, 5.1.5), whose signs a sliver's rounding would flip
        ap = p - a
        d1, d2 = wp.dot(ab, ap), wp.dot(ac, ap)
        if d1 <= s(0.0) and d2 <= s(0.0):
            return wp.dot(ap, ap)
        bp = p - b
        d3, d4 = wp.dot(ab, bp), wp.dot(ac, bp)
        if d3 >= s(0.0) and d4 <= d3:
            return wp.dot(bp, bp)
        vc = d1 * d4 - d3 * d2
        if vc <= s(0.0) and d1 >= s(0.0) and d3 <= s(0.0):
            return segment_d2(p, a, ab)
        cp = p - c
        d5, d6 = wp.dot(ab, cp), wp.dot(ac, cp)
        if d6 >= s(0.0) and d5 <= d6:
            return wp.dot(cp, cp)
        vb = d5 * d2 - d1 * d6
        if vb <= s(0.0) and d2 >= s(0.0) and d6 <= s(0.0):
            return segment_d2(p, a, ac)
        va = d3 * d6 - d5 * d4
        if va <= s(0.0) and d4 - d3 >= s(0.0) and d5 - d6 >= s(0.0):
            return segment_d2(p, b, bc)
        h = wp.dot(n, ap)  # inside: the height over the plane
        return h * (h / nn)  # (h h / nn: size^6, which over- or underflows at sizes the coordinates allow)

    @wp.func(module="unique")
    def solid_angle(p: v, a: v, b: v, c: v):
        x, y, z = a - p, b - p, c - p
        lx, ly, lz = wp.length(x), wp.length(y), wp.length(z)
        big = wp.max(lx, wp.max(ly, lz))
        unit = wp.where(big < near, s(1.0) / wp.max(big, least), s(1.0))  # (size^3 products near the subnormals: the triangle seen at unit size)
        x, y, z = x * unit, y * unit, z * unit
        lx, ly, lz = lx * unit, ly * unit, lz * unit
        num = wp.dot(x, wp.cross(y, z))
        den = lx * ly * lz + wp.dot(x, y) * lz + wp.dot(y, z) * lx + wp.dot(z, x) * ly
        return s(2.0) * wp.atan2(num, den)

    return triangle_d2, solid_angle


@_warp.kernels
def _closest_kernel(dtype: torch.dtype, faces_to_points: bool, rivals: bool = False):
    """The search of :func:`_mesh_closest`; ``rivals``: the other items within a wider band
    are tracked too (signed calls): the tie band widened by what a face's plane may add to a
    distance by rounding (about eps times the mesh's worst shape factor ``shape[0]`` times the
    distance from the face), every face in it measured."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    triangle_d2, _ = _funcs(dtype)
    _, finite_point = _warp_funcs.finite(dtype)
    eps = torch.finfo(dtype).eps
    slack = s((1.0 + 64.0 * eps) ** 2)  # a box is skipped only when farther than this times the bound (rounding)
    tie = s(TIE * eps)
    _nodes = wp.types.vector(length=_STACK, dtype=wp.int32)
    _bounds = wp.types.vector(length=_STACK, dtype=s)

    @wp.func(module="unique")
    def limits(best: s, near: s, wide: s, size: s, max_d2: s):
        """(upper, reach) for the smallest squared distance ``best``: a face farther than upper
        cannot win, not even a tie (the band); one farther than reach is not measured (upper, or
        the rivals' band r + near + wide (r + 2 size))."""
        r = wp.sqrt(best)
        upper = wp.min((r + near) * (r + near), max_d2)
        band = r + near + wide * (r + s(2.0) * size)
        return upper, wp.min(wp.max(upper, band * band), max_d2)

    @wp.kernel(enable_backward=False, module="unique")
    def closest(
        start: int,
        depth: int,
        rows: wp.array(dtype=wp.int64),
        qa: wp.array(dtype=v),
        qb: wp.array(dtype=v),
        qc: wp.array(dtype=v),
        query_group: wp.array(dtype=wp.int64),
        ta: wp.array(dtype=v),
        tb: wp.array(dtype=v),
        tc: wp.array(dtype=v),
        group: wp.array(dtype=wp.int64),
        order: wp.array(dtype=wp.int64),
        lo: wp.array(dtype=v),
        hi: wp.array(dtype=v),
        glo: wp.array(dtype=wp.int64),
        ghi: wp.array(dtype=wp.int64),
        scale: wp.array(dtype=s),
        max_d2: s,
        shape: wp.array(dtype=wp.float64),
        chain: int,
        slot: wp.array(dtype=wp.int64),
        found: wp.array(dtype=wp.int64),
        rival: wp.array(dtype=wp.int64),
    ):
        i = int(rows[wp.tid() + start])
        a = v(qa[i])
        b, c, qlo, qhi = a, a, a, a  # point queries (qa, qb and qc the same points)
        if wp.static(faces_to_points):
            b, c = v(qb[i]), v(qc[i])
            qlo = wp.min(a, wp.min(b, c))
            qhi = wp.max(a, wp.max(b, c))
        found[i] = wp.int64(-1)
        slot[i] = wp.int64(-1)
        rival[i] = wp.int64(-1)
        if not (finite_point(qlo) and finite_point(qhi)):
            return
        g = query_group[i]
        single = glo[0] == ghi[0] and glo[0] == g  # one mesh (or one sample of points), the query's: no sample ranges to test
        size = wp.max(scale[0], wp.max(wp.max(wp.abs(qlo[0]), wp.abs(qhi[0])), wp.max(wp.max(wp.abs(qlo[1]), wp.abs(qhi[1])), wp.max(wp.abs(qlo[2]), wp.abs(qhi[2])))))
        near = tie * size * s(2.0)  # two distances closer than this are a tie
        wide = s(0.0)  # rivals: the band of a distance r is r + near + wide (r + 2 size)
        track = False  # rivals, on a simple mesh (a shape factor above 0; see ._sides)
        if wp.static(rivals):
            wide = s(4.0 * eps) * s(shape[0])
            track = shape[0] > wp.float64(0.0)
        n = wp.int64(ta.shape[0])
        zero = v(s(0.0), s(0.0), s(0.0))
        best = max_d2  # the smallest squared distance measured (within the band)
        upper = max_d2  # the band: a face farther than this cannot win, not even a tie
        reach = max_d2  # a face farther than this is not measured (upper, or the rivals' band)
        # The face found is the smallest index among the faces within the band of the smallest
        # distance, whatever order the walk takes (so whatever the other queries). The band only
        # narrows and every face of the final band is measured inside it: a face in the band
        # replaces the one taken if its index is smaller, or if the one taken has left the band;
        # a face passed over for its index (``passed``: the smallest such distance) may lie in the
        # final band while the one that beat it leaves it (faces chaining through the band, a few
        # times the rounding wide): then (``again``) a second walk takes the final band's faces.
        face = wp.int64(-1)
        at = wp.int64(-1)
        taken = s(wp.inf)  # the squared distance of the face taken
        passed = s(wp.inf)
        again = bool(False)
        # the three smallest squared distances of distinct items (the first two with their items):
        # the items within the tie band besides the one found
        d_1, d_2, d_3 = s(wp.inf), s(wp.inf), s(wp.inf)
        f_1, f_2 = wp.int64(-1), wp.int64(-1)
        chained = wp.int64(-1)  # the sorted row measured before the walk
        if chain != 0 and wp.tid() > 0:  # CPU: thread t - 1 ran before t; its face bounds this query's distance
            prev = int(rows[wp.tid() + start - 1])
            jp = slot[prev]
            if jp >= wp.int64(0) and query_group[prev] == g:
                d2 = s(0.0)
                if wp.static(faces_to_points):
                    d2 = triangle_d2(ta[jp], a, b, c)
                else:
                    d2 = triangle_d2(a, ta[jp], tb[jp], tc[jp])
                d_1 = d2
                f_1 = order[jp]
                chained = jp
                if d2 <= max_d2:
                    best = d2
                    upper, reach = limits(best, near, wide, size, max_d2)
                    face = order[jp]
                    at = jp
                    taken = d2
        stack_node = _nodes()
        stack_depth = _nodes()
        stack_bound = _bounds()
        for walk in range(2):
            if walk == 1:
                if not (again and passed <= upper):
                    break
                face = wp.int64(-1)
            top = int(1)  # the root: entry 0, depth 0, bound 0
            stack_node[0] = 0
            stack_depth[0] = 0
            stack_bound[0] = s(0.0)
            while top > 0:
                top = top - 1
                node = stack_node[top]
                d = stack_depth[top]
                if stack_bound[top] > reach * slack:
                    continue
                # a node past upper (reached through the rivals' wider band only): its faces are
                # measured for the rivals but never taken, so the face found is the search's without
                # rivals, face for face (a sliver's rounded distance can be far too small)
                eligible = stack_bound[top] <= upper * slack
                while True:
                    if not single and (g < glo[node] or g > ghi[node]):
                        break
                    if d == depth:  # a leaf
                        k = node + 1 - (1 << d)
                        j0, j1 = _warp_funcs.part(k, n, depth), _warp_funcs.part(k + 1, n, depth)
                        for j in range(j0, j1):
                            if single or group[j] == g:
                                d2 = s(0.0)
                                if wp.static(faces_to_points):
                                    d2 = triangle_d2(ta[j], a, b, c)
                                else:
                                    d2 = triangle_d2(a, ta[j], tb[j], tc[j])
                                f = order[j]
                                if walk == 1:  # the final band: the smaller index
                                    if eligible and d2 <= upper and (face < wp.int64(0) or f < face):
                                        face = f
                                        at = wp.int64(j)
                                    continue
                                if wp.static(rivals) and track and d2 <= reach and f != f_1 and f != f_2:  # (only the band counts)
                                    if d2 < d_1:
                                        d_3 = d_2
                                        d_2 = d_1
                                        f_2 = f_1
                                        d_1 = d2
                                        f_1 = f
                                    elif d2 < d_2:
                                        d_3 = d_2
                                        d_2 = d2
                                        f_2 = f
                                    elif d2 < d_3:
                                        d_3 = d2
                                if eligible and d2 <= upper and wp.int64(j) != chained:
                                    if d2 < best:
                                        best = d2
                                        upper, reach = limits(best, near, wide, size, max_d2)
                                    if face < wp.int64(0) or taken > upper:  # none yet, or the one taken left the band
                                        again = again or passed <= upper
                                        face, at, taken = f, wp.int64(j), d2
                                    elif f < face:
                                        passed = wp.min(passed, taken)
                                        face, at, taken = f, wp.int64(j), d2
                                    elif f != face:
                                        passed = wp.min(passed, d2)
                        break
                    left = 2 * node + 1
                    gl = wp.max(wp.max(lo[left] - qhi, qlo - hi[left]), zero)
                    gr = wp.max(wp.max(lo[left + 1] - qhi, qlo - hi[left + 1]), zero)
                    dl, dr = wp.dot(gl, gl), wp.dot(gr, gr)
                    first, second, bound, other = left, left + 1, dl, dr
                    if dr < dl:
                        first, second, bound, other = left + 1, left, dr, dl
                    stack_node[top] = second
                    stack_depth[top] = d + 1
                    stack_bound[top] = other
                    top = top + int(other <= reach * slack)
                    if bound > reach * slack:
                        break
                    eligible = eligible and bound <= upper * slack
                    node = first
                    d = d + 1
        found[i] = face
        slot[i] = at
        if not wp.static(rivals) or not track or face < wp.int64(0):
            return
        r = wp.sqrt(best)
        band = r + near + wide * (r + s(2.0) * size)
        band = band * band
        if d_3 <= band or band > max_d2:
            rival[i] = wp.int64(-2)  # two or more others in the band, or faces past max_dist not measured
        elif d_2 <= band:
            rival[i] = f_2
            if f_2 == face:
                rival[i] = f_1

    return closest


@_warp.kernels
def walk_func(dtype: torch.dtype):
    """``walk(q, g, beta2, depth, <the tree's arrays>, skip)``: the fast winding number of q
    about the faces of sample g (see the module docs)."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    m = wp.mat33f if dtype == torch.float32 else wp.mat33d
    _, solid_angle = _funcs(torch.float64)
    _nodes = wp.types.vector(length=_STACK, dtype=wp.int32)

    @wp.func(module="unique")
    def walk(
        q: v,
        g: wp.int64,
        beta2: s,
        depth: int,
        ta: wp.array(dtype=v),
        tb: wp.array(dtype=v),
        tc: wp.array(dtype=v),
        group: wp.array(dtype=wp.int64),
        glo: wp.array(dtype=wp.int64),
        ghi: wp.array(dtype=wp.int64),
        center: wp.array(dtype=v),
        normal: wp.array(dtype=v),
        moment: wp.array(dtype=m),
        radius: wp.array(dtype=s),
        skip: int,
    ):
        """The winding number of q about its sample's faces but the sorted face ``skip`` (-1: none),
        nodes farther than sqrt(beta2) radii expanded; the faces of the nodes opened measured in
        float64 (float32 values widened exactly)."""
        n = wp.int64(ta.shape[0])
        q64 = wp.vec3d(q)
        single = glo[0] == ghi[0] and glo[0] == g  # one mesh, the query's: no sample ranges to test
        total = s(0.0)
        stack_node = _nodes()
        stack_depth = _nodes()
        top = int(1)
        while top > 0:
            top = top - 1
            node = stack_node[top]
            d = stack_depth[top]
            while True:  # down the left children, stacking the right ones
                pure = single
                if not single:
                    lo_g, hi_g = glo[node], ghi[node]
                    if g < lo_g or g > hi_g:
                        break
                    pure = lo_g == hi_g
                r = center[node] - q
                r2 = wp.dot(r, r)
                rad = radius[node]
                if pure and r2 > beta2 * rad * rad:  # far: the dipole expansion of the node
                    inv = s(1.0) / wp.sqrt(r2)
                    u = r * inv
                    mo = moment[node]
                    # (n.r + tr M - 3 r.M r / r^2) / r^3, each factor at most the mesh's size cubed
                    # (r.M r and r^3 apart over- or underflow in float32 at sizes its coordinates allow)
                    total += ((wp.dot(normal[node], u) + (wp.trace(mo) - s(3.0) * wp.dot(u, mo * u)) * inv) * inv) * inv
                    break
                if d == depth:
                    k = node + 1 - (1 << d)
                    j0, j1 = _warp_funcs.part(k, n, depth), _warp_funcs.part(k + 1, n, depth)
                    for j in range(j0, j1):
                        if (single or group[j] == g) and j != skip:
                            total += s(solid_angle(q64, wp.vec3d(ta[j]), wp.vec3d(tb[j]), wp.vec3d(tc[j])))
                    break
                stack_node[top] = 2 * node + 2
                stack_depth[top] = d + 1
                top = top + 1
                node = 2 * node + 1
                d = d + 1
        return total / s(4.0 * math.pi)

    return walk


@_warp.kernels
def _winding_kernel(dtype: torch.dtype):
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    m = wp.mat33f if dtype == torch.float32 else wp.mat33d
    walk = walk_func(dtype)
    coarse2, fine2, margin = s(COARSE * COARSE), s(BETA * BETA), s(MARGIN)
    eps = torch.finfo(dtype).eps
    share, plane, rounding = s(REACH), s(16.0 * eps), s(576.0 * eps)

    @wp.kernel(enable_backward=False, module="unique")
    def winding(
        start: int,
        depth: int,
        rows: wp.array(dtype=wp.int64),
        query: wp.array(dtype=v),
        query_group: wp.array(dtype=wp.int64),
        ta: wp.array(dtype=v),
        tb: wp.array(dtype=v),
        tc: wp.array(dtype=v),
        group: wp.array(dtype=wp.int64),
        glo: wp.array(dtype=wp.int64),
        ghi: wp.array(dtype=wp.int64),
        center: wp.array(dtype=v),
        normal: wp.array(dtype=v),
        moment: wp.array(dtype=m),
        radius: wp.array(dtype=s),
        reach: wp.array(dtype=s),
        closed: wp.array(dtype=wp.int32),
        shape: wp.array(dtype=wp.float64),
        scale: wp.array(dtype=s),
        known: wp.array(dtype=s),
        head: wp.array(dtype=wp.bool),
        out: wp.array(dtype=s),
    ):
        t = wp.tid() + start
        i = int(rows[t])
        if known[i] < s(wp.inf):  # signed by the side of its closest face (see ._sides): no walk
            head[t] = True
            out[i] = known[i]
            return
        q = query[i]
        g = query_group[i]
        if t > 0 and closed[0] != 0:  # a closed mesh: the query before it may hold its winding number
            j = int(rows[t - 1])
            # a distance may exceed the true one by rounding: relatively, about eps times the
            # mesh's worst shape factor (the normal's direction), and absolutely, flat faces
            # measured by their edges (at most 64 eps times their longest edge)
            slack = plane * s(shape[0])
            free = (share - slack) * wp.max(reach[i], reach[j]) - (s(4.0) * slack + rounding) * scale[0]
            if query_group[j] == g and wp.length(q - query[j]) < free:
                head[t] = False  # no face between the two: the same winding number (see the module docs)
                return
        head[t] = True
        w = walk(q, g, coarse2, depth, ta, tb, tc, group, glo, ghi, center, normal, moment, radius, -1)
        if wp.abs(w - s(0.5)) < margin:  # near 1/2: the sign needs the finer expansion
            w = walk(q, g, fine2, depth, ta, tb, tc, group, glo, ghi, center, normal, moment, radius, -1)
        out[i] = w

    return winding


@_warp.kernels
def _follow_kernel(dtype: torch.dtype):
    s = _warp.scalar(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def follow(start: int, rows: wp.array(dtype=wp.int64), head: wp.array(dtype=wp.bool), out: wp.array(dtype=s)):
        """One thread: each query not walked (``head`` False, never the first) takes the winding
        number of the last one walked before it in the walking order ``rows``."""
        last = int(0)
        for t in range(rows.shape[0]):
            if head[t]:
                last = t
            else:
                out[int(rows[t])] = out[int(rows[last])]

    return follow


@_warp.kernels
def _closed_kernel(flat: float):
    """One thread (the CPU): ``out[0]`` = 1 if every edge of the faces (a padded batch's padding
    faces, sample id ``padding``, left out) is used as often from each end within its sample (the
    faces' boundary is empty: closed meshes), else 0; ``shape[0]`` the largest squared longest
    edge over twice the area of the faces whose height over longest edge is above ``flat`` (see
    :func:`_flat`), 0 if none; on a closed mesh, ``twin[f, e]`` the face across edge e (corners
    e, e + 1) of face f where that edge is used once each way (else it stays -1). Edges are
    bucketed by their lower vertex (a counting sort: ``starts``, V + 1 zeros; ``ends``,
    ``sample`` and ``use``, 3F) and each bucket's ends are matched pairwise; a bucket of more
    than ``DEGREE`` edge uses, or a vertex index out of range, counts as open (the check stays
    linear in the faces)."""
    degree = DEGREE

    @wp.func(module="unique")
    def edge(faces: wp.array2d(dtype=wp.int64), f: int, e: int):
        """(lower vertex, higher vertex, 1 if the edge runs upwards else -1) of edge e of face f."""
        u, w = faces[f, e], faces[f, (e + 1) % 3]
        up = int(-1)
        if u < w:
            up = 1
        return wp.min(u, w), wp.max(u, w), up

    @wp.kernel(enable_backward=False, module="unique")
    def closed(start: int, vertices: wp.array(dtype=wp.vec3d), faces: wp.array2d(dtype=wp.int64), group: wp.array(dtype=wp.int64),
               padded: int, padding: wp.int64, starts: wp.array(dtype=wp.int64), ends: wp.array(dtype=wp.int64),
               sample: wp.array(dtype=wp.int64), use: wp.array(dtype=wp.int64), out: wp.array(dtype=wp.int32),
               shape: wp.array(dtype=wp.float64), twin: wp.array2d(dtype=wp.int64)):
        nv = starts.shape[0] - 1
        ok = int(1)
        worst = wp.float64(0.0)
        for f in range(faces.shape[0]):  # shapes and bucket sizes, one place up (edges of a repeated corner left out)
            if padded == 0 or group[f] != padding:
                if wp.min(faces[f, 0], wp.min(faces[f, 1], faces[f, 2])) < wp.int64(0) or wp.max(faces[f, 0], wp.max(faces[f, 1], faces[f, 2])) >= wp.int64(nv):
                    ok = 0
                else:
                    va, vb, vc = vertices[int(faces[f, 0])], vertices[int(faces[f, 1])], vertices[int(faces[f, 2])]
                    area2 = wp.length(wp.cross(vb - va, vc - va))
                    longest = wp.max(wp.length_sq(vb - va), wp.max(wp.length_sq(vc - vb), wp.length_sq(va - vc)))
                    if area2 > wp.float64(flat) * longest:
                        worst = wp.max(worst, longest / area2)
                    for e in range(3):
                        lo, hi, up = edge(faces, f, e)
                        if lo != hi:
                            starts[int(lo) + 1] = starts[int(lo) + 1] + wp.int64(1)
        shape[0] = worst
        for x in range(nv):
            starts[x + 1] = starts[x + 1] + starts[x]
        if ok == 1:
            for f in range(faces.shape[0]):  # each edge's higher end and direction (2 hi + (up + 1) / 2) and sample; starts[x] moves to bucket x's end
                if padded == 0 or group[f] != padding:
                    for e in range(3):
                        lo, hi, up = edge(faces, f, e)
                        if lo != hi:
                            at = int(starts[int(lo)])
                            ends[at] = hi * wp.int64(2) + wp.int64((up + 1) / 2)
                            sample[at] = group[f]
                            use[at] = wp.int64(3 * f + e)
                            starts[int(lo)] = starts[int(lo)] + wp.int64(1)
        b0 = int(0)
        for x in range(nv):
            b1 = int(starts[x])
            if b1 - b0 > degree:
                ok = 0
            for a in range(b0, b1):
                if ok == 1:
                    total = int(0)
                    uses = int(0)
                    other = int(-1)
                    for b in range(b0, b1):
                        if ends[b] / wp.int64(2) == ends[a] / wp.int64(2) and sample[b] == sample[a]:
                            total = total + int(ends[b] % wp.int64(2)) * 2 - 1
                            uses = uses + 1
                            if ends[b] % wp.int64(2) != ends[a] % wp.int64(2):
                                other = b
                    if total != 0:
                        ok = 0
                    elif uses == 2:  # once each way: the face across the edge
                        twin[int(use[a] / wp.int64(3)), int(use[a] % wp.int64(3))] = use[other] / wp.int64(3)
            b0 = b1
        out[0] = ok

    return closed


def _closed_torch(vertices: torch.Tensor, faces: torch.Tensor, group: torch.Tensor, padded: bool, padding: int) -> list[torch.Tensor]:
    """The same test in torch (GPUs: sorts instead of a thread): [(1,) int32, (1,) float64, (F, 3)
    int64 twins, all -1: GPUs sign every query by its walk (:mod:`._sides`)]."""
    n_vertices = vertices.shape[0]
    kept = (group != padding) if padded else torch.ones_like(group, dtype=torch.bool)
    inside = ((faces >= 0) & (faces < n_vertices)).all(1)
    rows = faces.clamp(0, max(n_vertices - 1, 0))
    a, b, c = vertices.to(torch.float64)[rows].unbind(1)
    area2 = torch.linalg.vector_norm(torch.linalg.cross(b - a, c - a), dim=-1)
    longest = torch.stack([(b - a).square().sum(-1), (c - b).square().sum(-1), (a - c).square().sum(-1)]).amax(0)
    solid = kept & inside & (area2 > _flat(vertices.dtype) * longest)
    worst = torch.where(solid, longest / torch.where(solid, area2, 1.0), 0.0).amax(0, keepdim=True) if faces.shape[0] else vertices.new_zeros(1, dtype=torch.float64)
    edges = torch.stack([rows, rows.roll(-1, 1)], -1).reshape(-1, 2)
    lo, hi = edges.amin(1), edges.amax(1)
    counted = (lo != hi) & (kept & inside).repeat_interleave(3)
    up = torch.where(counted, torch.where(edges[:, 0] < edges[:, 1], 1, -1), 0)
    perm = torch.argsort(lo * n_vertices + hi, stable=True)
    perm = perm[torch.argsort(group.repeat_interleave(3)[perm], stable=True)]  # by sample, then edge
    key, sample = (lo * n_vertices + hi)[perm], group.repeat_interleave(3)[perm]
    same_edge = torch.cumsum((torch.diff(key, prepend=key[:1]) != 0) | (torch.diff(sample, prepend=sample[:1]) != 0), 0)
    total = torch.zeros_like(key).index_add_(0, same_edge, up[perm])
    degree = torch.zeros(n_vertices, dtype=torch.int64, device=faces.device).index_add_(0, lo, counted.to(torch.int64))
    ok = (total == 0).all() & (degree <= DEGREE).all() & (inside | ~kept).all()
    return [ok.to(torch.int32).reshape(1), worst, torch.full_like(faces, -1)]


def _flat(dtype: torch.dtype) -> float:
    """A quarter of the measurements' flatness threshold (height over longest edge) in the compute
    dtype: a face this close above it may be measured by its plane (the rounded cross product
    decides), so its shape factor counts."""
    return FLAT * torch.finfo(dtype).eps / 4


@_threads.custom_op("pcops::mesh_closed", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _mesh_closed(vertices: torch.Tensor, faces: torch.Tensor, face_group: torch.Tensor, padded: bool, padding: int) -> list[torch.Tensor]:
    """vertices (V, 3) in the search's dtype, faces (F, 3) int64 rows, face_group (F,) -> [(1,)
    int32: 1 if the faces (a padded batch's padding faces, sample id ``padding``, left out) form
    closed meshes, else 0; (1,) float64: the largest shape factor (squared longest edge over
    twice the area) of their faces that may be measured by their plane; (F, 3) int64: the face
    across each edge of a closed mesh used once each way, else -1] (see :func:`_closed_kernel`)."""
    if faces.device.type != "cpu":
        return _closed_torch(vertices, faces, face_group, padded, padding)
    _warp.init()
    out, shape = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.float64)
    starts = torch.zeros(vertices.shape[0] + 1, dtype=torch.int64)
    ends, sample, use = (torch.empty(3 * faces.shape[0], dtype=torch.int64) for _ in range(3))
    twin = torch.full((faces.shape[0], 3), -1, dtype=torch.int64)
    _warp.launch(_closed_kernel(_flat(vertices.dtype)), 1, [vertices.to(torch.float64).contiguous(), faces.contiguous(), face_group.contiguous(),
                                                            int(padded), padding, starts, ends, sample, use, out, shape, twin], like=faces, work=0)
    return [out, shape, twin]


@_mesh_closed.register_fake
def _(vertices, faces, face_group, padded, padding):
    return [faces.new_empty((1,), dtype=torch.int32), vertices.new_empty((1,), dtype=torch.float64), torch.empty_like(faces)]


def closed(vertices: torch.Tensor, faces: torch.Tensor, face_group: torch.Tensor, padding: Optional[int]) -> list[torch.Tensor]:
    """[(1,) int32: whether the faces (but a padded batch's padding faces, sample id ``padding``)
    form closed meshes, (1,) float64: their worst shape factor, (F, 3) int64: the face across each
    edge] (see :func:`_mesh_closed`)."""
    return _mesh_closed(vertices, faces, face_group, padding is not None, -1 if padding is None else padding)


@_threads.custom_op("pcops::mesh_tree", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _mesh_tree(vertices: torch.Tensor, faces: torch.Tensor, face_group: torch.Tensor, one: bool, winding: bool = True) -> list[torch.Tensor]:
    """vertices (V, 3) float32/64, faces (F, 3) int64 rows, face_group (F,) int64 (``one``: one
    mesh, every id 0; ``winding``: with the winding number's data) -> the tensors of
    :class:`._tree.Tree`."""
    kept = _kept_tree.build(vertices, faces, face_group, winding) if one else None  # (the thread's kept build of these shapes)
    return list(kept if kept is not None else _tree.build(vertices, faces, face_group, vertices.dtype, one, winding))


@_mesh_tree.register_fake
def _(vertices, faces, face_group, one, winding=True):
    return list(_tree.empty_like(vertices, faces, vertices.dtype, winding))


def tree(vertices: torch.Tensor, faces: torch.Tensor, face_group: torch.Tensor, one: bool = False, winding: bool = True) -> _tree.Tree:
    """The hierarchy of a flat mesh, in the dtype of ``vertices`` (``one``: the layout's one mesh,
    ``FlatMesh.batch == 0``; ``winding``: with the data of signed searches, else for unsigned
    ones only, the rest the same)."""
    return _tree.Tree(*_mesh_tree(vertices.detach(), faces, face_group, one, winding))


def _queries(qa: torch.Tensor) -> int:
    return qa.shape[0]


@_threads.custom_op("pcops::mesh_closest", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _mesh_closest(
    qa: torch.Tensor, qb: torch.Tensor, qc: torch.Tensor, query_group: torch.Tensor,
    ta: torch.Tensor, tb: torch.Tensor, tc: torch.Tensor, group: torch.Tensor, order: torch.Tensor,
    lo: torch.Tensor, hi: torch.Tensor, glo: torch.Tensor, ghi: torch.Tensor, scale: torch.Tensor,
    max_dist: float, faces_to_points: bool, validate: bool, rivals: bool = False, shape: Optional[torch.Tensor] = None,
    one: bool = False,
) -> list[torch.Tensor]:
    """Queries (M, 3) as triangles qa, qb, qc (``faces_to_points``; else points qa, qb and qc unread) -> [(M,) int64 the
    nearest item's row (-1: none within max_dist), (M,) int64 the order the queries were walked
    in (:func:`._tree.query_order`), (M,) int64 with ``rivals`` the other item within the band
    of that one widened by ``shape`` (1,) float64, the mesh's worst shape factor (-1: none, -2:
    two or more, or a band past ``max_dist``; see :mod:`._sides`; nothing tracked where that
    factor is 0: a mesh not analysed), else -1]. ``one``: the faces are one mesh (the
    queries' order: :func:`._tree.query_order`)."""
    if validate:
        _validate.finite(points=qa)
    m = qa.shape[0]
    found = torch.full((m,), -1, dtype=torch.int64, device=qa.device)
    rows = _tree.query_order(qa, query_group, one)
    if m == 0 or ta.shape[0] == 0:
        return [found, rows, found.clone()]
    _warp.init()
    max_d2 = max_dist * max_dist if math.isfinite(max_dist) else float("inf")
    slot, rival = torch.empty_like(found), torch.empty_like(found)  # slot: each query's face as a row of the sorted faces (the next query's first bound)
    chain = int(qa.device.type == "cpu" and CHAIN)
    args = [_tree.depth(ta.shape[0]), rows, qa, qb, qc, query_group, ta, tb, tc, group, order, lo, hi, glo, ghi,
            scale, max_d2, shape if shape is not None else torch.zeros(1, dtype=torch.float64, device=qa.device), chain, slot, found, rival]
    _warp.launch(_closest_kernel(qa.dtype, faces_to_points, rivals), m, args, like=qa, min_chunk=64, kept=True)
    return [found, rows, rival]


@_mesh_closest.register_fake
def _(qa, qb, qc, query_group, ta, tb, tc, group, order, lo, hi, glo, ghi, scale, max_dist, faces_to_points, validate, rivals=False, shape=None,
      one=False):
    return [qa.new_empty((qa.shape[0],), dtype=torch.int64) for _ in range(3)]


def closest(query: torch.Tensor, query_group: torch.Tensor, t: _tree.Tree, max_dist: float, validate: bool,
            triangles: tuple | None = None, shape: Optional[torch.Tensor] = None, one: bool = False) -> list[torch.Tensor]:
    """The nearest face of each query point (or, given query ``triangles`` and a tree of points,
    the nearest point of each triangle): (M,) int64 rows, -1 where none is within ``max_dist``;
    the order the queries were walked in (for :func:`winding`); and given ``shape`` (the mesh's
    worst shape factor, :func:`closed`) the other row within the band of the one found, widened
    for the rounding of thin faces' planes (-1: none, -2: several; without ``shape``, -1).
    ``one``: the tree holds one mesh (``FlatMesh.batch == 0``; the queries' order)."""
    qa, qb, qc = (query, query, query) if triangles is None else triangles
    return _mesh_closest(qa.detach().contiguous(), qb.detach().contiguous(), qc.detach().contiguous(), query_group,
                                        t.a, t.b, t.c, t.group, t.order, t.lo, t.hi, t.glo, t.ghi, t.scale,
                                        float(max_dist), triangles is not None, validate, shape is not None, shape, one)


@_threads.custom_op("pcops::mesh_winding", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _mesh_winding(
    query: torch.Tensor, query_group: torch.Tensor, rows: torch.Tensor, reach: torch.Tensor, closed: torch.Tensor, shape: torch.Tensor,
    ta: torch.Tensor, tb: torch.Tensor, tc: torch.Tensor, group: torch.Tensor,
    glo: torch.Tensor, ghi: torch.Tensor, center: torch.Tensor, normal: torch.Tensor, moment: torch.Tensor, radius: torch.Tensor,
    scale: torch.Tensor, known: torch.Tensor,
) -> torch.Tensor:
    """query (M, 3) walked in the order ``rows``, ``reach`` (M,) each query's distance to its mesh
    (0 where unknown), ``closed`` and ``shape`` (1,) from :func:`closed`, ``known`` (M,) winding
    numbers known without a walk (inf elsewhere: :mod:`._sides`) -> (M,) the generalised winding
    number of each query about its mesh (on closed meshes, a query in the same region as the
    query before it takes that one's: see the module docs)."""
    m = query.shape[0]
    out = query.new_zeros((m,))
    if m == 0 or ta.shape[0] == 0:
        return out
    _warp.init()
    head = torch.empty(m, dtype=torch.bool, device=query.device)  # the queries walked, in walking order
    m33 = wp.mat33f if query.dtype == torch.float32 else wp.mat33d
    args = [_tree.depth(ta.shape[0]), rows, query, query_group, ta, tb, tc, group, glo, ghi, center, normal, _warp.Typed(moment, m33), radius,
            reach, closed, shape, scale.reshape(1), known, head, out]
    _warp.launch(_winding_kernel(query.dtype), m, args, like=query, min_chunk=64, kept=True)
    if query.device.type == "cpu":  # each query not walked takes the last walked one's, in walking order: one pass
        _warp.launch(_follow_kernel(query.dtype), 1, [rows, head, out], like=query, work=0, kept=True)
        return out
    walked = torch.cummax(torch.where(head, torch.arange(m, device=query.device), 0), 0).values  # each query's last walked one
    return out.index_copy_(0, rows, out.index_select(0, rows.index_select(0, walked)))


@_mesh_winding.register_fake
def _(query, query_group, rows, reach, closed, shape, ta, tb, tc, group, glo, ghi, center, normal, moment, radius, scale, known):
    return query.new_empty((query.shape[0],))


def winding(query: torch.Tensor, query_group: torch.Tensor, t: _tree.Tree, rows: torch.Tensor, reach: torch.Tensor,
            closed: list[torch.Tensor], known: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The generalised winding number of each query point about its mesh (M,), walked in the
    order ``rows`` (:func:`._tree.query_order`); ``reach`` (M,) each query's distance to its mesh
    (0 where unknown) and ``closed`` from :func:`closed` let a closed mesh's queries share walks;
    ``known`` (M,) winding numbers found without a walk (inf elsewhere; None: none)."""
    if known is None:
        known = query.new_full((query.shape[0],), float("inf"))
    return _mesh_winding(query.detach().contiguous(), query_group, rows, reach.detach().to(query.dtype).contiguous(), *closed[:2],
                         t.a, t.b, t.c, t.group, t.glo, t.ghi, t.center, t.normal, t.moment, t.radius, t.scale,
                         known.to(query.dtype).contiguous())
