"""Kernel launches per call do not grow with the work's size (#44, deliverable 2).

Counted on the CPU, where CI sees them: the Warp launches through pcops' launch helpers
(:func:`pcops._warp.launch`, :func:`~pcops._warp.launch_chunks`, and each run of a
:func:`~pcops._warp.recorded` launch), and the torch operations that run a kernel on a GPU (the
profiler's outermost aten events, allocations, views and no-op conversions left out). Every op of the table
(tests/op_table.py, its static-size form where it has one), with ``validate=False``, makes the
same launches at two sizes, except where :data:`GROWS` says, with the reason: an equality, not
a bound, so a launch loop removed must be removed from the table too and the table stays the
list of what is left to do.

The GPU's own paths run on the CPU where a switch allows it (the kd-tree built by sorting, the
mesh hierarchy's parents a launch per level, FPS a launch per pick): the ops they serve grow
there, each for the reason :data:`GROWS_ON_GPU` gives (what #44 leaves to do on a GPU).
"""

import collections
import inspect

import pytest
import torch

import pcops
from pcops import _warp
from pcops.ops.mesh import _tree
from pcops.ops.neighbours.nearest import _kdtree
from pcops.ops.sampling import fps
from tests import op_table

# op -> why its launches grow with the size on the CPU paths
GROWS: dict[str, str] = {}
# op -> why its launches grow on the GPU's paths (the CPU runs them with the switches below)
GROWS_ON_GPU = {
    "knn": "the kd-tree built by sorting: torch operations a depth at a time",
    "knn_aggregate": "the kd-tree built by sorting: torch operations a depth at a time",
    "knn_interpolate": "the kd-tree built by sorting: torch operations a depth at a time",
    "chamfer_distance": "the kd-tree built by sorting: torch operations a depth at a time",
    "knn_graph": "the kd-tree built by sorting: torch operations a depth at a time",
    "estimate_normals": "the kd-tree built by sorting: torch operations a depth at a time",
    "mesh_distance": "the hierarchy's parents: a launch per level",
    "mesh_bvh": "the hierarchy's parents: a launch per level",
    "point_mesh_face_distance": "the hierarchies' parents: a launch per level",
}
# two sizes, as multiples of each builder's default size (the quadratic and scipy ops: smaller)
SIZES = collections.defaultdict(lambda: (4, 16), sinkhorn_divergence=(1, 2), earth_movers_distance=(1, 2))
# aten events that launch nothing on a GPU: allocations, views, metadata and no-op conversions
NO_KERNEL = {"aten::" + name for name in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "as_strided", "view",
    "_reshape_alias", "alias", "detach", "detach_", "lift_fresh", "set_", "narrow", "slice", "select", "unsqueeze",
    "squeeze", "expand", "permute", "transpose", "t", "_unsafe_view", "unfold", "resolve_conj", "resolve_neg",
    "is_nonzero", "_local_scalar_dense", "item", "scalar_tensor", "to", "contiguous", "reshape", "flatten", "view_as",
    "expand_as", "unbind", "split", "chunk", "unflatten", "lift", "_has_compatible_shallow_copy_type")}


def launches(call) -> collections.Counter:
    """What ``call()`` launches: Warp kernels by name and kernel-running torch operations by name."""
    counts = collections.Counter()
    saved = {name: getattr(_warp, name) for name in ("launch", "launch_chunks", "recorded")}

    def counted(kernel, *args, **kwargs):
        counts["warp:" + getattr(kernel, "key", repr(kernel))] += 1
        return saved["launch"](kernel, *args, **kwargs)

    def counted_chunks(kernel, *args, **kwargs):
        counts["warp:" + getattr(kernel, "key", repr(kernel))] += 1
        return saved["launch_chunks"](kernel, *args, **kwargs)

    def counted_recorded(kernel, *args, **kwargs):
        run = saved["recorded"](kernel, *args, **kwargs)

        def again():
            counts["warp:" + getattr(kernel, "key", repr(kernel))] += 1
            run()
        return again

    _warp.launch, _warp.launch_chunks, _warp.recorded = counted, counted_chunks, counted_recorded
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
    finally:
        for name, f in saved.items():
            setattr(_warp, name, f)
    for event in prof.events():  # the outermost aten operations (how torch implements one inside may vary with the size)
        outermost = event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")
        if event.name.startswith("aten::") and outermost and event.name not in NO_KERNEL:
            counts[event.name] += 1
    return counts


