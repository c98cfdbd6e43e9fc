"""pcops.memory: error paths and wiring everywhere; the real shared pool on a GPU (marked cuda)."""

import subprocess
import sys
import textwrap
import types

import pytest
import torch

import pcops.memory as memory


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setattr(memory, "_state", {})


@pytest.fixture
def fake_gpu(monkeypatch):
    """A machine that reports CUDA, with recording stand-ins for rmm, cupy and torch's allocator swap."""
    calls = {}
    resources = {}
    # the CUDA runtime's current device and the devices made current (each gets a context)
    cuda = calls["cuda"] = {"current": 0, "contexts": set()}

    def set_device(device):
        cuda["current"] = device
        cuda["contexts"].add(device)

    def reinitialize(**kw):
        # as rmm.reinitialize (rmm.pylibrmm.memory_resource._initialize): save the current device,
        # drop the per-device resources, create each pool with its device current, restore the device
        calls.setdefault("reinitialize", []).append(kw)
        original = cuda["current"]
        resources.clear()
        for device in kw["devices"]:
            set_device(device)
            resources[device] = ("pool", device)
        set_device(original)

    rmm = types.ModuleType("rmm")
    rmm.reinitialize = reinitialize
    gpu = types.ModuleType("rmm._cuda.gpu")
    gpu.getDevice, gpu.setDevice = (lambda: cuda["current"]), set_device
    rmm.mr = types.SimpleNamespace(
        StatisticsResourceAdaptor=_FakeStatistics,
        get_per_device_resource=lambda i: resources.setdefault(i, ("pool", i)),
        set_per_device_resource=lambda i, mr: resources.__setitem__(i, mr),
    )
    calls["resources"] = resources
    torch_alloc, cupy_alloc = object(), object()
    allocators = types.ModuleType("rmm.allocators")
    rmm_torch = types.ModuleType("rmm.allocators.torch")
    rmm_torch.rmm_torch_allocator = torch_alloc
    rmm_cupy = types.ModuleType("rmm.allocators.cupy")
    rmm_cupy.rmm_cupy_allocator = cupy_alloc
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(set_allocator=lambda a: calls.setdefault("cupy", []).append(a))
    for name, module in [("rmm", rmm), ("rmm.allocators", allocators), ("rmm.allocators.torch", rmm_torch),
                         ("rmm.allocators.cupy", rmm_cupy), ("cupy", cupy), ("rmm._cuda", types.ModuleType("rmm._cuda")),
                         ("rmm._cuda.gpu", gpu)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda["current"])  # torch reads the runtime's device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", lambda a: calls.setdefault("torch", []).append(a))
    calls["allocators"] = (torch_alloc, cupy_alloc)
    return calls


def test_without_cuda_the_error_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        memory.use_rmm_pool()
    assert not memory.rmm_pool_enabled()


def test_without_rmm_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "rmm", None)  # import rmm raises ImportError
    with pytest.raises(ImportError, match=r"rmm package: pip install \"pcops\[cuda12\]\""):
        memory.use_rmm_pool()


def test_too_late_call_explains_the_fix(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="must run before PyTorch initialises CUDA.*call it first"):
        memory.use_rmm_pool()
    assert "reinitialize" not in fake_gpu and not memory.rmm_pool_enabled()


def test_allocator_swap_failure_is_translated(fake_gpu, monkeypatch):
    def refuse(_):
        raise RuntimeError("Can't swap an already initialized allocator")

    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", refuse)
    with pytest.raises(RuntimeError, match="initialised before pcops.memory.use_rmm_pool"):
        memory.use_rmm_pool()


def test_pool_wires_torch_cupy_and_warp_once(fake_gpu):
    memory.use_rmm_pool(initial_pool_size="1GiB", maximum_pool_size=2**32)
    memory.use_rmm_pool(initial_pool_size="2GiB")  # a second call is a no-op
    torch_alloc, cupy_alloc = fake_gpu["allocators"]
    assert fake_gpu["reinitialize"] == [
        dict(pool_allocator=True, initial_pool_size="1GiB", maximum_pool_size=2**32, devices=[0])
    ]
    assert fake_gpu["torch"] == [torch_alloc] and fake_gpu["cupy"] == [cupy_alloc]
    stats = fake_gpu["resources"][0]
    assert isinstance(stats, _FakeStatistics) and stats.upstream == ("pool", 0)  # the pool, with statistics
    assert memory.rmm_pool_enabled()


