"""The cell list of one small CPU cloud, built in one launch into buffers kept for its size.

A :class:`._cells.CellList` of a cloud of a thousand points costs far more in Python (tensor
conversions, several launches, allocations) than in its kernels. :func:`plan` gives the calling
thread's :class:`Plan` for a query and a reference cloud of up to a capacity of points (kept
as :func:`pcops._warp.prepared` keeps a launch): :meth:`Plan.extent` runs the box kernel on both
(the host numbers of :func:`._cells.extent_of`), and :meth:`Plan.build` sorts them into the
cell list of a radius in one launch of one thread: the grid of :func:`._cells.grid`, the keys
of ``_cells._key_func`` and the stable counting sort of ``_cells._counting_sort_func``, so the
same order, starts and rows as a :class:`._cells.CellList` of the same clouds and radius, and
the reference points in that order. A kernel scans it through :meth:`Plan.fields` (the arrays
of the struct of :func:`pcops._warp_funcs.cell_scan`, pointed at the plan's buffers).
"""

from typing import Optional

import torch
import warp as wp

from ... import _warp, _warp_funcs
from . import _cells

# Clouds of up to this many points (queries and reference points) take a kept cell list: above
# it the kernels' work outweighs the list's fixed cost, and the buffers grow
LARGEST = 1 << 14


