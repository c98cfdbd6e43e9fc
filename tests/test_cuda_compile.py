"""Every Warp kernel of pcops compiles for a GPU (sm_90 PTX, through the NVRTC that ships with
Warp), on machines without one: CUDA-only code generation (local arrays, atomics, vector
types) is checked here even where the `cuda`-marked tests cannot run. Compiling is not
running: the CUDA results themselves are tested by the `cuda`-marked tests only.
"""

import importlib

import pytest
import torch
import warp as wp

from pcops import _warp

# the modules (pcops.ops re-exports functions of the same names)
_cells, ball_search, radius, sampling, nearest, costs = (
    importlib.import_module(f"pcops.ops.{name}")
    for name in ("neighbours._cells", "neighbours._ball_search", "neighbours.radius", "sampling.fps", "neighbours.nearest._kdtree",
                 "neighbours.nearest._costs")
)

F32, F64 = torch.float32, torch.float64

FACTORIES = [
    *[(f"knn search {d} grouped={g}", nearest._search_kernel, (d, g)) for d in (F32, F64) for g in (False, True)],
    *[(f"knn scan {d} grouped={g}", nearest._scan_kernel, (d, g)) for d in (F32, F64) for g in (False, True)],
    *[(f"ball query dense {d} runs={r}", ball_search.kernel, (d, (), False, True, r)) for d in (F32, F64) for r in (False, True)],
    *[(f"knn build {d}", nearest._build_kernels, (d,)) for d in (F32, F64)],
    *[(f"chamfer costs {d}", costs._kernels, (d,)) for d in (F32, F64)],
    *[(f"knn ordered build {d}", nearest._ordered_kernels, (d,)) for d in (F32, F64)],
    *[(f"farthest point sample {d}", sampling._kernels, (d, sampling.PLAIN_PAIRS)) for d in (F32, F64)],
    *[(f"ball query {d} runs={r}", ball_search.kernel, (d, (), False, False, r)) for d in (F32, F64) for r in (False, True)],
    *[(f"ball queries {d}", ball_search.kernel, (d, ((0, 4), (4, 8), (12, 16)))) for d in (F32, F64)],  # three radii, static columns
    *[(f"ball tree {d} heap={h}", importlib.import_module("pcops.ops.neighbours._ball_tree").kernel, (d, h)) for d in (F32, F64) for h in (False, True)],
    *[(f"ball tree sample {d}", importlib.import_module("pcops.ops.neighbours._ball_tree")._tally_kernel, (d,)) for d in (F32, F64)],
    *[(f"radius graph {d}", importlib.import_module("pcops.ops.neighbours.graph")._within_kernel, (d,)) for d in (F32, F64)],
    *[(f"radius {w} {d}", radius._kernels, (d, w)) for d in (F32, F64) for w in ("softmax", "inverse_distance", "uniform")],
    *[(f"radius dense {w} {d}", radius._kernels, (d, w, True)) for d in (F32, F64) for w in ("softmax", "uniform")],
    *[(f"radius max {d} dense={e}", radius._max_kernel, (d, e)) for d in (F32, F64) for e in (False, True)],
    ("cells starts", _cells._starts_kernel, ()),
    ("morton spread table", importlib.import_module("pcops._morton")._table_kernel, ()),
    *[(f"cells permute {d}", _cells._permute_kernel, (d,)) for d in (F32, F64)],
    *[(f"cells key {d}", _cells._key_kernel, (d,)) for d in (F32, F64)],
    *[(f"cells box {d}", _cells._box_kernel, (d,)) for d in (F32, F64)],
    ("cells counting sort", _cells._counting_sort_kernel, ()),
    ("sparse conv kernel map merge", importlib.import_module("pcops.ops.sparse.sparse_conv")._merge_kernel, ()),
    *[(f"normals {d} oriented={o}", importlib.import_module("pcops.ops.geometry.normals")._kernel, (d, o)) for d in (F32, F64) for o in (False, True)],
    *[(f"segment {r} {d}", importlib.import_module("pcops.ops.sparse.segment")._kernels, (d, r)) for d in (F32, F64) for r in ("sum", "mean", "max", "min")],
    ("serialize codes", importlib.import_module("pcops.ops.sparse.serialize")._codes_kernel, ()),
    *[(f"mesh closest {d} faces_to_points={t} rivals={r}", importlib.import_module("pcops.ops.mesh._search")._closest_kernel, (d, t, r))
      for d in (F32, F64) for t in (False, True) for r in (False, True)],
    *[(f"mesh winding {d}", importlib.import_module("pcops.ops.mesh._search")._winding_kernel, (d,)) for d in (F32, F64)],
    ("mesh sides analysis", importlib.import_module("pcops.ops.mesh._sides")._analysis_kernels, ()),
    ("mesh sides outside", importlib.import_module("pcops.ops.mesh._sides")._outside_kernel, ()),
    *[(f"mesh sides {d}", importlib.import_module("pcops.ops.mesh._sides")._sides_kernel, (d,)) for d in (F32, F64)],
    *[(f"mesh capped {d}", importlib.import_module("pcops.ops.mesh._caps")._capped_kernel, (d,)) for d in (F32, F64)],
    *[(f"mesh caps neighbourhood {d}", importlib.import_module("pcops.ops.mesh._caps")._neighbourhood_kernel, (d,)) for d in (F32, F64)],
    *[(f"triangle closest {d} result={r}", importlib.import_module("pcops.ops.mesh._triangle")._closest_kernel, (d, r)) for d in (F32, F64) for r in (False, True)],
    ("plane normals", importlib.import_module("pcops.ops.mesh._triangle")._normal_kernel, (F64,)),
    ("mesh tree reach", importlib.import_module("pcops.ops.mesh._tree")._reach_kernel, ()),
    ("mesh tree radius walk", importlib.import_module("pcops.ops.mesh._tree")._radius_kernel, ()),
    ("mesh tree parents", importlib.import_module("pcops.ops.mesh._tree")._parents_kernel, ()),
    ("mesh tree centroids", importlib.import_module("pcops.ops.mesh._tree")._centroid_kernel, ()),
    *[(f"mesh tree keys {d}", importlib.import_module("pcops.ops.mesh._tree")._keys_kernel, (d,)) for d in (F32, F64)],
    *[(f"mesh tree {name} {d} winding={w}", getattr(importlib.import_module("pcops.ops.mesh._tree"), f"_{name}_kernel"), (d, w))
      for name in ("leaves", "finish") for d in (F32, F64) for w in (False, True)],
    *[(f"distributed fps update {d}", importlib.import_module("pcops.distributed._fps")._update_kernel, (d,)) for d in (F32, F64)],
    *[(f"sinkhorn p={p} {d}", importlib.import_module("pcops.ops.transport.sinkhorn")._kernels, (d, p)) for d in (F32, F64) for p in (1, 2)],
    *[(f"mesh sample {d} from_seeds={h}", importlib.import_module("pcops.ops.mesh.sample")._draw_kernel, (d, h)) for d in (F32, F64) for h in (False, True)],
]
# factories of Warp functions (and of the cell scan's launch type), compiled with the kernels that call them
FUNCTIONS_ONLY = {"pcops.ops.neighbours.nearest._kdtree._funcs", "pcops.ops.neighbours.nearest._kdtree.scan_row", "pcops.ops.neighbours._cells._scan_type", "pcops.ops.neighbours._cells._key_func", "pcops.ops.neighbours._cells._counting_sort_func", "pcops.ops.mesh._search._funcs",
                  "pcops.ops.mesh._search.walk_func", "pcops.ops.mesh._caps._check_func", "pcops.ops.mesh._caps._descent_func", "pcops.ops.mesh._crossings.reference_func", "pcops.ops.sampling.fps._native_lower",
                  "pcops.ops.neighbours.nearest._costs._native_block", "pcops.ops.neighbours.nearest._scan_rows.native_row", "pcops.ops.neighbours.nearest._scan_rows.native_leaf", "pcops.ops.neighbours.nearest._scan_rows.native_ball", "pcops.ops.neighbours.nearest._scan_rows.native_near", "pcops.ops.neighbours.nearest._scan_rows.point_blocks", "pcops.ops.neighbours.nearest._kdtree._split_func", "pcops.ops.neighbours.nearest._kdtree.chain_func"} | {
    f"pcops._warp_funcs.{name}" for name in ("bounds", "cell_range", "cell_scan", "_cells_struct", "by_coordinate", "cell_offset", "cells", "fill_row", "finite", "finite_bounds", "flag_not_finite", "heap_insert", "plane_normal", "sorted_insert", "widest_axis")}
