"""The cell list of the radius ops: reference points sorted by (sample, z, y, x) cell of a
dense grid, built once per op call and reused by its backward.

``CellList(query, ref, radius, query_group, ref_group)`` sorts the reference points (``order``)
and the queries (``rows``) by cell; ``starts[c] .. starts[c + 1]`` are the sorted points of
cell c. Cells are ``CELL`` radii wide (x, y, z: thin in x, a radius in y and z), all wider in
proportion when that would make more than ``CELLS_PER_POINT`` cells per point of a sample. The
kernels scan it with ``pcops._warp_funcs.cell_scan`` (the cells around a query: a run of
consecutive cells in x for each (y, z) cell), given its arrays by :meth:`CellList.scan`;
``permute`` reorders rows.

An op whose backward scans the forward's cell list returns it as tensors whose sizes follow
from the inputs' shapes (:meth:`CellList.tensors`; ``starts`` in a table of :func:`capacity`
entries, which holds every grid but those of more samples than that, whose starts the
backward makes again from the keys: :meth:`CellList.of`). No op returns a data-dependent
size: ``torch.compile`` without ``fullgraph`` would break the graph there.
"""

from typing import Optional

import torch
import warp as wp

from ... import _warp, _warp_funcs

# Cell widths of the cell list (x, y, z), in radii. A query scans the cells that meet the cube
# [q - r, q + r]: a run of contiguous points for each of the 3 x 3 (y, z) cells, 2.33 r long in
# x (a volume of 21 r^3). The end of each run is a mispredicted branch, which costs more than
# testing a few more points: faster than cubes of r / 2 (5 x 5 runs, 16 r^3) (docs/benchmarks.md, design choices).
CELL = (1.0 / 3.0, 1.0, 1.0)
# At most this many cells per reference point (per sample): sparse clouds get wider cells.
CELLS_PER_POINT = 2.0
# The cell list's own kernels (keys, starts, row permutations) do a few nanoseconds of work per
# row: split over CPU threads only from this many rows per thread (a split launch costs a
# fork-join of the team, far more than the work below it on a loaded machine).
_MIN_CHUNK = 1 << 16
# The CPU cell list sorts fewer keys than this with a counting sort, more with torch.sort.
_COUNTING_SORT = 1 << 19


@_warp.kernels
def _starts_kernel():
    """``starts[c]``: the first index of sorted ``keys`` >= c, for c = 0 .. total."""

    @wp.kernel(enable_backward=False, module="unique")
    def starts_of(start: int, keys: wp.array(dtype=wp.int64), total: int, starts: wp.array(dtype=wp.int64)):
        i = wp.tid() + start  # 0 .. n: the cells after key i - 1 up to key i start at i
        n = keys.shape[0]
        first = int(0)
        if i > 0:
            first = int(keys[i - 1]) + 1
        last = total
        if i < n:
            last = int(keys[i])
        for c in range(first, last + 1):
            starts[c] = wp.int64(i)

    return starts_of


@_warp.kernels
def _permute_kernel(dtype: torch.dtype):
    """Rows in another order: ``dst[a] = src[order[a]]``, or ``dst[order[a]] = src[a]`` (inverse);
    the first min(src, dst) columns, and zeros in the rest of a wider ``dst`` (padding)."""
    s = _warp.scalar(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def permute(start: int, src: wp.array2d(dtype=s), order: wp.array(dtype=wp.int64), inverse: int, dst: wp.array2d(dtype=s)):
        a = wp.tid() + start
        j = int(order[a])
        n = wp.min(src.shape[1], dst.shape[1])
        if inverse != 0:
            for c in range(n):
                dst[j, c] = src[a, c]
        else:
            for c in range(n):
                dst[a, c] = src[j, c]
            for c in range(n, dst.shape[1]):
                dst[a, c] = s(0.0)

    return permute


def permute(x: torch.Tensor, order: torch.Tensor, inverse: bool = False, width: Optional[int] = None) -> torch.Tensor:
    """x[order] (or the inverse: ``out[order] = x``). ``width``: the columns of the result (a 2-D
    ``x``): the first ones of ``x``, zeros after them (rows padded to a vector width) or fewer
    (the padding dropped). On the CPU torch's gather (faster than a Warp kernel's element
    loop; the inverse gathers by the rank of each row, faster than a scatter), except in a
    forked child (:func:`pcops._warp.forked`: torch's multi-threaded ops
    may hang there) and on GPUs, where a Warp kernel moves the rows."""
    shape = x.shape if width is None else (x.shape[0], width)
    if x.device.type == "cpu" and not _warp.forked():
        if inverse:  # out[order[a]] = x[a]: out[b] = x[rank[b]]
            order = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0]))
        cols = min(x.shape[1], shape[1]) if x.dim() == 2 else None
        if cols is None or cols == shape[1]:
            return (x if cols is None or cols == x.shape[1] else x[:, :cols]).index_select(0, order)
        out = x.new_empty(shape)  # wider: the rows gathered straight into the first columns, zeros after them
        out[:, cols:].zero_()
        torch.index_select(x[:, :cols], 0, order, out=out[:, :cols])
        return out
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if x.numel() and out.numel():
        rows = _MIN_CHUNK // max(1, out.shape[1] if out.dim() == 2 else 1)  # split by elements moved, not rows
        _warp.launch(_permute_kernel(x.dtype), x.shape[0], [x.contiguous(), order, int(inverse), out], like=x, min_chunk=max(rows, 1024),
                     work=x.numel())
    return out