def test_local_rank_picks_the_device(fake_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    memory.use_rmm_pool()
    assert fake_gpu["reinitialize"][0]["devices"] == [3]


def test_each_rank_sets_up_and_keeps_current_its_own_device_only(fake_gpu, monkeypatch):
    # rmm.reinitialize sets the device that was current back at its end: device 0 unless the
    # rank's device is made current first, which created a context on device 0 in every rank
    monkeypatch.setenv("LOCAL_RANK", "3")
    memory.use_rmm_pool()
    assert fake_gpu["cuda"]["contexts"] == {3}  # no context on device 0
    assert fake_gpu["cuda"]["current"] == 3  # torch's "cuda" tensors go to the pool's device
    stats = fake_gpu["resources"][3]
    assert isinstance(stats, _FakeStatistics) and stats.upstream == ("pool", 3)
    stats.allocate(64)
    assert memory.max_memory_allocated() == 64  # the current device: the pool's
    with pytest.raises(ValueError, match="did not set up device 0.*outside the pool"):
        memory.max_memory_allocated(0)


def test_without_local_rank_the_current_cuda_device_is_used(fake_gpu):
    fake_gpu["cuda"]["current"] = 2  # chosen before, e.g. through CuPy
    memory.use_rmm_pool()
    assert fake_gpu["reinitialize"][0]["devices"] == [2]
    assert fake_gpu["cuda"]["contexts"] == {2} and fake_gpu["cuda"]["current"] == 2


def test_a_pool_on_several_devices_keeps_the_first_current(fake_gpu):
    memory.use_rmm_pool(devices=[1, 2])
    assert fake_gpu["cuda"]["contexts"] == {1, 2} and fake_gpu["cuda"]["current"] == 1
    for index in (1, 2):
        fake_gpu["resources"][index].allocate(10 * index)
        assert memory.max_memory_allocated(index) == 10 * index  # each device's own statistics
    assert memory.max_memory_allocated("cuda") == 10  # no index: the current device
    with pytest.raises(ValueError, match=r"covers \[1, 2\]"):
        memory.reset_peak_memory_stats(0)


def test_cuda_graph_compile_modes_warn_under_the_pool(fake_gpu):
    memory.check_compile_mode("reduce-overhead")  # no pool yet: silent
    memory.use_rmm_pool()
    with pytest.warns(UserWarning, match="CUDA graphs"):
        memory.check_compile_mode("reduce-overhead")


def test_peak_under_the_pool_comes_from_rmm_statistics(fake_gpu):
    memory.use_rmm_pool(devices=[0])
    stats = fake_gpu["resources"][0]
    stats.allocate(100)
    stats.allocate(50)
    stats.free(50)
    assert memory.max_memory_allocated(0) == 150  # peak since the pool was set up
    memory.reset_peak_memory_stats(0)
    assert memory.max_memory_allocated("cuda:0") == 100  # a new peak starts at what is allocated now
    stats.allocate(30)
    stats.free(30)
    stats.allocate(10)
    assert memory.max_memory_allocated(0) == 130
    memory.reset_peak_memory_stats(0)
    assert memory.max_memory_allocated(0) == 110 and len(stats.levels) == 2  # resets do not pile up levels
    with pytest.raises(ValueError, match="did not set up device 3"):
        memory.max_memory_allocated(3)


def test_without_the_pool_cuml_gets_rmm_async_resource_once(monkeypatch):
    class Plain:
        pass

    class Async:
        def __init__(self, initial_pool_size=None, release_threshold=None):
            self.release_threshold = release_threshold

    resources = {0: Plain(), 1: "user's"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=8 << 30))
    rmm = types.ModuleType("rmm")
    rmm.mr = types.SimpleNamespace(
        CudaMemoryResource=Plain, CudaAsyncMemoryResource=Async,
        get_per_device_resource=resources.__getitem__, set_per_device_resource=resources.__setitem__,
    )
    monkeypatch.setitem(sys.modules, "rmm", rmm)
    monkeypatch.setattr(memory, "_async_done", set())
    memory.default_cuml_resource(0)
    memory.default_cuml_resource(1)
    assert isinstance(resources[0], Async) and resources[1] == "user's"  # a resource the user chose stays
    assert resources[0].release_threshold == 512 << 20  # not RMM's default (UINT64_MAX: never released)
    resources[0] = Plain()
    memory.default_cuml_resource(0)  # once per device
    assert isinstance(resources[0], Plain)


