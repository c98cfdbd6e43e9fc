"""The triangles of one grid cell for each configuration of its corners, derived, not tabulated by hand.

A cell's corner c (0..7) sits at offset (c & 1, c >> 1 & 1, c >> 2 & 1) along the grid's axes
(0, 1, 2); bit c of the cell's case is set where the value at that corner is above the
level. Edge 4 a + m (0..11) runs along axis a from the corner with bit a clear and the other two
axes' bits m & 1 and m >> 1 (in increasing axis order) to the corner with bit a set. A vertex
lies on each edge whose ends are on either side of the level.

On each face of the cell the level set crosses 0, 2 or 4 edges. Walked counter-clockwise as
seen from outside the cell, the crossings alternate between entering the region above the
level and leaving it; the contour segments join each leaving crossing to an entering one, so
that the region above the level lies on their left. With 4 crossings (the face's diagonal
corners alike: ambiguous) the segments keep the two corners above the level apart and
join the two at or below it across the face: a rule of the face's own corners, so the two cells that
share a face draw the same segments on it and the surface has no cracks. (The asymptotic
decider, which picks per face from the values, makes loops of 8 to 12 crossings that no
triangulation of their vertices can cover without an edge in a cell face, shared then by four
triangles; with this rule every loop has at most 7.)

Every crossing vertex starts one segment and ends one (its edge lies on two faces, walked in
opposite directions), so the segments form closed loops. Each loop is triangulated without a
triangle edge between two vertices of one cell face other than the loop's own segments (found
by dynamic programming over the loop's triangulations), so that every edge of the mesh lies in
exactly two triangles: the mesh is a closed, consistently oriented manifold wherever the level
set is closed inside the grid. Triangles keep the loop's direction: their normals
(v1 - v0) x (v2 - v0) point towards increasing values.

:func:`table` gives each of the 256 cases' triangles as edge ids.
"""

from __future__ import annotations

import functools

import torch

# The most triangles of a case (4 or 5 loop vertices ... 7, and n - 2 triangles per loop of n).
MAX_TRIANGLES = 5


def corner_offset(c: int) -> tuple[int, int, int]:
    return c & 1, c >> 1 & 1, c >> 2 & 1


def _others(a: int) -> tuple[int, int]:
    return tuple(x for x in range(3) if x != a)  # type: ignore[return-value]


def edge_corners(e: int) -> tuple[int, int]:
    """The corners (start, end) of edge ``e``: start has bit a clear, end has it set."""
    a, m = divmod(e, 4)
    b, d = _others(a)
    start = (m & 1) << b | (m >> 1 & 1) << d
    return start, start | 1 << a


def _edge_between(c0: int, c1: int) -> int:
    a = (c0 ^ c1).bit_length() - 1
    b, d = _others(a)
    low = min(c0, c1)
    return 4 * a + ((low >> b & 1) | (low >> d & 1) << 1)


def face_corners(f: int) -> tuple[int, int, int, int]:
    """The corners of face ``f`` = 2 a + side (the corners whose bit a is ``side``) in the order
    (u, v) = (0, 0), (1, 0), (1, 1), (0, 1) of the face's two other axes b < d, which is
    counter-clockwise seen from outside the cell."""
    a, side = divmod(f, 2)
    b, d = _others(a)
    ring = [side << a | u << b | v << d for u, v in ((0, 0), (1, 0), (1, 1), (0, 1))]
    # (u, v) counter-clockwise is seen from e_b x e_d = +e_a for a = 0, 2 and -e_a for a = 1;
    # the face's outward normal is +e_a for side 1 and -e_a for side 0.
    if (1 if a != 1 else -1) * (1 if side else -1) < 0:
        ring.reverse()
    return tuple(ring)  # type: ignore[return-value]


def _segments(case: int, f: int) -> list[tuple[int, int]]:
    """Face ``f``'s contour segments (leaving edge, entering edge) in ``case``."""
    ring = face_corners(f)
    above = [case >> c & 1 for c in ring]
    crossings = []  # (edge, entering) in walking order
    for i in range(4):
        if above[i] != above[(i + 1) % 4]:
            crossings.append((_edge_between(ring[i], ring[(i + 1) % 4]), bool(above[(i + 1) % 4])))
    # each leaving crossing to the entering one before it: the region above the level it
    # closes is the arc between them (on an ambiguous face: each above corner on its own)
    return [(edge, crossings[i - 1][0]) for i, (edge, entering) in enumerate(crossings) if not entering]


def _faces_of(e: int) -> set:
    """The cell faces (axis, side) that edge ``e`` lies on."""
    a = e // 4
    start = edge_corners(e)[0]
    return {(b, start >> b & 1) for b in _others(a)}


def _triangulate(loop: list[int]) -> list[tuple[int, int, int]]:
    """Triangles covering the polygon ``loop`` (in its direction) with the fewest triangle edges
    between two vertices on one cell face that are not neighbours in the loop (none for the
    loops of :func:`triangles`)."""
    n = len(loop)

    def bad(i: int, j: int) -> int:
        return int((j - i) % n not in (1, n - 1) and bool(_faces_of(loop[i]) & _faces_of(loop[j])))

    @functools.lru_cache(maxsize=None)
    def best(i: int, j: int) -> tuple[int, tuple]:
        if j - i < 2:
            return 0, ()
        return min((best(i, k)[0] + best(k, j)[0] + bad(i, k) + bad(k, j), best(i, k)[1] + ((i, k, j),) + best(k, j)[1])
                   for k in range(i + 1, j))

    cost, tris = best(0, n - 1)
    assert cost == 0, f"loop {loop} has no triangulation without a face edge"
    return [(loop[i], loop[k], loop[j]) for i, k, j in tris]


def triangles(case: int) -> list[tuple[int, int, int]]:
    """The triangles (edge ids) of a cell in ``case``."""
    following = {}
    for f in range(6):
        for start, end in _segments(case, f):
            following[start] = end
    out = []
    while following:
        first = min(following)
        loop = [first]
        nxt = following.pop(first)
        while nxt != first:
            loop.append(nxt)
            nxt = following.pop(nxt)
        out += _triangulate(loop)
    return out


@functools.lru_cache(maxsize=None)
def table(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(triangles (256, MAX_TRIANGLES, 3) int64 edge ids, padded with 0; count (256,) int64), by case."""
    found = [triangles(case) for case in range(256)]
    tris = torch.zeros(256, MAX_TRIANGLES, 3, dtype=torch.int64)
    for case, t in enumerate(found):
        if t:
            tris[case, : len(t)] = torch.tensor(t, dtype=torch.int64)
    return tris.to(device), torch.tensor([len(t) for t in found], device=device)
