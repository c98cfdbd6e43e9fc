"""The calling thread's kept builds of one CPU mesh's hierarchy, for meshes built again and again
with the same shapes (a mesh deformed step by step, a loss's hierarchies every call).

:func:`._tree.build`'s launches, prepared once (:class:`pcops._warp.Prepared`) with their work
arrays kept: a call allocates the hierarchy's own tensors, points the launches at them and at
its vertices and faces, and runs the same kernels in the same order with the same chunks, so it
returns the same tensors bit for bit, without the conversions and allocations most of a small
mesh's build costs (docs/benchmarks.md, meshes). Builds of meshes of at most :data:`KEEP_FACES`
faces (their work arrays take about 400 bytes a face) are kept with the thread's other kept
launches (:data:`pcops._warp.KEPT`: made on the shapes' second build, the least recently used
dropped past its count or bytes), so the meshes of a dataset taken in turn stay kept.
"""

from typing import Optional

import torch

from ... import _warp
from ..neighbours import nearest
from . import _tree

KEEP_FACES = 1 << 13  # the largest mesh kept (about 3 MB of work arrays)


def build(vertices: torch.Tensor, faces: torch.Tensor, group: torch.Tensor, winding: bool) -> Optional[_tree.Tree]:
    """:func:`._tree.build` of one CPU mesh (every id of ``group`` 0) in the dtype of ``vertices``
    by the calling thread's kept build of these shapes (made now on their second build); None
    where builds are not kept (another device, an empty or large mesh, launches not prepared,
    the switches of the tests, the shapes' first build or the kernels' first run: the caller
    builds as usual)."""
    n = faces.shape[0]
    if not (vertices.is_cpu and 0 < n <= KEEP_FACES and _warp.PREPARED[0]):
        return None
    if _tree.PER_LEVEL[0] or not _tree.RADIUS_WALK[0]:  # (the tests' switches: other launches; the GPUs' order: prepared_split)
        return None
    v64 = vertices.detach().to(torch.float64).contiguous()
    faces, group = faces.contiguous(), group.contiguous()
    key = ("mesh_build", v64.shape[0], n, vertices.dtype, winding)
    plan = _warp.KEPT.get(key)
    if plan is None or plan.state != _state():
        plan = _Build.make(v64, faces, group, vertices.dtype, winding) if _warp.KEPT.admit(key) else None
        if plan is None:
            return None
        _warp.KEPT.put(key, plan, plan.held())
    return plan.run(v64, faces, group)


def _state() -> tuple:
    """What decides the launches and their chunks besides the shapes (the kd build's too)."""
    return (nearest.kept_state(), _tree.LEAF, _tree.SPLIT_WORK)