@_warp.kernels
def _key_func(dtype: torch.dtype):
    """``key(p, group, frame, dims, dropped)``: the linear (sample, z, y, x) cell index of a point
    of sample ``group``. With ``dropped`` >= 0 (the number of cells of all samples), a point more
    than half a cell outside the grid (NaN and inf included) gets that key (past every cell: never
    scanned); with -1, coordinates outside the grid (inf included) fall in its border cells and
    NaN in cell 0 of its axis."""
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    cell, _ = _warp_funcs.cells(dtype)
    offset = _warp_funcs.cell_offset(dtype)

    @wp.func(module="unique")
    def key(p: v, group: int, frame: wp.array(dtype=s), dims: wp.vec3i, dropped: wp.int64) -> wp.int64:
        c = wp.vec3i(0, 0, 0)
        cells = wp.int64(dims[0]) * wp.int64(dims[1]) * wp.int64(dims[2])
        outside = False
        for a in range(3):
            x = offset(p[a], frame[a], frame[3 + a])
            if not (x >= s(-0.5) and x < s(dims[a]) + s(0.5)):
                outside = True
            c[a] = cell(x, s(dims[a] - 1))
        found = dropped
        if not outside or dropped < wp.int64(0):
            found = wp.int64(group) * cells + (wp.int64(c[2]) * wp.int64(dims[1]) + wp.int64(c[1])) * wp.int64(dims[0]) + wp.int64(c[0])
        return found

    return key