def grown(op) -> dict:
    """{launch: (count at the smaller size, at the larger)} of those that differ."""
    kw = {"validate": False} if op.validates else {}
    call = op.static or op.call
    params = inspect.signature(op.make).parameters
    counts = []
    for times in SIZES[op.name]:
        mesh = {"faces": times * params["faces"].default} if "faces" in params else {}  # the mesh grows too
        inputs = op.inputs(n=times * params["n"].default, **mesh)
        call(inputs, **kw)  # first calls build kernels and caches
        counts.append(launches(lambda: call(inputs, **kw)))
    small, large = counts
    return {k: (small[k], large[k]) for k in small.keys() | large.keys() if small[k] != large[k]}


@pytest.fixture(autouse=True)
def threaded(monkeypatch):
    """Every launch as a large one (split across threads): a small launch's serial form is
    another path (the kd-tree's build then takes one launch instead of a few), not growth."""
    monkeypatch.setattr(_warp, "SERIAL_WORK", 0)


@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_launches_do_not_grow_with_the_size(op):
    diff = grown(op)
    assert bool(diff) == (op.name in GROWS), (f"{op.name}: launches {diff} grow with the size" if diff else
                                               f"{op.name} no longer grows: remove it from GROWS")


@pytest.fixture
def gpu_paths(monkeypatch):
    monkeypatch.setattr(_kdtree, "_BUILD_BY_SORTING", True)
    monkeypatch.setattr(_tree, "PER_LEVEL", [True])
    monkeypatch.setattr(fps, "_per_pick", lambda device: True)


@pytest.mark.parametrize("op", [op for op in op_table.OPS if op.name in GROWS_ON_GPU], ids=lambda op: op.name)
def test_the_gpu_paths_launches_grow_only_where_the_table_says(op, gpu_paths):
    diff = grown(op)
    assert bool(diff) == (op.name in GROWS or op.name in GROWS_ON_GPU), (
        f"{op.name}: launches {diff} grow with the size on the GPU's paths" if diff else
        f"{op.name} no longer grows on the GPU's paths: remove it from GROWS_ON_GPU")


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_path", "gpu_path"])
def test_fps_launches_grow_with_the_picks_only_on_the_gpu_path(gpu, monkeypatch):
    monkeypatch.setattr(fps, "_per_pick", lambda device: gpu)
    points = torch.rand(2, 500, 3, generator=torch.Generator().manual_seed(0))
    counts = []
    for picks in (8, 32):
        pcops.farthest_point_sample(points, picks, validate=False)
        counts.append(launches(lambda: pcops.farthest_point_sample(points, picks, validate=False)))
    grew = {k: (counts[0][k], counts[1][k]) for k in counts[0].keys() | counts[1].keys() if counts[0][k] != counts[1][k]}
    if gpu:  # a launch of the step kernel per pick after the first (#44: a multi-block kernel is left to do)
        assert grew["warp:" + fps._kernels(torch.float32)[1].key] == (7, 31)
    else:
        assert grew == {}


def test_the_counter_sees_launches_inside_custom_ops_and_loops():
    """A loop of torch operations in a custom op's implementation counts once per turn."""

    @torch.library.custom_op("pcops_test::loops", mutates_args=())
    def loops(x: torch.Tensor) -> torch.Tensor:
        for _ in range(x.shape[0]):
            x = x + 1
        return x

    assert launches(lambda: loops(torch.ones(3)))["aten::add"] == 3
    assert launches(lambda: loops(torch.ones(5)))["aten::add"] == 5