def test_the_async_pool_keeps_a_sixteenth_of_the_device_at_most_1_gib():
    assert memory.async_release_threshold(8 << 30) == 512 << 20
    assert memory.async_release_threshold(80 << 30) == 1 << 30


class _FakeStatistics:
    """RMM's StatisticsResourceAdaptor counters: a stack of levels; popping folds a level into the one below."""

    def __init__(self, upstream):
        self.upstream, self.levels = upstream, [[0, 0]]  # [current, peak] per level

    def allocate(self, n):
        for level in self.levels:
            level[0] += n
            level[1] = max(level[1], level[0])

    def free(self, n):
        for level in self.levels:
            level[0] -= n

    def _stats(self, level):
        return types.SimpleNamespace(current_bytes=level[0], peak_bytes=level[1])

    @property
    def allocation_counts(self):
        return self._stats(self.levels[-1])

    def push_counters(self):
        before = self._stats(self.levels[-1])
        self.levels.append([0, 0])
        return before

    def pop_counters(self):
        return self._stats(self.levels.pop())


_GPU_SCRIPT = textwrap.dedent(
    """
    import cupy, rmm, torch
    import pcops, pcops.memory

    pcops.memory.use_rmm_pool(initial_pool_size=2**28)
    stats = rmm.mr.get_current_device_resource()
    assert isinstance(stats, rmm.mr.StatisticsResourceAdaptor), type(stats)  # the pool, with statistics
    pool = stats.get_upstream()
    assert isinstance(pool, rmm.mr.PoolMemoryResource), type(pool)
    start = pool.pool_size()
    t = torch.empty(2**28, dtype=torch.uint8, device="cuda")      # 256 MiB from torch
    after_torch = pool.pool_size()
    c = cupy.empty(2**28, dtype=cupy.uint8)                         # 256 MiB from cupy
    after_cupy = pool.pool_size()
    assert after_torch >= start + 2**28 - 2**20 or start >= 2**28, (start, after_torch)
    assert after_cupy > after_torch or after_torch >= 2**29, (after_torch, after_cupy)
    pcops.memory.reset_peak_memory_stats()                          # torch's own statistics raise under RMM
    base = pcops.memory.max_memory_allocated()
    assert base >= 2**29 - 2**20, base                              # torch's and cupy's buffers, seen by RMM
    del t, c
    x = torch.empty(2**27, dtype=torch.uint8, device="cuda")
    assert pcops.memory.max_memory_allocated() == base              # below the earlier peak

    layer = pcops.KNNAggregation(4, sigma=0.1)
    q, p, f = torch.rand(500, 3, device="cuda"), torch.rand(800, 3, device="cuda"), torch.rand(800, 8, device="cuda")
    out = torch.compile(layer, fullgraph=True)(q, p, f)
    torch.testing.assert_close(out.cpu(), pcops.knn_aggregate(q.cpu(), p.cpu(), f.cpu(), 4, 0.1), rtol=1e-4, atol=1e-5)
    r = pcops.radius_aggregate(q, p, f, 0.2, 0.1)
    torch.testing.assert_close(r.cpu(), pcops.radius_aggregate(q.cpu(), p.cpu(), f.cpu(), 0.2, 0.1), rtol=1e-4, atol=1e-5)
    print("ok")
    """
)


@pytest.mark.cuda
def test_torch_and_cupy_share_the_pool_and_ops_compile_under_it():
    pytest.importorskip("rmm", reason="rmm not installed: pip install pcops[cuda12]")
    pytest.importorskip("cupy", reason="cupy not installed: pip install pcops[cuda12]")
    # A fresh process: the pool must be set before CUDA is initialised.
    result = subprocess.run([sys.executable, "-c", _GPU_SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
