"""Kernel launches per call do not grow with the work's size (#44, deliverable 2).

Counted on the CPU, where CI sees them: the Warp launches through pcops' launch helpers
(:func:`pcops._warp.launch`, :func:`~pcops._warp.launch_chunks`, and each run of a
:func:`~pcops._warp.recorded` launch), and the torch operations that run a kernel on a GPU (the
profiler's outermost aten events; allocations, views and conversions that copied nothing left
out). Every op of the table (tests/op_table.py), with ``validate=False``, makes the same
launches at two sizes, in its static-size form, its data-dependent one where it has both, and
with gradients (the backward pass included), except where :data:`GROWS` says, with the reason:
an equality, not a bound, so a launch loop removed must be removed from the table too and the
table stays the list of what is left to do. (One sample at both sizes: a loop over samples is
not seen here.)

The GPU's own paths run on the CPU where a switch allows it (the kd-tree over a Morton order, the
mesh hierarchy's parents a launch per level, FPS a launch per pick): the ops they serve grow
there in exactly the launches :data:`GROWS_ON_GPU` lists, for its reason (what #44 leaves to do
on a GPU).
"""

import collections
import inspect

import pytest
import torch

import pcops
from pcops import _warp
from pcops.ops.mesh import _kept_tree, _tree
from pcops.ops.neighbours import _ball_tree
from pcops.ops.neighbours.nearest import _kdtree
from pcops.ops.sampling import fps
from tests import op_table

