"""pcops/_warp.py: stream binding, build lock, fork safety, kernel cache identity, quiet init.

The CUDA stream logic is tested on the CPU with stand-ins for torch's and Warp's stream objects;
the same behaviour on a real GPU is in the `cuda`-marked tests at the end.
"""

import importlib
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import warp as wp

import pcops
from pcops import _threads, _warp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter with this checkout's pcops; a hang fails instead of stalling."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=timeout, env=environ
    )


# ---------------------------------------------------------------------------------------------
# One wp.Stream per torch stream, passed explicitly to launches (CPU stand-ins for CUDA objects)


class _FakeTorchStream:
    def __init__(self, handle: int, index: int = 0):
        self.cuda_stream, self.device_index = handle, index


class _FakeWarpStream:
    def __init__(self, torch_stream, blocking: bool):
        self.torch_stream, self.is_blocking, self.device = torch_stream, blocking, "cuda:0"


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch's current stream is whatever ``state['current']`` is; wp.stream_from_torch is recorded."""
    state = {"current": _FakeTorchStream(0), "wrapped": [], "launches": []}

    def stream_from_torch(s):
        state["wrapped"].append(s)
        return _FakeWarpStream(s, blocking=s.cuda_stream == 0)

    def launch(kernel, dim, inputs, device, stream=None):
        state["launches"].append(stream)

    def scoped_stream(*args, **kwargs):
        raise AssertionError("launch() must not open a ScopedStream")

    monkeypatch.setattr(_warp, "_streams", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(wp, "stream_from_torch", stream_from_torch)
    monkeypatch.setattr(wp, "launch", launch)
    monkeypatch.setattr(wp, "ScopedStream", scoped_stream)
    monkeypatch.setattr(_warp, "device", lambda t: "cuda:0")
    return state


_ON_CUDA = types.SimpleNamespace(device=torch.device("cuda", 0))  # stands for a CUDA tensor


def test_one_cached_warp_stream_per_torch_stream(fake_cuda):
    first = _warp.cuda_stream(_ON_CUDA)
    assert _warp.cuda_stream(_ON_CUDA) is first  # the same torch stream: the same object, wrapped once
    fake_cuda["current"] = _FakeTorchStream(1234)
    side = _warp.cuda_stream(_ON_CUDA)
    assert side is not first and side.torch_stream.cuda_stream == 1234
    fake_cuda["current"] = _FakeTorchStream(0)
    assert _warp.cuda_stream(_ON_CUDA) is first  # back on the default stream: still the first wrapper
    fake_cuda["current"] = _FakeTorchStream(0, index=1)
    assert _warp.cuda_stream(_ON_CUDA) is not first  # another device's stream has its own wrapper
    assert len(fake_cuda["wrapped"]) == 3
    assert _warp.cuda_stream(types.SimpleNamespace(device=torch.device("cpu"))) is None


def test_launches_receive_the_cached_stream_explicitly(fake_cuda):
    kernel = object()
    for handle in (0, 77, 0, 77):
        fake_cuda["current"] = _FakeTorchStream(handle)
        _warp.launch(kernel, 10, [1.0, 2], like=_ON_CUDA)
    streams = fake_cuda["launches"]
    assert len(streams) == 4 and all(isinstance(s, _FakeWarpStream) for s in streams)
    assert streams[0] is streams[2] and streams[1] is streams[3] and streams[0] is not streams[1]
    assert [s.torch_stream.cuda_stream for s in streams] == [0, 77, 0, 77]


def test_ops_enter_no_stream_scope_of_their_own(fake_cuda):
    # the stand-in ScopedStream raises: the old per-op scope (_warp.stream, gone) changed Warp's
    # process-wide current stream and default device outside any lock; launches pass stream= instead
    _warp.launch(object(), 10, [1.0], like=_ON_CUDA)
    assert fake_cuda["launches"] == [_warp.cuda_stream(_ON_CUDA)]
    assert not hasattr(_warp, "stream")


# ---------------------------------------------------------------------------------------------
# Host reads of the radius ops' cell list, counted on the CPU (each is a sync on a GPU)


def test_radius_forward_and_backward_build_one_cell_list(monkeypatch):
    cells = importlib.import_module("pcops.ops.neighbours._cells")
    built, init = [], cells.CellList.__init__

    def counting(self, *args):
        built.append(1)
        init(self, *args)

    monkeypatch.setattr(cells.CellList, "__init__", counting)
    monkeypatch.setattr(importlib.import_module("pcops.ops.neighbours.radius"), "SCAN_PAIRS", 0)  # (a cell list at any size)
    gen = torch.Generator().manual_seed(0)
    q, p = torch.rand(200, 3, generator=gen), torch.rand(300, 3, generator=gen)
    f, sigma = torch.rand(300, 4, generator=gen).requires_grad_(), torch.tensor(0.1, requires_grad=True)
    pcops.radius_aggregate(q, p.requires_grad_(), f, 0.2, sigma).sum().backward()
    assert len(built) == 1 and f.grad is not None and p.grad is not None and sigma.grad is not None


def test_a_cell_list_reads_the_host_once_and_copies_nothing_to_the_device(monkeypatch):
    cells = importlib.import_module("pcops.ops.neighbours._cells")
    reads, to_device = [], []
    cpu, tensor = torch.Tensor.cpu, torch.tensor

    def counting_cpu(self, *args, **kwargs):
        reads.append(1)
        return cpu(self, *args, **kwargs)

    def recording_tensor(data, *args, **kwargs):
        if kwargs.get("device") is not None:
            to_device.append(data)  # torch.tensor(list, device=cuda) is a blocking copy from the host
        return tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    monkeypatch.setattr(torch, "tensor", recording_tensor)
    gen = torch.Generator().manual_seed(1)
    q, p = torch.rand(200, 3, generator=gen), torch.rand(300, 3, generator=gen)
    qg, pg = torch.arange(200) % 3, torch.arange(300) % 3
    for groups in ((None, None), (qg, pg)):
        reads.clear()
        order, keys, rows, frame, shape, starts = cells.CellList(q, p, 0.2, *groups).tensors()
        assert len(reads) == 1 and not to_device
        assert shape.device.type == "cpu" and frame.shape == (6,)  # the grid's size on the host, its frame with the points


# ---------------------------------------------------------------------------------------------
# CUDA-graph safety tags

# pcops ops that CUDA graphs may capture: pure torch, no host sync, nothing allocated outside torch
_CAPTURABLE: set[str] = set()


def test_every_pcops_op_is_tagged_cudagraph_unsafe():
    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("pcops::"))
    assert {"radius_aggregate", "radius_aggregate_backward", "knn_warp", "knn_cuml", "knn_torch", "knn_scipy"} <= set(names)
    untagged = [
        name for name in names
        if name not in _CAPTURABLE and torch.Tag.cudagraph_unsafe not in getattr(torch.ops.pcops, name).default.tags
    ]
    assert not untagged, f"Warp/cuML/syncing ops without tags=(torch.Tag.cudagraph_unsafe,): {untagged}"