@_warp.kernels
def _build_kernel(dtype: torch.dtype):
    """One thread: the cell keys of ``ref`` (those outside the grid: ``total``) and of ``query``
    (border cells), each sorted stably by key (``order`` with ``starts``, ``rows`` with
    ``query_starts``), the reference points in their sorted order (``points``), and ``bad[0] =
    1`` where a point of either cloud holds NaN or inf (``bad`` empty: no check)."""
    s, v = _warp.scalar(dtype), _warp.vec3(dtype)
    key = _cells._key_func(dtype)
    sort = _cells._counting_sort_func()
    _, finite_point = _warp_funcs.finite(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def build(
        start: int,
        ref: wp.array(dtype=v),
        query: wp.array(dtype=v),
        frame: wp.array(dtype=s),
        dims: wp.vec3i,
        total: int,
        ref_keys: wp.array(dtype=wp.int64),
        query_keys: wp.array(dtype=wp.int64),
        starts: wp.array(dtype=wp.int64),
        query_starts: wp.array(dtype=wp.int64),
        order: wp.array(dtype=wp.int64),
        rows: wp.array(dtype=wp.int64),
        points: wp.array(dtype=v),
        bad: wp.array(dtype=wp.int32),
    ):
        check = bad.shape[0] > 0
        i = int(0)
        while i < ref.shape[0]:
            p = ref[i]
            ref_keys[i] = key(p, 0, frame, dims, wp.int64(total))
            if check and not finite_point(p):
                bad[0] = 1
            i += 1
        i = int(0)
        while i < query.shape[0]:
            p = query[i]
            query_keys[i] = key(p, 0, frame, dims, wp.int64(-1))
            if check and not finite_point(p):
                bad[0] = 1
            i += 1
        sort(ref_keys, total, starts, order)
        sort(query_keys, total, query_starts, rows)
        i = int(0)
        while i < ref.shape[0]:
            points[i] = ref[int(order[i])]
            i += 1

    return build


class Plan:
    """The buffers and prepared launches of the cell lists of one dtype's clouds of up to
    ``capacity`` points, on the CPU: :meth:`extent`, then :meth:`build`, then a scan of
    :meth:`fields`' arrays (the plan's buffers, valid until its next build)."""

    def __init__(self, dtype: torch.dtype, capacity: int, box, build, buffers: dict, corners: torch.Tensor, frame: torch.Tensor, flag: tuple):
        self.dtype, self.capacity = dtype, capacity
        self._box, self._build = box, build
        self.buffers = buffers
        self._corners, self._frame, self._flag = corners, frame, flag
        self._corners_view, self._frame_view = corners.numpy(), frame.numpy()
        self._box_fields = [launch.fields("points") for launch in box]
        self._build_fields = build.fields("ref", "query")
        self.dims = (1, 1, 1)

    @classmethod
    def make(cls, dtype: torch.dtype, capacity: int) -> Optional["Plan"]:
        """A plan for clouds of ``dtype`` of up to ``capacity`` points (its kernels loaded and
        their launches prepared on the plan's own buffers); None where a kernel has no native
        entry point."""
        _warp.init()
        vec = _warp.vec3(dtype)
        index = lambda n: torch.zeros(n, dtype=torch.int64)  # noqa: E731
        table = _cells.capacity(capacity)  # (every grid's starts: see _cells.capacity)
        buffers = {"ref_keys": index(capacity), "query_keys": index(capacity), "starts": index(table), "query_starts": index(table),
                   "order": index(capacity), "rows": index(capacity), "points": torch.zeros((capacity, 3), dtype=dtype),
                   "groups": torch.zeros(capacity, dtype=torch.int32)}
        corners = torch.zeros((2, 2, 3), dtype=dtype)
        frame = torch.zeros(6, dtype=dtype)
        flag = _warp.values_flag()
        none = buffers["points"][:0]  # (the clouds' arrays: each call points them at its own)
        box_kernel = _cells._box_kernel(dtype)
        box = []
        for c in range(2):
            args = [_warp.array(none, dtype=vec), 1, _warp.array(corners[c:c + 1], dtype=vec)]
            box.append(_prepared(box_kernel, args))
        build_kernel = _build_kernel(dtype)
        args = [_warp.array(none, dtype=vec), _warp.array(none, dtype=vec), frame, wp.vec3i(1, 1, 1), 1,
                *(buffers[name] for name in ("ref_keys", "query_keys", "starts", "query_starts", "order", "rows")),
                _warp.array(buffers["points"], dtype=vec), flag[0]]
        build = _prepared(build_kernel, args)
        if build is None or None in box:  # (no native entry point)
            return None
        return cls(dtype, capacity, box, build, buffers, corners, frame, flag)

    def held(self) -> int:
        """The bytes the plan holds (:meth:`pcops._warp.Kept.put`)."""
        return 3 * _warp.LAUNCH_BYTES + _warp.held_bytes(list(self.buffers.values()), self._corners, self._frame)

    def extent(self, query: torch.Tensor, ref: torch.Tensor) -> list:
        """:func:`._cells.extent_of`'s host numbers of one cloud pair (contiguous CPU tensors of
        the plan's dtype, of up to its capacity of points)."""
        for launch, fields, points in zip(self._box, self._box_fields, (ref, query)):
            launch.size((("points",),), (points.shape[0],))
            launch.run_at(fields, points)
        return _cells.host_extent(self._corners_view.tolist(), 0.0)

    def build(self, query: torch.Tensor, ref: torch.Tensor, radius: float, host: list) -> bool:
        """The cell list of ``radius`` over the clouds of :meth:`extent` (``host`` its result) in
        the plan's buffers, its cells a side in ``dims``; whether a point of either cloud holds
        NaN or inf."""
        low, widths, dims, _, _ = _cells.grid(host, radius, ref.shape[0], self.dtype)
        self._frame_view[:] = [*low, *(1.0 / w for w in widths)]  # (rounded to the dtype as torch.tensor rounds them)
        self.dims = tuple(dims)
        self._build.size(_BUILD_GROUPS, (ref.shape[0], query.shape[0]), None, (("dims", self.dims), ("total", dims[0] * dims[1] * dims[2])))
        self._flag[1][0] = 0
        self._build.run_at(self._build_fields, ref, query)
        return bool(self._flag[1][0])

    def fields(self) -> tuple:
        """The tensors of the cell list's arrays in a scan's struct (``Cells``), in the order of
        :data:`FIELDS` but the queries (the caller's)."""
        b = self.buffers
        return b["rows"], b["starts"], self._frame, b["groups"], b["points"], b["order"]

    def scan(self, query: torch.Tensor, n: int):
        """The scan struct of the list (:func:`._cells.scan_of`) for ``query`` and ``n`` reference points."""
        rows, starts, frame, groups, points, order = self.fields()
        m = query.shape[0]
        return _cells.scan_of((rows[:m], starts, frame, query, groups[:m], points[:n], order[:n]), wp.vec3i(*self.dims))


# The struct fields of a scan of the list (:meth:`Plan.fields`, then the queries)
FIELDS = ("cells__rows", "cells__starts", "cells__frame", "cells__groups", "cells__points", "cells__order", "cells__query")
# Their lengths: the queries', the reference points'
LENGTHS = (("cells__query", "cells__rows", "cells__groups"), ("cells__points", "cells__order"))
_BUILD_GROUPS = (("ref", "ref_keys", "order", "points"), ("query", "query_keys", "rows"))


def _prepared(kernel, args: list):
    """A prepared one-thread launch of ``kernel`` with ``args``, after a first launch that loads
    it (on the plan's buffers: clouds of no points)."""
    _warp.launch(kernel, 1, args, like=torch.empty(0), min_chunk=1, work=0)
    return _warp.prepare(kernel, 1, args, work=0)


def plan(dtype: torch.dtype, points: int) -> Optional[Plan]:
    """The calling thread's :class:`Plan` for clouds of ``dtype`` of up to ``points`` points (at
    most :data:`LARGEST`), kept as :func:`pcops._warp.prepared` keeps launches (None before
    its key's second miss)."""
    capacity = _warp.capacity(max(points, 64))
    return _warp.prepared(("cell list", dtype, capacity), lambda: Plan.make(dtype, capacity))
