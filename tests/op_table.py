"""The one table of pcops' public ops, read by the reliability, benchmark-smoke and docs tests.

Every public function of ``pcops`` must have a row (tests/test_op_table.py), so an op added
without one fails a test instead of being missed by hand-kept lists. A row says:

* ``call(inputs, **kw)``: the canonical call on ``inputs`` (a dict keyed by the caller's argument
  names, as :func:`Op.inputs` makes them) with extra keywords (``validate=False``);
* ``points``: the float inputs that hold coordinates or values checked for NaN/inf, by the
  name the caller types (the name every message must use);
* ``grad``: the differentiable inputs;
* ``clouds``: 2 for two-cloud ops (pcops._layout.pair), 1 for one-cloud ops (pcops._layout.single),
  0 for ops on other data (grid coordinates, segments, gathers);
* ``page``: its docs page under docs/ops/; ``bench``: the op name its benchmark rows carry;
* ``breaks_at``: for an op whose result size depends on the data, the custom op where default
  ``torch.compile`` (without ``fullgraph``) breaks the graph ("" for ops whose sizes follow from
  their inputs' shapes: they must compile without a break); ``static``: then the call of its
  static-size form (a caller-given bound), which must compile without a break;
* the number arguments of ``call`` (and ``static``) are its keyword parameters with number
  defaults (``lambda i, k=4, **kw: pcops.knn(i["query"], i["ref"], k, **kw)``): :attr:`Op.numbers`,
  the numbers the NumPy-scalar test passes as ``np.int64(4)`` and the like;
* ``batch``: the keywords of the op's packed sample ids and the input each labels
  (``{"query_batch": "query", "ref_batch": "ref"}``), for the tests of ids of any integer range;
* ``notes``: why an op does not take part in a table-driven check, keyed by the check:
  ``"grad"`` (no differentiable input), ``"numbers"`` (no number argument), ``"batch"`` (no
  packed sample ids), ``"threads"`` (left out of the concurrent-calls test). Every op takes part
  in each check or says why here (tests/test_op_table.py), never by being left off a list.

``make(generator, n, **options)`` builds the inputs: ``n`` points (the reference cloud of a
two-cloud op, the sites, rows or values of the others; each builder's default is the tests'
small size) and builder options (``dtype``, ``channels``, ``n_query``, ``cloud``: a function
``(generator, n) -> (n, 3)`` points drawing the coordinates instead of the unit cube).
scripts/benchmark.py builds the inputs of the ops it times with these builders, as PyTorch3D's
benchmarks call its tests' helpers, so tests and benchmarks never drift apart.
"""

from __future__ import annotations

import inspect
import math
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
    validates: bool = True  # takes validate= (value checks: NaN/inf in points, ranges of ids and indices)
    notes: dict = field(default_factory=dict)
    breaks_at: str = ""
    static: Callable | None = None
    batch: dict = field(default_factory=dict)  # keyword of packed sample ids -> the input it labels

    @property
    def numbers(self) -> dict:
        """The number arguments of the canonical call and their values: {name: int or float}."""
        return numbers(self.call)

    def inputs(self, seed: int = 0, n: int | None = None, **options) -> dict:
        """The row's inputs from a generator seeded with ``seed``: ``n`` points (the builder's
        default when None) and the builder's ``options`` (dtype, channels, n_query, cloud)."""
        size = {} if n is None else {"n": n}
        return self.make(torch.Generator().manual_seed(seed), **size, **options)


def numbers(call: Callable) -> dict:
    """The keyword parameters of a row's call with number defaults (not bools): {name: value}."""
    return {p.name: p.default for p in inspect.signature(call).parameters.values()
            if isinstance(p.default, (int, float)) and not isinstance(p.default, bool)}


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


def _equal(g, n=300, *, dtype=F64, cloud=None):
    """x and y of n points each (the exact earth mover's distance matches equal-size clouds)."""
    return dict(x=_points(g, n, dtype, cloud), y=_points(g, n, dtype, cloud))