# ---------------------------------------------------------------------------------------------
# Build lock, fork safety, kernel cache identity, cache errors, quiet CPU import


_THREADS = """
    import threading, torch, pcops
    from tests import reference
    torch.set_num_threads(1)
    cases = [(dtype, grouped, op) for dtype in (torch.float32, torch.float64) for grouped in (False, True)
             for op in ("radius", "knn")]
    gen = torch.Generator().manual_seed(0)
    q, p, f = torch.rand(50, 3, generator=gen), torch.rand(80, 3, generator=gen), torch.rand(80, 2, generator=gen)
    qb, pb = (torch.arange(50) % 2), (torch.arange(80) % 2)

    def call(dtype, grouped, op):
        batch = dict(query_batch=qb, ref_batch=pb) if grouped else {}
        x = [t.to(dtype, copy=True).requires_grad_() for t in (q, p, f)]
        if op == "radius":
            out = pcops.radius_aggregate(*x, 0.3, 0.1, **batch)
        else:
            out = pcops.knn_aggregate(*x, 3, 0.1, backend="warp", **batch)
        out.sum().backward()
        return [out.detach()] + [t.grad for t in x]

    barrier, results, errors = threading.Barrier(len(cases)), {}, []

    def worker(case):
        try:
            barrier.wait()
            results[case] = call(*case)
        except BaseException as err:  # noqa: BLE001
            errors.append(repr(err))

    threads = [threading.Thread(target=worker, args=(c,)) for c in cases]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    for case in cases:  # the same calls again, one at a time
        for a, b in zip(results[case], call(*case)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    print("ok", len(results))
"""


@pytest.mark.parametrize("cache", [pytest.param("cold", marks=pytest.mark.slow), "warm", "warm-again"])
def test_concurrent_first_calls_from_eight_threads(cache, tmp_path):
    # 8 threads: float32/float64 x grouped/ungrouped x radius/kNN, released together in a fresh process.
    # Cold: a fresh kernel cache (every kernel compiled during the race; slow). Warm: loads only.
    env = {"WARP_CACHE_PATH": str(tmp_path)} if cache == "cold" else {}
    result = _run(_THREADS, timeout=600, **env)
    assert result.returncode == 0 and "ok 8" in result.stdout, result.stderr[-3000:]


_FORK = """
    import multiprocessing as mp, sys, time, torch, pcops
    threads = sys.argv[1]
    if threads == "pool":  # as where torch has no GNU OpenMP: the Python pool runs the chunks
        pcops._warp._openmp_state[:] = [None]
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    q, p, f = torch.rand(4096, 3, generator=gen), torch.rand(3000, 3, generator=gen), torch.rand(3000, 2, generator=gen)
    for _ in range(2):  # >= 2048 queries on 2 threads, after the first (build) launch: the threads exist now
        expected = pcops.radius_aggregate(q, p, f, 0.05, 0.1)
    edges = pcops.radius_graph(p, 0.05)  # the cell list's two-pass kernel, no cap
    small = p[:1000]
    for _ in range(3):  # past the every-pair scan: a kept cell list, made on the second call and run by the third
        balls = pcops.ball_query(small, small, 0.08, 16)
    assert bool(pcops._warp._pool_state) == (threads == "pool")
    time.sleep(0.5)  # the threads are idle when the workers fork (as between epochs)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            # The pool the child inherited has no threads: a stale one never runs this job.
            assert pcops._warp._pool().submit(lambda: 7).result(timeout=60) == 7
            # Nor does the parent's OpenMP team: the child's chunks go to the pool.
            assert pcops._warp._openmp() is None
            torch.set_num_threads(2)  # pcops' chunks on two threads (its torch ops here are too small to go parallel)
            return pcops.radius_aggregate(q, p, f, 0.05, 0.1), pcops.radius_graph(p, 0.05), pcops.ball_query(small, small, 0.08, 16)

    # Workers keep torch's one thread in a forked child: torch's own OpenMP parallel regions are
    # not fork-safe (a plain torch op with 2 threads hangs there too, pcops or not).
    loader = torch.utils.data.DataLoader(
        Data(), batch_size=1, num_workers=2, multiprocessing_context=mp.get_context("fork"),
    )
    for batch in loader:
        torch.testing.assert_close(batch[0][0], expected, rtol=0, atol=0)
        assert torch.equal(batch[1][0], edges)
        assert all(torch.equal(a[0], b) for a, b in zip(batch[2], balls))
    print("ok")
"""