# CPU-only kernels (native snippets calling the CPU's OpenMP runtime): never launched on a GPU
# GPUs: the torch form (_closed_torch; the winding op's shared walks by torch's cummax, not _follow_kernel); plain eager calls (knn_graph's and radius_graph's edge rows, knn_aggregate's weighted means) and
# the small trees kept per thread (their points' load), the batches' forests of kd-trees (their per-sample build) and the kept cell lists of small
# clouds (their one-thread build) are CPU calls; the feature-space kNN ranks its candidates in native vector code on the CPU (GPUs: torch's topk)
CPU_ONLY = {"pcops._warp._fork_kernel", "pcops.ops.mesh._search._closed_kernel", "pcops.ops.mesh._search._follow_kernel", "pcops.ops.neighbours.graph._rows_kernel",
            "pcops.ops.neighbours.nearest._mean._kernel", "pcops.ops.neighbours.nearest._kdtree._load_kernel",
            "pcops.ops.neighbours.nearest._kdtree._forest_kernel", "pcops.ops.neighbours._kept_cells._build_kernel",
            "pcops.ops.neighbours.nearest._features._kernel"}


def test_every_kernel_factory_of_pcops_is_compiled_here():
    import pcops  # noqa: F401  (imports every op module, so every factory is registered)

    listed = {f"{f.__module__}.{f.__qualname__}" for _, f, _ in FACTORIES}
    registered = {f"{f.__module__}.{f.__qualname__}" for f in _warp.FACTORIES if f.__module__.startswith("pcops.")}  # not tests' own
    assert registered - FUNCTIONS_ONLY - CPU_ONLY <= listed, f"add these kernel factories to FACTORIES: {sorted(registered - FUNCTIONS_ONLY - CPU_ONLY - listed)}"