# op -> why its launches grow with the size on the CPU paths
GROWS: dict[str, str] = {}
_PARENTS = {"warp:" + _tree._parents_kernel().key}
# op -> (why its launches grow on the GPU's paths (the CPU runs them with the switches below),
#        the launches that grow, exactly)
GROWS_ON_GPU = {
    **{op: ("the hierarchy's parents: a launch per level", _PARENTS) for op in ("mesh_distance", "mesh_bvh", "point_mesh_face_distance")},
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

    inside = []  # a launch running: its kept launch (``kept=True``) is that one launch

    def counted(kernel, *args, **kwargs):
        counts["warp:" + getattr(kernel, "key", repr(kernel))] += 1
        inside.append(kernel)
        try:
            return saved["launch"](kernel, *args, **kwargs)
        finally:
            inside.pop()

    def counted_chunks(kernel, *args, **kwargs):
        counts["warp:" + getattr(kernel, "key", repr(kernel))] += 1
        return saved["launch_chunks"](kernel, *args, **kwargs)

    def counted_recorded(kernel, *args, **kwargs):
        run = saved["recorded"](kernel, *args, **kwargs)

        def again():
            counts["warp:" + getattr(kernel, "key", repr(kernel))] += 1
            run()
        return again

    prepared_run = _warp.Prepared.run_at

    def counted_prepared(self, *args):
        if not inside or inside[-1] is not self.kernel:
            counts["warp:" + self.kernel.key] += 1
        return prepared_run(self, *args)

    _warp.launch, _warp.launch_chunks, _warp.recorded = counted, counted_chunks, counted_recorded
    _warp.Prepared.run_at = counted_prepared
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
    finally:
        for name, f in saved.items():
            setattr(_warp, name, f)
        _warp.Prepared.run_at = prepared_run
    for event in prof.events():  # the outermost aten operations (how torch runs one inside may vary with the size)
        if not event.name.startswith("aten::") or (event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::")):
            continue
        ran = any(c.name.startswith("aten::") and c.name not in NO_KERNEL for c in event.cpu_children)
        if event.name not in NO_KERNEL or ran:  # (a conversion, reshape or contiguous counts where it copied)
            counts[event.name] += 1
    return counts


def grown(op, form: str = "static") -> dict:
    """{launch: (count at the smaller size, at the larger)} of those that differ. ``form``:
    "static" (the static-size form where the op has one), "dynamic" (its data-dependent one),
    "backward" (with gradients to its differentiable inputs, the backward pass included)."""
    kw = {"validate": False} if op.validates else {}
    call = op.call if form == "dynamic" or op.static is None else op.static
    params = inspect.signature(op.make).parameters
    counts = []
    for times in SIZES[op.name]:
        mesh = {"faces": times * params["faces"].default} if "faces" in params else {}  # the mesh grows too
        inputs = op.inputs(n=times * params["n"].default, **mesh)

        def run():
            if form != "backward":
                return call(inputs, **kw)
            given = {k: v.detach().requires_grad_() if k in op.grad else v for k, v in inputs.items()}
            out = call(given, **kw)
            outs = [t for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t) and t.requires_grad]
            sum(torch.where(torch.isfinite(t), t, 0).sum() for t in outs).backward()

        # first calls build kernels and caches, under the profiler as the counted call runs (plain
        # eager calls, outside it, take their own paths)
        launches(run)
        counts.append(launches(run))
    small, large = counts
    return {k: (small[k], large[k]) for k in small.keys() | large.keys() if small[k] != large[k]}


@pytest.fixture(autouse=True)
def threaded(monkeypatch):
    """Every launch as a large one (split across threads): a small launch's serial form is
    another path (the kd-tree's build then takes one launch instead of a few), not growth; so is
    a kept kd-tree or mesh build (their tensors allocated as they keep them), which the larger
    sizes here are past: every size builds from scratch."""
    monkeypatch.setattr(_warp, "SERIAL_WORK", 0)
    monkeypatch.setattr(_tree, "SPLIT_WORK", 0)
    monkeypatch.setattr(_kdtree, "_KEPT_POINTS", 0)
    monkeypatch.setattr(_kept_tree, "KEEP_FACES", 0)


@pytest.fixture(autouse=True)
def one_ball_path(monkeypatch):
    """The ball searches on their cell lists at both sizes: a fixed radius's balls hold four times
    the points at the larger size, where crowded ones take the kd-tree (``_ball_tree``), another
    path, not growth (:func:`test_crowded_balls_launches_do_not_grow_with_the_size` counts it)."""
    monkeypatch.setattr(_ball_tree, "crowded", lambda *args: False)


BALLS = [op for op in op_table.OPS if op.name in ("ball_query", "ball_queries", "radius_graph")]


@pytest.mark.parametrize("op", BALLS, ids=lambda op: op.name)
def test_crowded_balls_launches_do_not_grow_with_the_size(op, monkeypatch):
    """The ball searches with every radius on the kd-tree (``_ball_tree``), at both sizes."""
    monkeypatch.setattr(_ball_tree, "crowded", lambda *args: True)
    assert grown(op) == {} and (not op.grad or grown(op, "backward") == {})


FORMS = [(op, "static") for op in op_table.OPS] + [(op, "dynamic") for op in op_table.OPS if op.static is not None] + [
    (op, "backward") for op in op_table.OPS if op.grad]


@pytest.mark.parametrize("op, form", FORMS, ids=lambda x: x if isinstance(x, str) else x.name)
def test_launches_do_not_grow_with_the_size(op, form):
    diff = grown(op, form)
    assert bool(diff) == (op.name in GROWS), (f"{op.name} ({form}): launches {diff} grow with the size" if diff else
                                               f"{op.name} no longer grows: remove it from GROWS")


@pytest.fixture
def gpu_paths(monkeypatch):
    monkeypatch.setattr(_kdtree, "_GPU_BUILD", True)
    monkeypatch.setattr(_tree, "PER_LEVEL", [True])
    monkeypatch.setattr(_tree.nearest, "split_order", lambda points, group, *rest: _tree.morton_order(points, group))  # (GPUs' faces)
    monkeypatch.setattr(fps, "_per_pick", lambda device: True)
    monkeypatch.setattr(_ball_tree, "crowded", lambda *args: False)  # (GPUs keep the ball searches' cell lists)


@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_the_gpu_paths_launches_grow_only_where_the_table_says(op, gpu_paths):
    diff = grown(op)
    assert set(diff) == GROWS_ON_GPU.get(op.name, ("", set()))[1], (
        f"{op.name}: launches {diff} grow with the size on the GPU's paths; the table says "
        f"{sorted(GROWS_ON_GPU.get(op.name, ('', set()))[1])} ({GROWS_ON_GPU.get(op.name, ('none',))[0]})")


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
        assert grew["warp:" + fps._kernels(torch.float32, fps.PLAIN_PAIRS)[1].key] == (7, 31)
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