@pytest.mark.parametrize("threads", ["openmp", "pool"])
def test_forked_dataloader_workers_run_large_calls(threads):
    if threads == "openmp" and _warp._openmp() is None:
        pytest.skip("torch does not run on GNU OpenMP here")
    try:
        result = _run(_FORK.replace("sys.argv[1]", repr(threads)), timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a forked DataLoader worker hung on a pcops call after the parent had used its CPU threads")
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# CPU chunks: on torch's OpenMP team where there is one, else on the pool


@pytest.fixture(params=["openmp", "pool"])
def chunk_threads(request, monkeypatch):
    if request.param == "openmp" and _warp._openmp() is None:
        pytest.skip("torch does not run on GNU OpenMP here")
    if request.param == "pool":
        monkeypatch.setattr(_warp, "_openmp_state", [None])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # two threads even on a one-core runner
    monkeypatch.setattr(_threads, "available", lambda: 2)  # and on a busy one
    return request.param


def test_chunks_run_once_each_on_several_threads(chunk_threads):
    import threading
    import time

    ran, threads = [], set()

    def run(c):
        time.sleep(0.01)  # long enough for the second thread to take chunks too
        ran.append(c)
        threads.add(threading.get_ident())

    _warp.run_chunks(run, 1, 9)
    assert sorted(ran) == list(range(1, 9))
    assert len(threads) == 2


def test_an_error_in_a_chunk_is_raised_on_the_calling_thread(chunk_threads):
    def run(c):
        if c == 3:
            raise ValueError("chunk 3")

    with pytest.raises(ValueError, match="chunk 3"):
        _warp.run_chunks(run, 0, 8)


@_warp.kernels
def _affine_kernel():
    @wp.kernel(enable_backward=False, module="unique")
    def affine(start: int, x: wp.array(dtype=wp.vec3f), a: float, shift: wp.vec3f, k: int,
               out: wp.array(dtype=wp.vec3f), total: wp.array(dtype=float)):
        i = wp.tid() + start
        y = a * x[i] + shift + wp.vec3f(float(k), 0.0, 0.0)
        out[i] = y
        wp.atomic_add(total, 0, y[0])

    return affine


def _affine(x, scatter=True):
    out, total = torch.empty_like(x), torch.zeros(1)
    args = [_warp.array(x, dtype=wp.vec3f), 0.5, wp.vec3f(1.0, 2.0, 3.0), 7, _warp.array(out, dtype=wp.vec3f), total]
    _warp.launch(_affine_kernel(), x.shape[0], args, like=x, scatter=(5,) if scatter else (), min_chunk=1)
    return out, total


def test_cpu_launches_call_the_kernels_entry_point_as_wp_launch_would(chunk_threads, monkeypatch):
    # after its first launch, a kernel's CPU chunks call its native entry point with arguments
    # packed on the calling thread (scalars, Warp vectors, arrays, private scatter copies); the
    # results are those of launches through wp.launch
    x = torch.rand(1001, 3, generator=torch.Generator().manual_seed(0))
    expected = 0.5 * x + torch.tensor([8.0, 2.0, 3.0])
    for _ in range(2):  # the first launch loads the module (wp.launch), the second is native
        out, total = _affine(x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(total, expected[:, :1].sum(0))
    assert _warp._natives[_affine_kernel()] is not None
    monkeypatch.setitem(_warp._natives, _affine_kernel(), None)  # wp.launch only
    out_wp, total_wp = _affine(x)
    torch.testing.assert_close(out_wp, out, rtol=0, atol=0)
    torch.testing.assert_close(total_wp, total)


def test_a_launch_beside_another_runs_once_with_its_own_arguments(chunk_threads):
    # ``beside``: a one-thread launch of another kernel (here the same one on other arrays) run
    # as one more chunk of the launch, e.g. by a thread the launch's own chunks leave idle
    x, y = torch.rand(2, 1001, 3, generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # first loads, then native calls
        out, total = torch.empty_like(x), torch.zeros(1)
        other, other_total = torch.full_like(y, -1.0), torch.zeros(1)
        shift = wp.vec3f(1.0, 2.0, 3.0)
        args = [_warp.array(x, dtype=wp.vec3f), 0.5, shift, 7, _warp.array(out, dtype=wp.vec3f), total]
        beside = [_warp.array(y, dtype=wp.vec3f), 2.0, shift, 0, _warp.array(other, dtype=wp.vec3f), other_total]
        _warp.launch(_affine_kernel(), 1001, args, like=x, min_chunk=1, beside=(_affine_kernel(), beside))
        torch.testing.assert_close(out, 0.5 * x + torch.tensor([8.0, 2.0, 3.0]))
        torch.testing.assert_close(other[0], 2.0 * y[0] + torch.tensor([1.0, 2.0, 3.0]))
        assert bool((other[1:] == -1.0).all())  # one thread: element 0 only
        torch.testing.assert_close(other_total, other[:1, 0])


@pytest.mark.parametrize("side_threads", [None, 3, 0])
def test_a_small_launch_runs_the_one_beside_it_on_the_calling_thread(chunk_threads, side_threads, monkeypatch):
    # below SERIAL_WORK (``work``) both kernels, once loaded, run directly one after the other:
    # the launch's threads, then beside's (its thread count, 1 when not given, none when 0)
    x, y = torch.rand(2, 50, 3, generator=torch.Generator().manual_seed(3))
    for turn in range(3):  # first loads, then the direct calls (no packed chunks)
        if turn == 1:
            monkeypatch.setattr(_warp, "_runner", lambda *a, **k: pytest.fail("packed chunks for a small launch"))
        out, total = torch.empty_like(x), torch.zeros(1)
        other, other_total = torch.full_like(y, -1.0), torch.zeros(1)
        shift = wp.vec3f(1.0, 2.0, 3.0)
        args = [_warp.array(x, dtype=wp.vec3f), 0.5, shift, 7, _warp.array(out, dtype=wp.vec3f), total]
        side = [_warp.array(y, dtype=wp.vec3f), 2.0, shift, 0, _warp.array(other, dtype=wp.vec3f), other_total]
        beside = (_affine_kernel(), side) if side_threads is None else (_affine_kernel(), side, side_threads)
        _warp.launch(_affine_kernel(), 50, args, like=x, min_chunk=1, beside=beside, work=100)
        torch.testing.assert_close(out, 0.5 * x + torch.tensor([8.0, 2.0, 3.0]))
        ran = 1 if side_threads is None else side_threads
        torch.testing.assert_close(other[:ran], 2.0 * y[:ran] + torch.tensor([1.0, 2.0, 3.0]))
        assert bool((other[ran:] == -1.0).all())
        torch.testing.assert_close(other_total, other[:ran, 0].sum(0, keepdim=True))


@_warp.kernels
def _count_kernel():
    @wp.kernel(enable_backward=False, module="unique")
    def count(start: int, out: wp.array(dtype=wp.int32), first: wp.array(dtype=wp.int32)):
        i = wp.tid() + start
        out[i] = out[i] + 1
        first[i] = start  # the first thread of the chunk that ran i

    return count


@pytest.mark.parametrize("native", [True, False])
def test_every_chunk_runs_once_in_the_native_fork_join_and_the_python_one(chunk_threads, native, monkeypatch):
    # chunks of uneven sizes, more than threads: each chunk is taken by one thread once, through
    # the OpenMP team in native code (``_fork``) or through Python callbacks; the same writes
    monkeypatch.setattr(_warp, "NATIVE_FORK", [native])
    forks = []
    fork = _warp._fork
    monkeypatch.setattr(_warp, "_fork", lambda run, first, chunks, workers: forks.append((chunks - first, workers)) or fork(run, first, chunks, workers))
    bounds = [0, 1, 2, 40, 41, 300, 301, 302, 900, 1001]
    for launch in range(3):  # the first loads the module on the calling thread
        out, first = torch.zeros(1001, dtype=torch.int32), torch.full((1001,), -1, dtype=torch.int32)
        _warp.launch_chunks(_count_kernel(), bounds, [_warp.array(out), _warp.array(first)])
        assert bool((out == 1).all())
        expected = torch.repeat_interleave(torch.tensor(bounds[:-1]), torch.tensor(bounds).diff()).to(torch.int32)
        assert torch.equal(first, expected)
    assert forks[-2:] == [(9, 2), (9, 2)]  # asked of the native fork-join each time once loaded (False: it declines)


def test_a_prepared_launch_forks_from_the_table_it_made_once(chunk_threads):
    # the native fork-join's table of chunks and its packed arguments are made at a prepared
    # launch's first forked run and kept: later runs, pointed at other tensors, write them all
    # once each, chunk by chunk, from that same table
    bounds = [0, 3, 500, 1001]
    kernel = _count_kernel()
    _warp.launch_chunks(kernel, bounds, [_warp.array(torch.zeros(1001, dtype=torch.int32)), _warp.array(torch.zeros(1001, dtype=torch.int32))])
    launch = _warp.Prepared(kernel, bounds, [_warp.array(torch.zeros(1001, dtype=torch.int32)), _warp.array(torch.zeros(1001, dtype=torch.int32))])
    expected = torch.repeat_interleave(torch.tensor(bounds[:-1]), torch.tensor(bounds).diff()).to(torch.int32)
    tables = []
    for _ in range(3):
        out, first = torch.zeros(1001, dtype=torch.int32), torch.full((1001,), -1, dtype=torch.int32)
        launch.run(out=out, first=first)
        assert bool((out == 1).all()) and torch.equal(first, expected)
        tables.append(dict(getattr(launch._run, "forks", {})))
    if chunk_threads == "openmp":
        assert len(tables[0]) == 1 and all(t == tables[0] for t in tables)  # (one table, the same objects, every run)
    else:
        assert tables == [{}, {}, {}]  # (no OpenMP team: the Python fork-join, nothing kept)


@_warp.kernels
def _sized_kernel():
    @wp.kernel(enable_backward=False, module="unique")
    def sized(start: int, a: float, shift: wp.vec3, x: wp.array(dtype=wp.vec3), out: wp.array(dtype=wp.vec3)):
        i = wp.tid() + start
        out[i] = a * x[i] + shift + wp.vec3(float(x.shape[0]), float(out.shape[0]), 0.0)

    return sized


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_prepared_launch_sized_and_given_values_in_any_order_equals_a_launch_packed_anew(chunks):
    # Prepared.size sets the arrays' lengths and the threads where the sizes differ from the last
    # call's, and the scalars (a number and a vector, through views of the packed structs) where
    # the values differ: each combination in turn writes what wp.launch writes with those
    # arguments, its rows and no others (the outputs hold room for every size)
    gen = torch.Generator().manual_seed(0)
    kernel = _sized_kernel()
    capacity = 64
    x0 = torch.rand(capacity, 3, generator=gen)
    args = [1.0, wp.vec3(0.0, 0.0, 0.0), _warp.Typed(x0, wp.vec3), _warp.Typed(torch.zeros(capacity, 3), wp.vec3)]
    _warp.launch(kernel, capacity, args, like=x0)  # (its first launch loads it)
    launch = _warp.Prepared(kernel, [capacity * c // chunks for c in range(chunks + 1)], [_warp.convert(a) for a in args])
    groups = (("x",), ("out",))
    steps = [(40, 2.0, (0.5, 0.0, -1.0)), (40, 2.0, (0.5, 0.0, -1.0)), (17, 2.0, (0.5, 0.0, -1.0)), (17, -3.0, (0.5, 0.0, -1.0)),
             (17, -3.0, (1.0, 2.0, 3.0)), (64, 0.25, (1.0, 2.0, 3.0)), (5, 0.25, (0.0, 0.0, 0.0)), (40, 2.0, (0.5, 0.0, -1.0))]
    for n, a, shift in steps:
        x = torch.rand(capacity, 3, generator=gen)
        out, want = torch.full((capacity, 3), float("nan")), torch.full((capacity, 3), float("nan"))
        launch.size(groups, (n, capacity), n, (("a", a), ("shift", shift)))
        launch.run(x=x, out=out)
        wp.launch(kernel, dim=n, inputs=[0, a, wp.vec3(*shift), _warp.array(x[:n], dtype=wp.vec3), _warp.array(want, dtype=wp.vec3)], device="cpu")
        assert bool(((out == want) | (out.isnan() & want.isnan())).all()), (n, a, shift)
        assert bool(out[:n].isfinite().all() and out[n:].isnan().all())


def test_chunks_run_in_python_where_the_native_fork_join_cannot_be_built(chunk_threads, monkeypatch):
    def unbuildable():
        raise RuntimeError("no C++ toolchain")

    switch = [True]
    monkeypatch.setattr(_warp, "NATIVE_FORK", switch)
    monkeypatch.setattr(_warp, "_fork_kernel", unbuildable)
    bounds = [0, 5, 17, 1001]
    for _ in range(2):
        out, first = torch.zeros(1001, dtype=torch.int32), torch.zeros(1001, dtype=torch.int32)
        _warp.launch_chunks(_count_kernel(), bounds, [_warp.array(out), _warp.array(first)])
        assert bool((out == 1).all())
    assert switch == [chunk_threads != "openmp"]  # tried once on the OpenMP team, then off


def test_cpu_launches_go_through_wp_launch_where_warp_keeps_its_entry_points_elsewhere(monkeypatch):
    # another Warp version whose recorded launches lack what the native path reads: every
    # launch goes through wp.launch, with the same results
    launch = wp.launch

    def recording_elsewhere(*args, record_cmd=False, **kwargs):
        return types.SimpleNamespace() if record_cmd else launch(*args, **kwargs)

    monkeypatch.setattr(wp, "launch", recording_elsewhere)
    monkeypatch.setattr(_warp, "_natives", {})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    x = torch.rand(501, 3, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        out, total = _affine(x)
        torch.testing.assert_close(out, 0.5 * x + torch.tensor([8.0, 2.0, 3.0]))
    assert _warp._natives == {_affine_kernel(): None}


def test_torch_wheels_on_linux_use_torchs_own_openmp_team():
    info = torch.__config__.parallel_info()
    if not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in info:
        pytest.skip("not a Linux wheel of torch on GNU OpenMP")
    lib = pathlib.Path(torch.__file__).parent / "lib"
    if not any(lib.glob("libgomp*.so*")):
        pytest.skip("torch's GNU OpenMP is not in its own folder here")
    assert _warp._openmp() is not None


_VARIANTS = """
    import sys, torch, pcops
    order = sys.argv[1].split(",")
    gen = torch.Generator().manual_seed(0)
    q, p, f = torch.rand(30, 3, generator=gen), torch.rand(40, 3, generator=gen), torch.rand(40, 2, generator=gen)
    qb, pb = torch.arange(30) % 2, torch.arange(40) % 2
    calls = {
        "radius32": lambda: pcops.radius_aggregate(q, p, f, 0.3, 0.1),
        "radius64grouped": lambda: pcops.radius_aggregate(q.double(), p.double(), f.double(), 0.3, 0.1,
                                                          query_batch=qb, ref_batch=pb),
        "knn32grouped": lambda: pcops.knn(q, p, 3, backend="warp", query_batch=qb, ref_batch=pb),
    }
    for name in order:
        calls[name]()
    print("ok")
"""


def _modules(cache: pathlib.Path) -> set[str]:
    return {d.name for d in cache.rglob("wp_*") if d.is_dir()}


def test_kernel_cache_does_not_depend_on_the_order_of_first_use(tmp_path):
    names = ["radius32", "radius64grouped", "knn32grouped"]
    for order in (names, names[::-1]):
        script = _VARIANTS.replace("sys.argv[1]", repr(",".join(order)))
        result = _run(script, timeout=600, WARP_CACHE_PATH=str(tmp_path))
        assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
        if order is names:
            first = _modules(tmp_path)
            assert len(first) >= 3, first  # one module per kernel variant (a variant may have several kernels)
            built = {f: f.stat().st_mtime_ns for f in tmp_path.rglob("*") if f.is_file()}
    assert _modules(tmp_path) == first  # the second process, in the other order, built nothing new
    assert {f: f.stat().st_mtime_ns for f in tmp_path.rglob("*") if f.is_file()} == built  # nor rewrote a file


def test_unwritable_kernel_cache_says_to_set_warp_cache_path():
    # a cache directory that cannot be created (read-only /sys; Permission denied for users)
    script = """
        import torch, pcops
        pcops.knn(torch.rand(10, 3), torch.rand(20, 3), 2, backend="warp")
    """
    result = _run(script, WARP_CACHE_PATH="/sys/pcops-kernel-cache")
    assert result.returncode != 0
    assert "WARP_CACHE_PATH" in result.stderr and "writable directory" in result.stderr, result.stderr[-2000:]
    # a cache that becomes unwritable once Warp is initialised: a new kernel variant cannot be stored
    script = """
        import torch, warp as wp, pcops
        pcops.knn(torch.rand(10, 3), torch.rand(20, 3), 2, backend="warp")
        wp.config.kernel_cache_dir = "/sys/pcops-kernel-cache"
        x = torch.rand(10, 3, dtype=torch.float64)
        pcops.radius_aggregate(x, x, x, 0.2, 0.1, query_batch=torch.zeros(10, dtype=torch.long),
                               ref_batch=torch.zeros(10, dtype=torch.long))
    """
    result = _run(script)  # the test session's kernel cache: the first call only loads
    assert result.returncode != 0
    assert "WARP_CACHE_PATH" in result.stderr and "RuntimeError: pcops could not write" in result.stderr, result.stderr[-2000:]


_CORRUPT = """
    import torch, pcops
    gen = torch.Generator().manual_seed(0)
    q, p, f = torch.rand(800, 3, generator=gen), torch.rand(800, 3, generator=gen), torch.rand(800, 2, generator=gen)
    # (above the small clouds' crossovers: the cell list's kernels, several modules)
    print(pcops.radius_aggregate(q, p, f, 0.1, 0.1).sum().item(), pcops.ball_query(q, p, 0.1, 4).counts.sum().item())
"""


def test_a_corrupt_cached_kernel_is_deleted_and_built_again(tmp_path):
    # a truncated and a zero-byte object file in the kernel cache: Warp's "Failed to load CPU
    # module" once, then the module is deleted from the cache and built again
    first = _run(_CORRUPT, WARP_CACHE_PATH=str(tmp_path))
    assert first.returncode == 0, first.stderr[-3000:]
    objects = sorted(tmp_path.rglob("*.o"))
    assert len(objects) >= 4, objects
    objects[0].write_bytes(objects[0].read_bytes()[:100])
    for obj in objects[1:]:
        obj.write_bytes(b"")
    again = _run(_CORRUPT, WARP_CACHE_PATH=str(tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == first.stdout  # the same results
    assert all(obj.stat().st_size > 100 for obj in objects)  # rebuilt
    third = _run(_CORRUPT, WARP_CACHE_PATH=str(tmp_path))  # and loaded from the cache from now on
    assert third.returncode == 0 and third.stdout == first.stdout and "Failed to" not in third.stderr, third.stderr[-3000:]


def test_a_kernel_that_cannot_be_loaded_even_when_rebuilt_names_the_cache(tmp_path, monkeypatch):
    # stand-ins: a kernel whose module never loads; its cache directory is deleted once, and the
    # second failure is an error naming the directory and WARP_CACHE_PATH
    monkeypatch.setattr(wp.config, "kernel_cache_dir", str(tmp_path))
    module_dir = tmp_path / "wp_stand_in_0123456"
    module_dir.mkdir()
    (module_dir / "wp_stand_in_0123456.cpu.o").write_bytes(b"")
    class Kernel:  # hashable, as Warp's kernels are
        def __init__(self, key):
            self.key = key
            self.module = types.SimpleNamespace(options={"block_dim": 256}, get_module_identifier=lambda block_dim=None: module_dir.name)

    kernel = Kernel("stand_in")
    attempts = []

    def load():
        attempts.append(module_dir.exists())
        raise Exception("Failed to load CPU module 'stand_in' (device='cpu')")

    with pytest.raises(RuntimeError, match=r"wp_stand_in_0123456.*WARP_CACHE_PATH"):
        _warp.first_load(kernel, "cpu", load)
    assert attempts == [True, False]  # the second attempt ran after the files were deleted
    assert (kernel, "cpu") not in _warp._loaded

    def other_error():
        raise ValueError("not about the cache")

    with pytest.raises(ValueError, match="not about the cache"):  # other errors pass through, nothing deleted
        _warp.first_load(Kernel("other"), "cpu", other_error)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cpu_use_prints_nothing_about_the_cuda_driver():
    script = """
        import torch, pcops
        q, p, f = torch.rand(10, 3), torch.rand(20, 3), torch.rand(20, 2)
        pcops.farthest_point_sample(p, 5)  # the first op of a process initialises Warp, whichever it is
        pcops.knn(q, p, 2, backend="warp")
        pcops.radius_aggregate(q, p, f, 0.3, 0.1)
        pcops.ball_query(q, p, 0.3, 4)
        print("ok")
    """
    result = _run(script)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    assert result.stderr == ""


def test_other_warp_init_messages_still_reach_stderr(capfd):
    with _warp._filtered_stderr("NVIDIA CUDA driver"):
        os.write(2, b"Warp CUDA warning: Could not find or load the NVIDIA CUDA driver.\nsomething else\n")
    assert capfd.readouterr().err == "something else\n"


# ---------------------------------------------------------------------------------------------
# On a GPU


def _stall(stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # the side stream is busy for a while: races show up as wrong results


def _on_gpu(*tensors):
    """Copies on the GPU, finished: a pageable copy inside a stalled stream would wait for the stall
    (a blocking copy), so every input is on the device before a stream is stalled."""
    out = [t.cuda() for t in tensors]
    torch.cuda.synchronize()
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("grouped", [False, True])
def test_cuda_ops_on_a_stalled_side_stream_match_cpu(gen, grouped):
    q, p = torch.rand(3000, 3, generator=gen), torch.rand(5000, 3, generator=gen)
    f = torch.rand(5000, 4, generator=gen)
    qb, pb = torch.arange(3000) % 3, torch.arange(5000) % 3
    batch = dict(query_batch=qb, ref_batch=pb) if grouped else {}

    def ops(q, p, f, batch):
        return [
            pcops.radius_aggregate(q, p, f, 0.08, 0.1, validate=False, **batch),
            pcops.knn(q, p, 5, backend="warp", validate=False, **batch).idx,
            pcops.knn_aggregate(q, p, f, 5, 0.1, backend="warp", validate=False, **batch),
            pcops.ball_query(q, p, 0.08, 8, validate=False, **batch).idx,  # a cell list per call
        ]

    expected = ops(q, p, f, batch)
    qc, pc, fc, qbc, pbc = _on_gpu(q, p, f, qb, pb)
    cuda_batch = dict(query_batch=qbc, ref_batch=pbc) if grouped else {}
    side = torch.cuda.Stream()
    wrappers = len(_warp._streams)
    for _ in range(3):  # several rounds: a wrapper garbage-collected between them used to reset Warp's stream
        _stall(side)  # every op below is queued behind the stall (validate=False: no host read of values)
        with torch.cuda.stream(side):
            got = ops(qc, pc, fc, cuda_batch)
        torch.cuda.synchronize()
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
    assert len(_warp._streams) - wrappers <= 2  # the side stream (and the default one): no wrapper per call


@pytest.mark.cuda
def test_cuda_cell_lists_are_released_after_pending_side_stream_work(gen):
    # ball_query builds a cell list per call (torch tensors) and drops it when the call returns:
    # torch's caching allocator must not hand that memory to the calls made right after on the
    # default stream (same sizes) while the stalled side stream's kernels have yet to read it.
    q, p = torch.rand(2000, 3, generator=gen), torch.rand(3000, 3, generator=gen)
    expected = pcops.ball_query(q, p, 0.1, 8)
    shuffled = [p[torch.randperm(3000, generator=gen)] for _ in range(5)]  # other cell lists of the same sizes
    qc, pc, *others = _on_gpu(q, p, *shuffled)
    side = torch.cuda.Stream()
    outs = []
    for other in others:
        _stall(side)
        with torch.cuda.stream(side):
            outs.append(pcops.ball_query(qc, pc, 0.1, 8, validate=False))
        pcops.ball_query(qc, other, 0.1, 8, validate=False)  # the default stream: built and run at once
    torch.cuda.synchronize()
    for out in outs:
        for a, b in zip(out, expected):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)


def _syncs(fn) -> int:
    """How many host synchronisations PyTorch reports while ``fn`` runs."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)  # not the "prototype feature" notice


@pytest.mark.cuda
def test_cuda_sync_counts(gen):
    q, p, f = (torch.rand(n, 3, generator=gen).cuda() for n in (500, 800, 800))
    qg, pg = (torch.arange(500, dtype=torch.int32) % 4).cuda(), (torch.arange(800, dtype=torch.int32) % 4).cuda()
    sigma = torch.tensor(0.1, device="cuda")
    pcops.radius_aggregate(q, p, f, 0.2, sigma, validate=False)  # warm-up: kernels loaded
    # sigma as a CUDA tensor (a Python number is copied to the device, a synchronous copy): the
    # cell list's one read of the bounding box and the number of samples (pcops.ops.neighbours._cells); its
    # frame is made on the device
    assert _syncs(lambda: pcops.radius_aggregate(q, p, f, 0.2, sigma, validate=False)) == 1
    torch.ops.pcops.radius_aggregate(q, p, f, sigma, 0.2, False, qg, pg)
    assert _syncs(lambda: torch.ops.pcops.radius_aggregate(q, p, f, sigma, 0.2, False, qg, pg)) == 1
    # forward and backward: the backward reuses the forward's cell list (no second read)
    fg, sg = f.clone().requires_grad_(), sigma.clone().requires_grad_()

    def train():
        pcops.radius_aggregate(q, p, fg, 0.2, sg, validate=False).sum().backward()

    train()
    assert _syncs(train) == 1
    ball = torch.ops.pcops.ball_query
    ball(q, p, 0.2, 8, False, None, None)
    assert _syncs(lambda: ball(q, p, 0.2, 8, False, None, None)) == 0  # a small cloud: every pair measured, no cell list
    # a cell list (grouped, or forced): its one read of the boxes and the number of samples
    assert _syncs(lambda: ball(q, p, 0.2, 8, False, qg, pg)) == 1
    points, pairs = _warp.CUDA_SCAN_POINTS, _warp.CUDA_SCAN_PAIRS
    _warp.CUDA_SCAN_POINTS = _warp.CUDA_SCAN_PAIRS = 0
    try:
        ball(q, p, 0.2, 8, False, None, None)
        assert _syncs(lambda: ball(q, p, 0.2, 8, False, None, None)) == 1
    finally:
        _warp.CUDA_SCAN_POINTS, _warp.CUDA_SCAN_PAIRS = points, pairs
    backends = pcops.ops.neighbours.nearest.BACKENDS
    warp = backends["warp"].op  # the kd-tree is built with torch sorts on the device: no host read
    warp(q, p, 4, False)
    assert _syncs(lambda: warp(q, p, 4, False)) == 0
    assert _syncs(lambda: warp(q, p, 4, False, qg, pg)) == 0
    if backends["cuml"].available():
        cuml = backends["cuml"].op
        cuml(q, p, 4, False)
        assert _syncs(lambda: cuml(q, p, 4, False)) == 1  # torch's stream, before cuML reads the inputs
        # + unique_consecutive's output size and the one read of the group sizes, for any number of samples
        assert _syncs(lambda: cuml(q, p, 4, False, qg, pg)) == 3
        many_q, many_p = (torch.arange(500, dtype=torch.int32) % 50).cuda(), (torch.arange(800, dtype=torch.int32) % 50).cuda()
        assert _syncs(lambda: cuml(q, p, 4, False, many_q, many_p)) == 3


@pytest.mark.cuda
def test_reduce_overhead_compile_runs_every_op(gen):
    # every op with a static output shape (the graph ops' edge counts are data-dependent)
    class Model(torch.nn.Module):
        def forward(self, q, p, f):
            a = pcops.radius_aggregate(q, p, f, 0.2, 0.1, validate=False)
            b = pcops.knn_aggregate(q, p, f, 4, 0.1, backend="warp", validate=False)
            c = pcops.knn(q, p, 4, validate=False).dists
            d = pcops.ball_query(q, p, 0.2, 8, validate=False).dists
            e = pcops.farthest_point_sample(p, 50, validate=False).points
            g = pcops.knn_interpolate(q, p, f, 3, validate=False)
            h = pcops.chamfer_distance(q, p)
            n = pcops.estimate_normals(p, 8, validate=False).abs()
            finite = lambda t: torch.where(torch.isfinite(t), t, 0).sum()  # noqa: E731  (missing neighbours: inf)
            return a.sum() + b.sum() + c.sum() + finite(d) + e.sum() + g.sum() + h + n.sum()

    q, p, f = (torch.rand(n, 3, generator=gen) for n in (300, 500, 500))
    expected = Model()(q, p, f)
    compiled = torch.compile(Model(), mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # recording, then replays
        got = compiled(q.cuda(), p.cuda(), f.cuda())
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_the_first_pcops_call_of_a_process_on_cuda_initialises_warp():
    # the cell list's first launch asked Warp for a CUDA device before anything had initialised Warp
    script = """
        import torch, pcops
        q = torch.rand(100, 3, device="cuda")
        print(float(pcops.radius_aggregate(q, q, q, 0.2, 0.1).sum()))
    """
    result = _run(script)
    assert result.returncode == 0, result.stderr[-3000:]
