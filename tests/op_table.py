"""The one table of pcops' public ops, read by the reliability, benchmark-smoke and docs tests.

Every public function of ``pcops`` must have a row (tests/test_op_table.py), so an op added
without one fails a test instead of being missed by hand-kept lists. A row says:

* ``call(inputs, **kw)``: the canonical call on ``inputs`` (a dict keyed by the caller's argument
  names, as :func:`Op.inputs` makes them) with extra keywords (``validate=False``);
* ``points``: the float inputs that hold coordinates or values checked for NaN/inf, by the
  name the caller types (the name every message must use);
* ``grad``: the differentiable inputs;
* ``clouds``: 2 for two-cloud ops (pcops._batch.pair), 1 for one-cloud ops (pcops._batch.single),
  0 for ops on other data (grid coordinates, segments, gathers);
* ``page``: its docs page under docs/ops/; ``bench``: the op name its benchmark rows carry;
* ``breaks_at``: for an op whose result size depends on the data, the custom op where default
  ``torch.compile`` (without ``fullgraph``) breaks the graph ("" for ops whose sizes follow from
  their inputs' shapes: they must compile without a break); ``static``: then the call of its
  static-size form (a caller-given bound), which must compile without a break.

``make(generator, n, **options)`` builds the inputs: ``n`` points (the reference cloud of a
two-cloud op, the sites, rows or values of the others; each builder's default is the tests'
small size) and builder options (``dtype``, ``channels``, ``n_query``, ``cloud``: a function
``(generator, n) -> (n, 3)`` points drawing the coordinates instead of the unit cube).
scripts/benchmark.py builds the inputs of the ops it times with these builders, as PyTorch3D's
benchmarks call its tests' helpers, so tests and benchmarks never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import pcops


@dataclass(frozen=True)
class Op:
    name: str
    make: Callable[..., dict]  # make(generator, n=<the tests' size>, **options) -> inputs
    call: Callable
    points: tuple[str, ...] = ()
    grad: tuple[str, ...] = ()
    clouds: int = 0
    page: str = ""
    bench: str = ""
    validates: bool = True  # takes validate= (NaN/inf checks)
    notes: dict = field(default_factory=dict)
    breaks_at: str = ""
    static: Callable | None = None

    def inputs(self, seed: int = 0, n: int | None = None, **options) -> dict:
        """The row's inputs from a generator seeded with ``seed``: ``n`` points (the builder's
        default when None) and the builder's ``options`` (dtype, channels, n_query, cloud)."""
        size = {} if n is None else {"n": n}
        return self.make(torch.Generator().manual_seed(seed), **size, **options)


F64 = torch.float64


def _points(g, n: int, dtype=F64, cloud=None) -> torch.Tensor:
    """(n, 3) points in ``dtype``: uniform in the unit cube, or drawn by ``cloud(g, n)``."""
    if cloud is None:
        return torch.rand(n, 3, generator=g, dtype=dtype)
    return cloud(g, n).to(dtype)


def _values(g, n: int, channels: int, dtype=F64) -> torch.Tensor:
    return torch.rand(n, channels, generator=g, dtype=dtype)