class _Build:
    """One mesh's build as prepared launches: the centroids (into the points the kd split
    permutes), the split's launches (:func:`..neighbours.nearest.prepared_split`), the leaves, the parents, the
    nodes' data and the radii (with ``winding``), with their work arrays."""

    __slots__ = ("state", "n", "dtype", "winding", "launches", "keep", "shapes")

    @classmethod
    def make(cls, v64, faces, group, dtype: torch.dtype, winding: bool):
        """The build of meshes like (``v64``, ``faces``, ``group``); None before every kernel
        has run once (through :func:`._tree.build`)."""
        self = cls()
        n, d = faces.shape[0], _tree.depth(faces.shape[0])
        leaves, nodes, size = 1 << d, (2 << d) - 1, _tree.node_count(n)
        rows = size if winding else 0
        self.n, self.dtype, self.winding, self.state, self.shapes = n, dtype, winding, _state(), (rows, d)
        with torch.inference_mode(False):  # (arrays the launches write: never inference tensors)
            points = v64.new_empty((n, 3))  # the centroids, permuted by the split
            corners = v64.new_empty((3 * n if winding else 0, 3))
            lo, hi, sums = v64.new_empty((size, 3)), v64.new_empty((size, 3)), v64.new_empty((size, 16 if winding else 0))
            scale, center, radius = v64.new_empty((leaves,)), v64.new_empty((rows, 3)), v64.new_zeros((rows,))
        order, ta, tb, tc, sorted_group, lo_out, hi_out, glo, ghi, center_out, normal, moment = self._outputs()
        split = nearest.prepared_split(points, order, d, serial_work=_tree.SPLIT_WORK)
        if split is None:
            return None
        # (launch, the names of its arguments a call points at its own tensors), chunked as the build's
        chunk = _warp.MIN_CHUNK
        launches = [(_warp.prepare(_tree._centroid_kernel(), n, [v64, faces, points], work=3 * n, min_chunk=chunk),
                     ("vertices", "faces"))]
        launches += [(launch, ("order",)) for launch in split[0]]
        launches.append((_warp.prepare(_tree._leaves_kernel(dtype, winding), leaves, [d, v64, faces, order, group, corners, ta, tb, tc,
                                                                                      sorted_group, lo, hi, glo, ghi, sums, scale],
                                        **_tree.leaf_cut(n, winding)),
                         ("vertices", "faces", "order", "group", "ta", "tb", "tc", "sorted_group", "glo", "ghi")))
        launches.append((_warp.prepare(_tree._parents_kernel(), 1, [d, -1, lo, hi, glo, ghi, sums], work=nodes), ("glo", "ghi")))
        launches.append((_warp.prepare(_tree._finish_kernel(dtype, winding), size, [nodes, lo, hi, glo, ghi, sums, center, lo_out, hi_out,
                                                                                    center_out, normal, moment],
                                        **_tree.node_cut(size, winding)),
                         ("glo", "ghi", "lo_out", "hi_out", "center_out", "normal", "moment")))
        if winding:
            walks = _tree.radius_walks(n)
            launches.append((_warp.prepare(_tree._radius_kernel(), walks, [corners, n, d, lo, hi, center, radius, walks],
                                           **_tree.radius_cut(n)), ()))
        if any(launch is None for launch, _ in launches):
            return None
        self.launches = [(launch, launch.fields(*used), used) for launch, used in launches]
        self.keep = (points, split[1], corners, lo, hi, sums, scale, center, radius)
        return self

    def held(self) -> int:
        """The bytes this build holds (:meth:`pcops._warp.Kept.put`)."""
        return _warp.held_bytes(self.keep) + sum(launch.held() for launch, _, _ in self.launches)

    def _outputs(self) -> list:
        """New tensors of the hierarchy the launches write: order, the sorted faces' corners and
        sample ids, the nodes' boxes and sample ranges, and their winding data."""
        n, size, rows = self.n, _tree.node_count(self.n), self.shapes[0]
        f = lambda *shape: torch.empty(shape, dtype=self.dtype)  # noqa: E731
        i = lambda *shape: torch.empty(shape, dtype=torch.int64)  # noqa: E731
        return [torch.arange(n), f(n, 3), f(n, 3), f(n, 3), i(n), f(size, 3), f(size, 3), i(size), i(size), f(rows, 3), f(rows, 3),
                f(rows, 9)]

    def run(self, v64, faces, group) -> _tree.Tree:
        """The hierarchy of the mesh (``v64``: its vertices in float64, contiguous)."""
        order, ta, tb, tc, sorted_group, lo_out, hi_out, glo, ghi, center_out, normal, moment = self._outputs()
        arrays = dict(vertices=v64, faces=faces, order=order, group=group, ta=ta, tb=tb, tc=tc, sorted_group=sorted_group, glo=glo,
                      ghi=ghi, lo_out=lo_out, hi_out=hi_out, center_out=center_out, normal=normal, moment=moment)
        for launch, fields, used in self.launches:
            launch.run_at(fields, *(arrays[name] for name in used))
        scale, radius = self.keep[6], self.keep[8]
        return _tree.Tree(order, ta, tb, tc, sorted_group, lo_out, hi_out, glo, ghi, center_out, normal, moment.view(-1, 3, 3),
                          radius.to(self.dtype, copy=True), scale.amax().to(self.dtype))


__all__ = ["build"]