def _kernels_of(result) -> list:
    items = result if isinstance(result, tuple) else (result,)
    return [k for k in items if isinstance(k, wp.Kernel)]


@pytest.fixture(scope="module")
def nvrtc(tmp_path_factory):
    _warp.init()

    @wp.kernel(enable_backward=False, module="unique")
    def probe(x: wp.array(dtype=float)):
        x[wp.tid()] = 1.0

    try:
        wp.compile_aot_module(probe.module, arch=90, module_dir=tmp_path_factory.mktemp("probe"), use_ptx=True)
    except Exception as err:  # no NVRTC in this Warp build
        pytest.skip(f"Warp cannot compile for a GPU here: {err}")
    return tmp_path_factory


@pytest.mark.parametrize("name,factory,args", FACTORIES, ids=[f[0] for f in FACTORIES])
def test_every_warp_kernel_compiles_for_a_gpu(nvrtc, name, factory, args):
    kernels = _kernels_of(factory(*args))
    assert kernels, f"{name}: the factory returned no kernel"
    out = nvrtc.mktemp("ptx")
    for kernel in kernels:
        paths = wp.compile_aot_module(kernel.module, arch=90, module_dir=out, use_ptx=True)
        ptx = [p for p in paths if str(p).endswith(".ptx")]
        assert ptx and all(p.stat().st_size > 0 for p in ptx), f"{name}: no PTX for {kernel.key}"