def _two(g, n=300, *, n_query=None, channels=4, dtype=F64, cloud=None):
    """query (n_query, 3) (2n/3 by default), ref (n, 3) and its features (n, channels)."""
    query = _points(g, 2 * n // 3 if n_query is None else n_query, dtype, cloud)
    return dict(query=query, ref=_points(g, n, dtype, cloud), features=_values(g, n, channels, dtype))


def _xy(g, n=300, *, n_query=None, dtype=F64, cloud=None):
    """Chamfer's x (n_query, 3) (2n/3 by default) and y (n, 3)."""
    return dict(x=_points(g, 2 * n // 3 if n_query is None else n_query, dtype, cloud), y=_points(g, n, dtype, cloud))


def _one(g, n=300, *, channels=4, dtype=F64, cloud=None):
    """points (n, 3) and their features (n, channels)."""
    return dict(points=_points(g, n, dtype, cloud), features=_values(g, n, channels, dtype))


def _voxels(g, n=200, *, channels=4, out_channels=5, dtype=F64):
    """Unique integer sites (at most n; 8^3 cells at n = 200: about 0.39 draws per cell), their
    features (sites, channels) and a 3^3 kernel's weight (27, channels, out_channels)."""
    span = max(2, round((2.56 * n) ** (1 / 3)))
    coords = torch.unique(torch.randint(0, span, (n, 3), generator=g), dim=0)
    return dict(features=torch.rand(coords.shape[0], channels, generator=g, dtype=dtype), coords=coords,
                weight=torch.rand(27, channels, out_channels, generator=g, dtype=dtype))


def _segments(g, n=50, *, channels=3, dtype=F64):
    """values (n, channels) and CSR offsets of about n/12 + 2 segments, one of them empty."""
    values = _values(g, n, channels, dtype)
    cuts = torch.randint(0, n + 1, (max(1, n // 12),), generator=g)
    cuts = torch.sort(torch.cat([cuts, cuts[:1]])).values  # a repeated cut: an empty segment
    return dict(values=values, offsets=torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))


def _gather(g, n=30, *, n_query=None, k=5, channels=4, dtype=F64):
    """features (n, channels) and indices (n_query, k) (2n/3 by default) in [-1, n): -1 pads."""
    m = 2 * n // 3 if n_query is None else n_query
    return dict(features=_values(g, n, channels, dtype), idx=torch.randint(-1, n, (m, k), generator=g))


def _codes(g, n=100, *, channels=4, dtype=F64):
    """grid_coord (n, 3) in [0, 16) (depth 4 and up) and features (n, channels)."""
    grid = torch.randint(0, 16, (n, 3), generator=g)
    return dict(grid_coord=grid, features=_values(g, n, channels, dtype))


OPS = [
    Op("knn", _two, lambda i, **kw: pcops.knn(i["query"], i["ref"], 4, **kw),
       points=("query", "ref"), grad=("query", "ref"), clouds=2, page="knn", bench="knn_search"),
    Op("knn_aggregate", _two, lambda i, **kw: pcops.knn_aggregate(i["query"], i["ref"], i["features"], 4, 0.1, **kw),
       points=("query", "ref", "features"), grad=("query", "ref", "features"), clouds=2, page="knn", bench="knn_aggregate"),
    Op("radius_aggregate", _two, lambda i, **kw: pcops.radius_aggregate(i["query"], i["ref"], i["features"], 0.2, 0.1, **kw),
       points=("query", "ref", "features"), grad=("query", "ref", "features"), clouds=2, page="radius_aggregate",
       bench="radius_aggregate"),
    Op("ball_query", _two, lambda i, **kw: pcops.ball_query(i["query"], i["ref"], 0.2, 8, **kw),
       points=("query", "ref"), grad=("query", "ref"), clouds=2, page="ball_query", bench="ball_query"),
    Op("knn_interpolate", _two, lambda i, **kw: pcops.knn_interpolate(i["query"], i["ref"], i["features"], 3, **kw),
       points=("query", "ref", "features"), grad=("query", "ref", "features"), clouds=2, page="knn_interpolate",
       bench="knn_interpolate"),
    Op("chamfer_distance", _xy,
       lambda i, **kw: pcops.chamfer_distance(i["x"], i["y"], **kw),
       points=("x", "y"), grad=("x", "y"), clouds=2, page="chamfer_distance", bench="chamfer_distance"),
    Op("farthest_point_sample", _one, lambda i, **kw: pcops.farthest_point_sample(i["points"], 20, **kw),
       points=("points",), clouds=1, page="farthest_point_sample", bench="farthest_point_sample"),
    Op("knn_graph", _one, lambda i, **kw: pcops.knn_graph(i["points"], 6, **kw),
       points=("points",), clouds=1, page="graphs", bench="knn_graph", breaks_at="pcops.edges",
       static=lambda i, **kw: pcops.knn_graph(i["points"], 6, max_edges=2000, **kw)),
    Op("radius_graph", _one, lambda i, **kw: pcops.radius_graph(i["points"], 0.15, **kw),
       points=("points",), clouds=1, page="graphs", bench="radius_graph", breaks_at="pcops.radius_graph",
       static=lambda i, **kw: pcops.radius_graph(i["points"], 0.15, max_edges=4000, **kw)),
    Op("estimate_normals", _one, lambda i, **kw: pcops.estimate_normals(i["points"], 8, **kw),
       points=("points",), grad=("points",), clouds=1, page="estimate_normals", bench="estimate_normals"),
    Op("voxel_pool", _one, lambda i, **kw: pcops.voxel_pool(i["points"], 0.2, i["features"], **kw),
       points=("points", "features"), grad=("points", "features"), clouds=1, page="voxel_pool", bench="voxel_pool",
       breaks_at="pcops.voxel_cluster", static=lambda i, **kw: pcops.voxel_pool(i["points"], 0.2, i["features"], max_voxels=150, **kw)),
    Op("grid_sample", _one, lambda i, **kw: pcops.grid_sample(i["points"], 0.2, **kw),
       points=("points",), grad=("points",), clouds=1, page="grid_sample", bench="grid_sample", breaks_at="pcops.grid_cluster",
       static=lambda i, **kw: pcops.grid_sample(i["points"], 0.2, max_voxels=150, **kw)),
    Op("sparse_conv3d", _voxels, lambda i, **kw: pcops.sparse_conv3d(i["features"], i["coords"], i["weight"], kernel_size=3, **kw),
       points=("features", "weight"), grad=("features", "weight"), page="sparse_conv", bench="sparse_conv3d_forward"),
    Op("sparse_kernel_map", _voxels, lambda i, **kw: pcops.sparse_kernel_map(i["coords"], **kw),
       page="sparse_conv", bench="sparse_kernel_map", validates=False),
    Op("serialize", _codes, lambda i, **kw: pcops.serialize(i["grid_coord"], **kw),
       page="serialize", bench="serialize", validates=False),
    Op("serialized_pool", _codes,
       lambda i, **kw: pcops.serialized_pool(pcops.serialize(i["grid_coord"], depth=4).code, 1, i["features"], **kw),
       grad=("features",), page="serialize", bench="serialized_pool", validates=False, breaks_at="pcops.serialized_cluster",
       static=lambda i, **kw: pcops.serialized_pool(pcops.serialize(i["grid_coord"], depth=4).code, 1, i["features"], max_clusters=80, **kw)),
    Op("serialized_unpool", _gather, lambda i, **kw: pcops.serialized_unpool(i["features"], i["idx"].clamp_min(0)[:, 0], **kw),
       grad=("features",), page="serialize", bench="gather", validates=False),  # a gather by the cluster map
    Op("segment_reduce", _segments, lambda i, **kw: pcops.segment_reduce(i["values"], i["offsets"], **kw),
       grad=("values",), page="segment_reduce", bench="segment_reduce", validates=False),
    Op("gather", _gather, lambda i, **kw: pcops.gather(i["features"], i["idx"], **kw),
       grad=("features",), page="gather", bench="gather"),  # copies values as they are: validate checks idx
]

BY_NAME = {op.name: op for op in OPS}
POINT_OPS = [op for op in OPS if op.validates and op.points]
