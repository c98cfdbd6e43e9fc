"""Host reads of pcops' ops called with ``validate=False``: every read of a tensor's values into
Python (``item``, ``tolist``, ``numpy``, ``bool`` / ``int`` / ``float`` / ``index`` of a tensor),
inside the custom ops as well, counted where pcops' code makes it. On CUDA each is a device
sync; on the CPU this test sees them all the same, so a new host read fails CI here.

Every op of the table (tests/op_table.py, its static-size form where it has one) reads exactly
what :data:`KNOWN` says, with the reason (and, for the plain CPU calls that skip the custom op,
:data:`CPU_PLAIN`); an op not listed reads nothing. A read removed must
be removed from the table too (an equality, not a bound), so the table stays the list of what
is left to do. (Syncs inside torch's own ops, such as ``nonzero``, are not Python reads and are
not seen here; ``torch.cuda.set_sync_debug_mode("error")`` on a GPU sees those.)
"""

import collections
import contextlib
import importlib
import traceback

import pytest
import torch

import pcops
from tests import op_table

# op -> {(the read, where pcops makes it): count}, and why it is there
KNOWN = {
    "radius_aggregate": ({("tolist", "pcops/ops/neighbours/_cells.py")}, "the cell list's grid from the clouds' box"),
    "radius_graph": ({("tolist", "pcops/ops/neighbours/_cells.py"), ("__int__", "pcops/ops/neighbours/graph.py")},
                     "the cell list's grid; the edge count of the padded form"),
    "mesh_bvh": ({("item", "pcops/_validate.py")}, "the table's call validates the query points of mesh_distance"),
    "sinkhorn_divergence": ({("tolist", "pcops/ops/transport/sinkhorn.py")}, "the temperature schedule from each sample's diameter"),
    "earth_movers_distance": ({("numpy", "pcops/ops/transport/emd.py")}, "the exact assignment runs in scipy on the CPU"),
    "voxel_pool": ({("tolist", "pcops/ops/sampling/_voxels.py")}, "the voxel keys' span from the points' box"),
    "grid_sample": ({("tolist", "pcops/ops/sampling/_voxels.py")}, "the voxel keys' span from the points' box"),
    "sparse_conv3d": ({("tolist", "pcops/ops/sparse/sparse_conv.py")}, "the kernel map's key span and pair counts"),
    "sparse_kernel_map": ({("tolist", "pcops/ops/sparse/sparse_conv.py")}, "the kernel map's key span and pair counts"),
    "serialized_pool": ({("__bool__", "pcops/_validate.py"), ("__int__", "pcops/ops/sparse/serialize.py")},
                        "the padded form's cluster count"),
}
# op -> the reads of its plain eager call, which runs on CPU tensors only (a CUDA call takes the
# general path, which reads nothing of these), and why
CPU_PLAIN = {
    "knn_aggregate": ({("__int__", "pcops/ops/neighbours/nearest/__init__.py")}, "whether every row of the search is complete (complete_rows)"),
    "estimate_normals": ({("__float__", "pcops/ops/geometry/normals.py")}, "the largest absolute coordinate: the values check and whether the scale asks for a power of two (_plain_scale)"),
    "knn_interpolate": ({("item", "pcops/ops/neighbours/nearest/_mean.py")}, "whether every row of the search is complete (the weighted means' launch flags a row cut short)"),
}
# op -> why it synchronises on a GPU with no host read of pcops' own (a torch operation that waits)
CUDA_ONLY = {"marching_cubes": "nonzero: the cells the surface crosses, the padded form's too"}
READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def counted(reads: list):
    """Record (read, pcops file) for every host read of a tensor while inside."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, method):
        def read(self, *args, **kwargs):
            frames = traceback.extract_stack(limit=8)[:-1]
            where = next((f.filename for f in reversed(frames) if "/pcops/" in f.filename.replace("\\", "/")), "outside pcops")
            reads.append((name, "pcops/" + where.replace("\\", "/").split("/pcops/", 1)[1] if "/pcops/" in where else where))
            return method(self, *args, **kwargs)
        return read

    for name, method in saved.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_ops_read_the_host_only_where_the_table_says(op, monkeypatch):
    # radius_aggregate's small CPU clouds skip the cell list (no read): its GPU path is the list's
    monkeypatch.setattr(importlib.import_module("pcops.ops.neighbours.radius"), "SCAN_PAIRS", 0)
    inputs = op.inputs()
    kw = {"validate": False} if op.validates else {}
    call = op.static or op.call
    call(inputs, **kw)  # first calls build kernels and caches
    reads = []
    with counted(reads):
        call(inputs, **kw)
    known, why = KNOWN.get(op.name, (set(), ""))
    plain, plain_why = CPU_PLAIN.get(op.name, (set(), ""))
    known, why = known | plain, "; ".join(w for w in (why, plain_why) if w)
    assert set(reads) == known, (f"{op.name} reads the host at {collections.Counter(reads)}; "
                                 f"known: {sorted(known)} ({why or 'none'})")


def first_sync(op) -> str | None:
    """The message of the first synchronising CUDA operation of the op table row ``op``, called
    on CUDA inputs with ``validate=False`` after a first call (kernels loaded), or None when the
    call made none (``torch.cuda.set_sync_debug_mode("error")``: host reads and torch's own
    synchronising operations alike). scripts/gpu_check.py reports it for every op."""
    inputs = {name: t.cuda() if torch.is_tensor(t) else t for name, t in op.inputs().items()}
    kw = {"validate": False} if op.validates else {}
    call = op.static or op.call
    call(inputs, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(inputs, **kw)
    except RuntimeError as err:
        if "synchroniz" not in str(err):
            raise
        return str(err).strip().splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


@pytest.mark.cuda
@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_cuda_ops_synchronise_only_where_the_table_says(op):
    """On a GPU the same calls synchronise exactly where :data:`KNOWN` lists a host read, or
    :data:`CUDA_ONLY` a torch operation that waits for the device."""
    message = first_sync(op)
    expected = op.name in KNOWN or op.name in CUDA_ONLY
    assert (message is not None) == expected, f"{op.name}: {message or 'no synchronisation'}; expected: {expected}"


def test_the_counter_sees_a_read_inside_a_custom_op():
    """The counting reaches into custom ops' real implementations (where the reads sit)."""

    @torch.library.custom_op("pcops_test::reads_once", mutates_args=())
    def reads_once(x: torch.Tensor) -> torch.Tensor:
        return x * int(x.sum() > 0)

    reads = []
    with counted(reads):
        reads_once(torch.ones(3))
    assert [name for name, _ in reads] == ["__int__"] or [name for name, _ in reads] == ["__bool__", "__int__"]


@pytest.mark.parametrize("grad", [False, True], ids=["plain", "op"])
def test_small_cpu_radius_aggregates_read_nothing(grad):
    """Below the crossover a CPU radius_aggregate visits every pair: no cell list, so no read of
    the clouds' box, called directly or through the op (a gradient to record). (Its backward
    reads the grid's shape from a CPU tensor the op returned: no device's.)"""
    q, p, f = torch.rand(20, 3), torch.rand(30, 3), torch.rand(30, 4, requires_grad=grad)
    pcops.radius_aggregate(q, p, f, 0.3, 0.1, validate=False)
    reads = []
    with counted(reads):
        pcops.radius_aggregate(q, p, f, 0.3, 0.1, validate=False)
    assert reads == []