def _one(g, n=300, *, channels=4, dtype=F64, cloud=None):
    """points (n, 3) and their features (n, channels)."""
    return dict(points=_points(g, n, dtype, cloud), features=_values(g, n, channels, dtype))


def _voxels(g, n=200, *, channels=4, out_channels=5, dtype=F64):
    """Unique integer sites (at most n; 8^3 cells at n = 200: about 0.39 draws per cell), their
    features (sites, channels) and a 3^3 kernel's weight (27, channels, out_channels)."""
    span = max(2, round((2.56 * n) ** (1 / 3)))
    coords = torch.unique(torch.randint(0, span, (n, 3), generator=g), dim=0)
    return dict(features=torch.rand(coords.shape[0], channels, generator=g, dtype=dtype), grid_coord=coords,
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


def _sample_codes(grid_coord, batch, depth: int) -> torch.Tensor:
    """serialize's codes of the sites with their samples (ranked: any ids give the same codes)."""
    ranks = None if batch is None else torch.unique(batch, return_inverse=True)[1]
    return pcops.serialize(grid_coord, ranks, depth=depth).code


def _codes(g, n=100, *, channels=4, dtype=F64):
    """grid_coord (n, 3) in [0, 16) (depth 4 and up) and features (n, channels)."""
    grid = torch.randint(0, 16, (n, 3), generator=g)
    return dict(grid_coord=grid, features=_values(g, n, channels, dtype))


def icosphere(subdivisions: int, dtype=F64) -> tuple[torch.Tensor, torch.Tensor]:
    """A unit icosphere (trimesh's): vertices (V, 3) and faces (F, 3), F = 20 * 4^subdivisions."""
    import trimesh

    m = trimesh.creation.icosphere(subdivisions=subdivisions)
    return torch.tensor(m.vertices, dtype=dtype), torch.tensor(m.faces, dtype=torch.int64)


def _mesh(g, n=200, *, faces=80, dtype=F64, cloud=None):
    """A closed mesh of about ``faces`` faces (an icosphere, its vertices moved radially by up to
    +-15%) and n query points in [-1.5, 1.5]^3 (or drawn by ``cloud``)."""
    vertices, tris = icosphere(max(0, round(math.log(max(faces, 20) / 20, 4))), dtype)
    vertices = vertices * (1 + 0.3 * (torch.rand(vertices.shape[0], 1, generator=g, dtype=dtype) - 0.5))
    points = 3 * _points(g, n, dtype) - 1.5 if cloud is None else cloud(g, n).to(dtype)
    return dict(points=points, vertices=vertices, faces=tris)


def _volume(g, n=1000, *, dtype=F64, batch=None):
    """A grid of about n values, (s, s, s) with s = round(n^(1/3)) (or (batch, s, s, s)): the
    distance to a random centre less a radius of s / 3 voxels, plus noise, so that the level set
    0 is a closed, bumpy surface."""
    n = max(2, round(n ** (1 / 3)))
    shape = (n, n, n) if batch is None else (batch, n, n, n)
    axis = torch.arange(n, dtype=F64)
    centre = (n - 1) / 2 + torch.rand(*shape[:-3], 3, 1, 1, 1, generator=g, dtype=F64) - 0.5
    radius = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij")) - centre
    field = radius.norm(dim=-4) - n / 3 + 0.5 * torch.rand(shape, generator=g, dtype=F64)
    return dict(volume=field.to(dtype))


def _flat(results: tuple) -> tuple:
    """The tensors of a tuple of results (NamedTuples), one after another."""
    return tuple(t for result in results for t in result)


PAIR_IDS = {"query_batch": "query", "ref_batch": "ref"}  # a two-cloud op's packed sample ids: the input each labels
ONE_IDS = {"batch": "points"}
NO_GRAD = "its outputs are indices (edges, codes, neighbour tables): nothing to differentiate"

OPS = [
    Op("knn", _two, lambda i, k=4, **kw: pcops.knn(i["query"], i["ref"], k, **kw),
       points=("query", "ref"), grad=("query", "ref"), clouds=2, page="knn", bench="knn_search", batch=PAIR_IDS),
    Op("knn_aggregate", _two,
       lambda i, k=4, sigma=0.1, **kw: pcops.knn_aggregate(i["query"], i["ref"], i["features"], k, sigma, **kw),
       points=("query", "ref", "features"), grad=("query", "ref", "features"), clouds=2, page="knn", bench="knn_aggregate",
       batch=PAIR_IDS),
    Op("radius_aggregate", _two,
       lambda i, radius=0.2, sigma=0.1, **kw: pcops.radius_aggregate(i["query"], i["ref"], i["features"], radius, sigma, **kw),
       points=("query", "ref", "features"), grad=("query", "ref", "features"), clouds=2, page="radius_aggregate",
       bench="radius_aggregate", batch=PAIR_IDS),
    Op("ball_query", _two, lambda i, radius=0.2, max_neighbors=8, **kw: pcops.ball_query(i["query"], i["ref"], radius, max_neighbors, **kw),
       points=("query", "ref"), grad=("query", "ref"), clouds=2, page="ball_query", bench="ball_query", batch=PAIR_IDS),
    Op("ball_queries", _two,  # its tuple of BallQuery results flattened: the table's checks read a tuple of tensors
       lambda i, radius=0.1, max_neighbors=8, **kw: _flat(pcops.ball_queries(i["query"], i["ref"], (radius, 1.5 * radius, 3 * radius), max_neighbors, **kw)),
       points=("query", "ref"), grad=("query", "ref"), clouds=2, page="ball_query", bench="ball_queries", batch=PAIR_IDS),
    Op("knn_interpolate", _two, lambda i, k=3, **kw: pcops.knn_interpolate(i["query"], i["ref"], i["features"], k, **kw),
       points=("query", "ref", "features"), grad=("query", "ref", "features"), clouds=2, page="knn_interpolate",
       bench="knn_interpolate", batch=PAIR_IDS),
    Op("mesh_distance", _mesh,
       lambda i, max_dist=5.0, **kw: pcops.mesh_distance(i["points"], i["vertices"], i["faces"], signed=True, max_dist=max_dist, **kw),
       points=("points", "vertices"), grad=("points", "vertices"), page="mesh", bench="mesh_distance",
       notes={"batch": "packed meshes need every face's vertices in one sample, which random ids per row break: "
                       "tests/ops/mesh/test_distance.py tests ids above int32"}),
    Op("mesh_bvh", _mesh, lambda i, **kw: pcops.mesh_distance(i["points"], pcops.mesh_bvh(i["vertices"], i["faces"], **kw)).dists,
       points=("vertices",), grad=("vertices",), page="mesh", bench="mesh_distance",
       notes={"numbers": "no number argument",
              "batch": "packed meshes need every face's vertices in one sample, which random ids per row break: "
                       "tests/ops/mesh/test_distance.py tests ids above int32"}),
    Op("point_mesh_face_distance", _mesh, lambda i, **kw: pcops.point_mesh_face_distance(i["points"], i["vertices"], i["faces"], **kw),
       points=("points", "vertices"), grad=("points", "vertices"), page="mesh", bench="point_mesh_face_distance",
       notes={"numbers": "no number argument",
              "batch": "packed meshes need every face's vertices in one sample, which random ids per row break: "
                       "tests/ops/mesh/test_loss.py packs with other ids"}),
    Op("sample_points_on_mesh", _mesh,
       lambda i, n_samples=64, seed=0, **kw: pcops.sample_points_on_mesh(i["vertices"], i["faces"], n_samples, seed=seed, **kw),
       points=("vertices",), grad=("vertices",), page="mesh_sampling", bench="sample_points_on_mesh",
       notes={"batch": "packed meshes need every face's vertices in one sample, which random ids per row break, and its "
                       "ids number its B * n_samples rows (B = the largest id + 1 unless batch_size says): ids above int32 "
                       "ask for 2**32 meshes; tests/ops/mesh/test_sample.py packs meshes"}),
    Op("marching_cubes", _volume, lambda i, level=0.0, **kw: pcops.marching_cubes(i["volume"], level, **kw),
       points=("volume",), grad=("volume",), page="marching_cubes", bench="marching_cubes", breaks_at="pcops.marching_cubes",
       static=lambda i, level=0.0, max_vertices=600, max_faces=1200, **kw: pcops.marching_cubes(
           i["volume"], level, max_vertices=max_vertices, max_faces=max_faces, **kw),
       notes={"batch": "a batch is a (B, D, H, W) grid: it takes no sample ids; "
                       "tests/ops/mesh/test_marching_cubes.py checks the packed and padded batches against a loop"}),
    Op("chamfer_distance", _xy, lambda i, norm=2, **kw: pcops.chamfer_distance(i["x"], i["y"], norm=norm, **kw),
       points=("x", "y"), grad=("x", "y"), clouds=2, page="chamfer_distance", bench="chamfer_distance",
       notes={"batch": "x_batch / y_batch index its (B,) per-sample losses (B = the largest id + 1 unless batch_size says): "
                       "ids above int32 ask for 2**32 samples; its per-point costs keep such ids apart (test_reliability.py)"}),
    Op("sinkhorn_divergence", _xy, lambda i, blur=0.05, **kw: pcops.sinkhorn_divergence(i["x"], i["y"], blur=blur, **kw),
       points=("x", "y"), grad=("x", "y"), clouds=2, page="transport", bench="sinkhorn_divergence",
       notes={"batch": "x_batch / y_batch index its (B,) per-sample losses (B = the largest id + 1 unless batch_size says): "
                       "ids above int32 ask for 2**32 samples; tests/ops/transport/test_sinkhorn.py packs batches against a loop"}),
    Op("earth_movers_distance", _equal, lambda i, p=2, **kw: pcops.earth_movers_distance(i["x"], i["y"], p=p, **kw).distance,
       points=("x", "y"), grad=("x", "y"), clouds=2, page="transport", bench="earth_movers_distance",
       notes={"batch": "x_batch / y_batch index its (B,) per-sample losses (B = the largest id + 1 unless batch_size says): "
                       "ids above int32 ask for 2**32 samples; tests/ops/transport/test_emd.py packs batches against a loop",
              "threads": "its solver is scipy's linear_sum_assignment (O(n^3), seconds at the test's 3,200 points per call); "
                         "pcops keeps no state between calls (the matching is computed per call on the CPU)"}),
    Op("farthest_point_sample", _one, lambda i, n_samples=20, **kw: pcops.farthest_point_sample(i["points"], n_samples, **kw),
       points=("points",), grad=("points",), clouds=1, page="farthest_point_sample", bench="farthest_point_sample", batch=ONE_IDS),
    Op("knn_graph", _one, lambda i, k=6, **kw: pcops.knn_graph(i["points"], k, **kw),
       points=("points",), clouds=1, page="graphs", bench="knn_graph", breaks_at="pcops.edges",
       static=lambda i, k=6, max_edges=2000, **kw: pcops.knn_graph(i["points"], k, max_edges=max_edges, **kw),
       batch=ONE_IDS, notes={"grad": NO_GRAD}),
    Op("radius_graph", _one, lambda i, radius=0.15, **kw: pcops.radius_graph(i["points"], radius, **kw),
       points=("points",), clouds=1, page="graphs", bench="radius_graph", breaks_at="pcops.radius_graph",
       static=lambda i, radius=0.15, max_edges=4000, **kw: pcops.radius_graph(i["points"], radius, max_edges=max_edges, **kw),
       batch=ONE_IDS, notes={"grad": NO_GRAD}),
    Op("estimate_normals", _one, lambda i, k=8, **kw: pcops.estimate_normals(i["points"], k, **kw),
       points=("points",), grad=("points",), clouds=1, page="estimate_normals", bench="estimate_normals", batch=ONE_IDS),
    Op("voxel_pool", _one, lambda i, voxel_size=0.2, **kw: pcops.voxel_pool(i["points"], voxel_size, i["features"], **kw),
       points=("points", "features"), grad=("points", "features"), clouds=1, page="voxel_pool", bench="voxel_pool",
       breaks_at="pcops.voxel_cluster", batch=ONE_IDS,
       static=lambda i, voxel_size=0.2, max_voxels=150, **kw: pcops.voxel_pool(i["points"], voxel_size, i["features"], max_voxels=max_voxels, **kw)),
    Op("grid_sample", _one, lambda i, voxel_size=0.2, **kw: pcops.grid_sample(i["points"], voxel_size, **kw),
       points=("points",), grad=("points",), clouds=1, page="grid_sample", bench="grid_sample", breaks_at="pcops.grid_cluster",
       static=lambda i, voxel_size=0.2, max_voxels=150, **kw: pcops.grid_sample(i["points"], voxel_size, max_voxels=max_voxels, **kw),
       batch=ONE_IDS),
    Op("sparse_conv3d", _voxels,
       lambda i, kernel_size=3, dilation=1, **kw: pcops.sparse_conv3d(
           i["features"], i["grid_coord"], i["weight"], kernel_size=kernel_size, dilation=dilation, **kw),
       points=("features", "weight"), grad=("features", "weight"), page="sparse_conv", bench="sparse_conv3d_forward",
       batch={"batch": "grid_coord"}),
    Op("sparse_kernel_map", _voxels,
       lambda i, kernel_size=3, dilation=1, **kw: pcops.sparse_kernel_map(i["grid_coord"], kernel_size=kernel_size, dilation=dilation, **kw),
       page="sparse_conv", bench="sparse_kernel_map", batch={"batch": "grid_coord"}, notes={"grad": NO_GRAD}),
    Op("serialize", _codes, lambda i, depth=16, **kw: pcops.serialize(i["grid_coord"], depth=depth, **kw),
       page="serialize", bench="serialize",
       notes={"grad": NO_GRAD, "batch": "its codes hold the sample ids themselves, above bit 3 * depth of an int64 "
                                         "(ids below 2**15 at depth 16; larger ones raise a ValueError)"}),
    Op("serialized_pool", _codes,
       lambda i, pooling_depth=1, depth=4, batch=None, **kw: pcops.serialized_pool(
           _sample_codes(i["grid_coord"], batch, depth), pooling_depth, i["features"], batch=batch, **kw),
       grad=("features",), page="serialize", bench="serialized_pool", breaks_at="pcops.serialized_cluster",
       static=lambda i, pooling_depth=1, depth=4, max_clusters=80, batch=None, **kw: pcops.serialized_pool(
           _sample_codes(i["grid_coord"], batch, depth), pooling_depth, i["features"], max_clusters=max_clusters, batch=batch, **kw),
       batch={"batch": "grid_coord"}),  # ids returned per parent (the codes tell the samples apart)
    Op("serialized_unpool", _gather, lambda i, **kw: pcops.serialized_unpool(i["features"], i["idx"].clamp_min(0)[:, 0], **kw),
       grad=("features",), page="serialize", bench="gather",  # a gather by the cluster map
       notes={"numbers": "takes no number", "batch": "takes no sample ids: its cluster map addresses rows"}),
    Op("segment_reduce", _segments, lambda i, **kw: pcops.segment_reduce(i["values"], i["offsets"], **kw),
       grad=("values",), page="segment_reduce", bench="segment_reduce",
       notes={"numbers": "takes no number with offsets (num_segments goes with ids)",
              "batch": "its segments (offsets or ids) are the grouping: no sample ids"}),
    Op("gather", _gather, lambda i, **kw: pcops.gather(i["features"], i["idx"], **kw),
       grad=("features",), page="gather", bench="gather",  # copies values as they are: validate checks idx
       notes={"numbers": "takes no number", "batch": "takes no sample ids: its indices address rows"}),
]

BY_NAME = {op.name: op for op in OPS}
POINT_OPS = [op for op in OPS if op.validates and op.points]