@_warp.kernels
def _key_kernel(dtype: torch.dtype):
    """Linear (sample, z, y, x) cell index of each point (:func:`_key_func`)."""
    v = _warp.vec3(dtype)
    s = _warp.scalar(dtype)
    key_of = _key_func(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def cell_keys(
        start: int,
        points: wp.array(dtype=v),
        groups: wp.array(dtype=wp.int32),
        frame: wp.array(dtype=s),
        dims: wp.vec3i,
        dropped: wp.int64,
        key: wp.array(dtype=wp.int64),
    ):
        i = wp.tid() + start
        key[i] = key_of(points[i], int(groups[i]), frame, dims, dropped)

    return cell_keys


@_warp.kernels
def _counting_sort_func():
    """``counting_sort(keys, total, starts, order)``: ``order`` the indices of ``keys`` (in 0 ..
    total, ``total`` being the dropped points) stably sorted by key, and ``starts[c]`` the first
    position of key c, for c = 0 .. total, on one thread. Linear in points + cells, against
    n log n for a comparison sort."""

    @wp.func(module="unique")
    def counting_sort(keys: wp.array(dtype=wp.int64), total: int, starts: wp.array(dtype=wp.int64), order: wp.array(dtype=wp.int64)):
        n = keys.shape[0]
        for c in range(total + 1):
            starts[c] = wp.int64(0)
        i = int(0)
        while i < n:  # counts, one place up (while loops: faster than Warp's range loops on the CPU)
            k = wp.clamp(int(keys[i]), 0, total)
            if k < total:
                starts[k + 1] = starts[k + 1] + wp.int64(1)
            i += 1
        for c in range(total):
            starts[c + 1] = starts[c + 1] + starts[c]
        tail = wp.int64(starts[total])  # the dropped points follow the kept ones
        i = int(0)
        while i < n:  # scatter; starts[k] advances to the start of key k + 1
            k = wp.clamp(int(keys[i]), 0, total)
            if k < total:
                order[int(starts[k])] = wp.int64(i)
                starts[k] = starts[k] + wp.int64(1)
            else:
                order[int(tail)] = wp.int64(i)
                tail = tail + wp.int64(1)
            i += 1
        for c in range(total, 0, -1):  # shift back by one cell
            starts[c] = starts[c - 1]
        starts[0] = wp.int64(0)

    return counting_sort


@_warp.kernels
def _counting_sort_kernel():
    """One thread (the CPU): :func:`_counting_sort_func`."""
    sort = _counting_sort_func()

    @wp.kernel(enable_backward=False, module="unique")
    def counting_sort(start: int, keys: wp.array(dtype=wp.int64), total: int, starts: wp.array(dtype=wp.int64), order: wp.array(dtype=wp.int64)):
        sort(keys, total, starts, order)

    return counting_sort


@_warp.kernels
def _box_kernel(dtype: torch.dtype):
    """The low and high corners of the finite points of each of ``parts`` ranges of points
    (+inf / -inf for a range without any)."""
    v = _warp.vec3(dtype)
    finite_box = _warp_funcs.finite_bounds(dtype)

    @wp.kernel(enable_backward=False, module="unique")
    def box(start: int, points: wp.array(dtype=v), parts: int, corners: wp.array2d(dtype=v)):
        t = wp.int64(wp.tid() + start)
        n = wp.int64(points.shape[0])
        lo, hi = finite_box(points, int(n * t / wp.int64(parts)), int(n * (t + wp.int64(1)) / wp.int64(parts)))
        corners[int(t), 0] = lo
        corners[int(t), 1] = hi

    return box


# The CPU box kernel splits the reference points into 16 ranges from this many points
_SPLIT_BOX = 1 << 16


def _corners(ref: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """CPU: (parts + 1, 2, 3): the low and high corners of the finite points of ``parts`` ranges
    of ``ref`` (1, or 16 from 2^16 points), then of ``query`` (+inf to -inf where none), from one
    launch of a Warp kernel (torch's reductions over the rows of an (N, 3) tensor are slow there,
    or start an OpenMP team, which a forked DataLoader worker must not), the queries' beside the
    reference points'."""
    parts = 16 if ref.shape[0] >= _SPLIT_BOX else 1
    corners = ref.new_empty(parts + 1, 2, 3)  # the reference points' parts, then the queries'
    vec = _warp.vec3(ref.dtype)
    kernel = _box_kernel(ref.dtype)
    beside = (kernel, [_warp.array(query.contiguous(), dtype=vec), 1, _warp.array(corners[parts:], dtype=vec)])
    _warp.launch(kernel, parts, [_warp.array(ref.contiguous(), dtype=vec), parts, _warp.array(corners[:parts], dtype=vec)],
                 like=ref, min_chunk=1, beside=beside, work=ref.shape[0] + query.shape[0])
    return corners


def _boxes(ref: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(2, 2, 3): for ``ref`` and ``query``, the low and high corners of their finite points
    (zeros if none): non-finite points (validate=False) would make the grid's frame infinite.
    On the CPU from :func:`_corners`, elsewhere :func:`_finite_box`."""
    if ref.device.type != "cpu":
        return torch.stack([_finite_box(ref), _finite_box(query)])
    corners = _corners(ref, query)
    parts = corners.shape[0] - 1
    boxes = torch.stack([torch.stack([corners[:parts, 0].amin(0), corners[:parts, 1].amax(0)]), corners[parts]])
    return torch.where(boxes[:, :1] <= boxes[:, 1:], boxes, 0)  # no finite point: a box at 0


def _finite_box(points: torch.Tensor) -> torch.Tensor:
    """(2, 3): the low and high corners of the finite points (zeros if none): non-finite points
    (validate=False) would make the grid's frame infinite."""
    ok = torch.isfinite(points).all(1, keepdim=True)
    inf = float("inf")
    corners = torch.stack([torch.where(ok, points, inf).amin(0), torch.where(ok, points, -inf).amax(0)])
    return torch.where(corners[:1] <= corners[1:], corners, 0)  # no finite point: a box at 0


def extent_of(query: torch.Tensor, ref: torch.Tensor, query_group, ref_group) -> tuple[Optional[torch.Tensor], list]:
    """(boxes, host): the boxes of the finite reference and query points (2, 2, 3) on their
    device (:func:`_boxes`; None on the CPU, which reads only the host's), and on the host (one
    read, float64: sample ids up to 2^53 stay exact) the same 12 numbers followed by the largest
    sample id (0 for one cloud): what sizes the grid of a :class:`CellList` of any radius over
    these points. CPU clouds below 2^16 points: the host numbers straight from the box kernel's
    corners (the same values, without the torch operations that combine its parts)."""
    samples = 0.0  # the largest sample id
    if ref.device.type == "cpu" and ref.shape[0] < _SPLIT_BOX:
        corners = _corners(ref, query).cpu().tolist()  # (the one read)
        if ref_group is not None and ref_group.numel():
            samples = float(torch.maximum(ref_group.amax(), query_group.amax()))
        return None, host_extent(corners, samples)
    boxes = _boxes(ref, query)  # (ref / query, low / high, 3)
    samples = torch.zeros(1, dtype=torch.float64, device=ref.device)
    if ref_group is not None and ref_group.numel():
        samples = torch.maximum(ref_group.amax(), query_group.amax()).double()[None]
    return boxes, torch.cat([boxes.flatten().double(), samples]).cpu().tolist()


def host_extent(corners: list, samples: float) -> list:
    """:func:`extent_of`'s host numbers from the corners of the reference and the query points
    (``[[ref_low, ref_high], [query_low, query_high]]``, +inf to -inf where no point is finite:
    a box at 0) and the largest sample id."""
    host = []
    for lo, hi in corners:
        host += [x if x <= y else 0.0 for x, y in zip(lo, hi)] + [y if x <= y else 0.0 for x, y in zip(lo, hi)]
    return host + [samples]


def _starts(ordered: torch.Tensor, total: int, out: torch.Tensor) -> None:
    """``out[c]`` (c = 0 .. total): the first position of key c in the sorted keys ``ordered``
    (a Warp kernel, not torch.searchsorted: see permute)."""
    _warp.launch(_starts_kernel(), ordered.shape[0] + 1, [ordered, total, out], like=ordered, min_chunk=_MIN_CHUNK)


def capacity(n: int):
    """The size of the starts table that :meth:`CellList.tensors` returns for ``n`` reference
    points (a Python or symbolic int): it holds the ``total + 1`` starts of every grid of at
    most ``CELLS_PER_POINT * n + 64`` cells, the bound :class:`CellList` keeps unless there are
    more samples than that (sparse sample ids: one cell each)."""
    return int(CELLS_PER_POINT) * n + 65


def _sort(ref_keys: torch.Tensor, query_keys: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, starts, rows): the indices of ``ref_keys`` (in 0 .. total) sorted by key,
    ``starts[c]`` (c = 0 .. total) the first position of key c, and the indices of
    ``query_keys`` sorted by key. On the CPU below ``_COUNTING_SORT`` keys a counting sort (one
    thread, linear; 0.8 against 1.4 ms for torch.sort at 10^5 keys, but 13 against 11 ms at
    10^6, where its scattered writes leave the caches), the queries' beside the reference
    points' when both are; else torch.sort. ``starts`` is the first ``total + 1`` entries of a
    table of ``capacity(N)`` entries where it fits (the rest N: see :meth:`CellList.tensors`)."""
    counted = []  # the arguments of the counting sorts
    results = []
    for keys in (ref_keys, query_keys):
        first, is_ref = None, keys is ref_keys
        size = max(total + 1, capacity(keys.shape[0])) if is_ref else total + 1
        if keys.device.type == "cpu" and keys.shape[0] < _COUNTING_SORT:
            order = torch.empty_like(keys)
            first = torch.empty(size, dtype=torch.int64, device=keys.device)  # also the counting sort's counts
            counted.append([keys, total, first[: total + 1], order])
        elif is_ref:
            keys, order = torch.sort(keys)
            first = torch.empty(size, dtype=torch.int64, device=keys.device)
            _starts(keys, total, first[: total + 1])
        else:  # the queries' order only
            order = torch.sort(keys)[1]
        if is_ref:
            first[total + 1:] = keys.shape[0]
        results.append((order, first))
    if counted:
        kernel = _counting_sort_kernel()
        work = sum(args[0].shape[0] + total for args in counted)
        _warp.launch(kernel, 1, counted[0], like=ref_keys, beside=(kernel, counted[1]) if len(counted) > 1 else None, work=work)
    return results[0][0], results[0][1], results[1][0]


def grid(host: list, radius: float, n: int, dtype: torch.dtype) -> tuple[list, list, list, int, float]:
    """(low, widths, dims, groups, reach): the grid of a :class:`CellList` of ``radius`` over ``n``
    reference points of ``dtype`` whose extent is ``host`` (:func:`extent_of`'s): its low corner,
    cell widths and cells a side (x, y, z), its samples, and the reach past which no point can
    be a neighbour (the radius, at least :func:`pcops._warp_funcs.reach_floor`, and a margin)."""
    radius = max(radius, _warp_funcs.reach_floor(dtype))  # (subnormal squares)
    reach = radius * 1.01  # beyond it no point can be a neighbour, rounding included
    low = [max(p, q - reach) for p, q in zip(host[0:3], host[6:9])]
    high = [min(p, q + reach) for p, q in zip(host[3:6], host[9:12])]
    groups = max(int(host[12]) + 1, 1)
    half = [max(h * 0.5 - lo * 0.5, 0.0) for lo, h in zip(low, high)]  # (halves: finite where a side overflows)
    # in units of the larger of the box and the radius (products of three widths neither over- nor
    # underflow), each width at least 2^-20 of its side and 2^-60 (at most 2^20 cells a side)
    unit = max(*half, radius * 0.5)
    side = [x / unit for x in half]
    widths = [max(c * (radius * 0.5 / unit), x / (1 << 20), 2.0**-60) for c, x in zip(CELL, side)]
    volume = max(side[0] * side[1] * side[2], 1e-300)
    widen = (volume * groups / (CELLS_PER_POINT * max(n, 1) * widths[0] * widths[1] * widths[2])) ** (1.0 / 3.0)
    widths = [w * max(widen, 1.0) for w in widths]
    dims = [max(1, min(int(x / w) + 1, 1 << 20)) for x, w in zip(side, widths)]
    while dims[0] * dims[1] * dims[2] * groups > CELLS_PER_POINT * n + 64 and max(dims) > 1:
        widths = [w * 1.25 for w in widths]  # a flat or thin cloud: the volume bound above was too generous
        dims = [max(1, min(int(x / w) + 1, 1 << 20)) for x, w in zip(side, widths)]
    widths = [w * unit * 2.0 for w in widths]
    # one cell along an axis: twice its side (an inverse the dtype holds, not 1 / a huge radius's cell rounded to 0;
    # the side itself, not its share of the unit: a radius 1e300 over points 1e-100 apart makes that share 0); no
    # width past the dtype's largest number (an inverse of 0 makes the windows NaN; two such cells span every extent)
    info = torch.finfo(dtype)
    widths = [min(w if d > 1 else max(4.0 * x, info.tiny ** 0.5), info.max) for w, d, x in zip(widths, dims, half)]
    return low, widths, dims, groups, reach


class CellList:
    """Reference points sorted into a dense grid of cells (one grid per sample).

    ``order`` sorts the points by (sample, z, y, x) cell; ``starts[c] .. starts[c + 1]`` are the
    sorted points of cell c; ``rows`` orders the queries the same way (for memory locality).
    ``frame`` (6,) on the device: the grid's low corner and 1 / the cell widths; ``dims``: cells
    a side (``wp.vec3i``; ``shape`` the same as a Python list). Cells are ``CELL`` radii wide,
    wider when that would make more than ``CELLS_PER_POINT`` cells per point of a sample.

    The grid covers the box of the reference points that can be within ``radius`` of a query:
    the reference points' box cut to the queries' box grown by the radius (and a margin). The
    points outside it (and NaN / inf points) follow every cell in ``order`` and are never
    scanned: queries in part of a large cloud (a grid of queries over the centre of a Gaussian
    cloud) get cells as fine as where the cloud covers the queries.

    One host read: the two boxes and the number of samples, which size the grid (``starts``);
    on a GPU the frame is made on the device from the same boxes (no copy from the host).
    ``extent``: that read's result (:func:`extent_of`), for lists of several radii over the
    same points (one read for all of them).
    """

    def __init__(self, query, ref, radius: float, query_group, ref_group, extent: Optional[tuple] = None):
        dev, n, m = ref.device, ref.shape[0], query.shape[0]
        if n == 0 or m == 0:  # nothing to search: an empty list
            self._empty(m, ref)
            return
        boxes, host = extent if extent is not None else extent_of(query, ref, query_group, ref_group)
        low, widths, dims, groups, reach = grid(host, radius, n, ref.dtype)
        if dev.type == "cpu":  # (low corner, 1 / widths)
            frame = torch.tensor([*low, *(1.0 / w for w in widths)], dtype=ref.dtype)
        else:  # on the device: fills, not a blocking copy from the host
            corner = torch.maximum(boxes[0, 0], boxes[1, 0] - reach)
            frame = torch.cat([corner, *(torch.full((1,), 1.0 / w, dtype=ref.dtype, device=dev) for w in widths)])
        self._set(None, None, None, frame, dims, groups)
        self.keys, query_keys = self._keys(ref, ref_group, self.total, query, query_group)
        self.order, self.starts, self.rows = _sort(self.keys, query_keys, self.total)

    @classmethod
    def empty(cls, m: int, ref: torch.Tensor) -> "CellList":
        """A list of one cell holding the reference points in their order, for ``m`` queries in
        theirs: what a kernel that visits every point (``dense``, :func:`every_point`) scanned
        (its frame is all zeros: a window over it is not the whole cell)."""
        cells = cls.__new__(cls)
        cells._empty(m, ref)
        return cells

    def _empty(self, m: int, ref: torch.Tensor) -> None:
        n, dev = ref.shape[0], ref.device
        starts = torch.full((capacity(n),), n, dtype=torch.int64, device=dev)
        starts[0] = 0
        self._set(torch.arange(n, device=dev), starts, torch.arange(m, device=dev), ref.new_zeros(6), [1, 1, 1], 1)
        self.keys = torch.zeros(n, dtype=torch.int64, device=dev)

    def _set(self, order, starts, rows, frame, dims: list, groups: int) -> None:
        self.order, self.starts, self.rows, self.frame = order, starts, rows, frame
        self.shape = [int(d) for d in dims]
        self.dims = wp.vec3i(*self.shape)
        self.groups = int(groups)
        self.total = self.shape[0] * self.shape[1] * self.shape[2] * self.groups  # cells of all samples
        self.keys = None

    @classmethod
    def of(cls, order, keys, rows, frame, shape: torch.Tensor, starts: torch.Tensor) -> "CellList":
        """The cell list of :meth:`tensors` (``shape`` a CPU tensor: no host read). Its starts
        table is ``starts`` where the grid fits :func:`capacity`, else it is made again from
        the reference points' keys in sorted order (one pass, linear)."""
        cells = cls.__new__(cls)
        dims, groups = shape[:3].tolist(), int(shape[3])
        cells._set(order, starts, rows, frame, dims, groups)
        cells.keys = keys
        if cells.total + 1 > starts.shape[0]:  # more samples than the table holds (sparse sample ids)
            cells.starts = torch.empty(cells.total + 1, dtype=torch.int64, device=keys.device)
            _starts(keys.index_select(0, order), cells.total, cells.starts)
        return cells

    def tensors(self) -> tuple:
        """(order (N,), keys (N,), rows (M,), frame (6,), shape (4,), starts (capacity(N),)):
        the sorted order and the cell key of each reference point, the queries' order, the
        grid's frame, and its starts table where it fits (N after the grid's cells; -1 where the
        grid does not fit: :meth:`of` makes it again from the keys), on the device; ``shape``
        (cells in x, y, z and samples) int64 on the CPU. Every size follows from the inputs'
        shapes (see the module's docstring)."""
        n = self.order.shape[0]
        starts = self.starts
        if starts.shape[0] != capacity(n):
            starts = torch.full((capacity(n),), -1, dtype=torch.int64, device=starts.device)
        shape = torch.tensor([*self.shape, self.groups], dtype=torch.int64)
        return self.order, self.keys, self.rows, self.frame, shape, starts

    def scan(self, query: torch.Tensor, query_group: Optional[torch.Tensor], points: torch.Tensor):
        """The launch argument of a kernel that scans this list (the struct of
        :func:`pcops._warp_funcs.cell_scan`): the list's arrays, the queries (M, 3) and their
        sample ids, and ``points`` (N, 3), the reference points in the list's order."""
        return scan_of((self.rows, self.starts, self.frame, query.contiguous(), groups_of(query_group, query), points.contiguous(), self.order),
                       self.dims)

    def _keys(self, ref, ref_group, dropped: int, query, query_group) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear (sample, z, y, x) cell index of each point of ``ref`` and of ``query`` (one
        launch, the queries' beside); reference points outside the grid get ``dropped`` (the
        number of cells), queries the nearest border cell."""
        kernel, vec = _key_kernel(ref.dtype), _warp.vec3(ref.dtype)

        def args(points, group, outside):
            key = torch.empty(points.shape[0], dtype=torch.int64, device=points.device)
            return key, [_warp.array(points.contiguous(), dtype=vec), groups_of(group, points), self.frame, self.dims, outside, key]

        (ref_keys, ref_args), (query_keys, query_args) = args(ref, ref_group, dropped), args(query, query_group, -1)
        _warp.launch(kernel, ref.shape[0], ref_args, like=ref, min_chunk=_MIN_CHUNK, beside=(kernel, query_args, query.shape[0]),
                     work=ref.shape[0] + query.shape[0])
        return ref_keys, query_keys


def scan_of(tensors: tuple, dims) -> object:
    """The scan struct of a cell list (:meth:`CellList.scan`) from its tensors ``(rows, starts,
    frame, query, groups, points, order)`` (contiguous) and ``dims``; it keeps them alive."""
    dtype = tensors[2].dtype
    scan = _scan_type(dtype)()
    vec = _warp.vec3(dtype)
    scan.tensors = tensors
    for name, t in zip(("rows", "starts", "frame", "query", "groups", "points", "order"), tensors):
        setattr(scan, name, _warp.array(t, dtype=vec if t.dim() == 2 else None))
    scan.dims = dims
    return scan


@_warp.kernels  # cached under the build lock: one type per dtype for every thread
def _scan_type(dtype: torch.dtype):
    """The ctypes structure of the scan's struct for ``dtype``, as a launch argument both ways:
    Warp's own launch takes a struct argument's ``__ctype__()``, and pcops._warp's direct CPU
    calls put the value in a field of that type (the type of the first call's value: one type
    for all threads). A value keeps its tensors alive (``tensors``)."""

    class Scan(_warp_funcs.cell_scan(dtype)[0].ctype):
        def __ctype__(self):
            return self

    return Scan


def every_point(query: torch.Tensor, ref: torch.Tensor, capacity: int = 0):
    """The scan struct of a kernel that measures every reference point of one cloud (a ``dense``
    kernel: it reads ``query``, ``points`` and ``order`` only; no cell list is built); its
    indices (``rows``, ``order``: 0, 1, ...) held for clouds of up to ``capacity`` points too
    (a launch kept for a range of sizes: :func:`pcops._warp.ranged`)."""
    scan = _scan_type(query.dtype)()
    vec = _warp.vec3(query.dtype)
    index = torch.arange(max(query.shape[0], ref.shape[0], capacity), device=ref.device)
    scan.tensors = (query.contiguous(), ref.contiguous(), index)
    scan.rows, scan.order = _warp.array(index[: query.shape[0]]), _warp.array(index[: ref.shape[0]])
    scan.query, scan.points = _warp.array(scan.tensors[0], dtype=vec), _warp.array(scan.tensors[1], dtype=vec)
    return scan


def groups_of(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Contiguous int32 sample ids for a kernel (zeros for one cloud)."""
    if t is None:
        return torch.zeros(like.shape[0], dtype=torch.int32, device=like.device)
    return t.to(torch.int32).clamp_min(0).contiguous()
