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
    rmm = types.ModuleType("rmm")
    rmm.reinitialize = lambda **kw: calls.setdefault("reinitialize", []).append(kw)
    torch_alloc, cupy_alloc = object(), object()
    allocators = types.ModuleType("rmm.allocators")
    rmm_torch = types.ModuleType("rmm.allocators.torch")
    rmm_torch.rmm_torch_allocator = torch_alloc
    rmm_cupy = types.ModuleType("rmm.allocators.cupy")
    rmm_cupy.rmm_cupy_allocator = cupy_alloc
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(set_allocator=lambda a: calls.setdefault("cupy", []).append(a))
    for name, module in [("rmm", rmm), ("rmm.allocators", allocators), ("rmm.allocators.torch", rmm_torch),
                         ("rmm.allocators.cupy", rmm_cupy), ("cupy", cupy)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", lambda a: calls.setdefault("torch", []).append(a))
    monkeypatch.setattr(memory, "_limit_warp_mempool", lambda ids, t: calls.setdefault("warp", []).append((ids, t)))
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
    assert fake_gpu["warp"] == [([0], 256 * 1024**2)]
    assert memory.rmm_pool_enabled()


def test_local_rank_picks_the_device(fake_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    memory.use_rmm_pool()
    assert fake_gpu["reinitialize"][0]["devices"] == [3]


def test_cuda_graph_compile_modes_warn_under_the_pool(fake_gpu):
    memory.check_compile_mode("reduce-overhead")  # no pool yet: silent
    memory.use_rmm_pool()
    with pytest.warns(UserWarning, match="CUDA graphs"):
        memory.check_compile_mode("reduce-overhead")
    with pytest.warns(UserWarning, match="not reported under RMM"):
        assert memory.max_memory_allocated() is None


_GPU_SCRIPT = textwrap.dedent(
    """
    import cupy, rmm, torch
    import pcops, pcops.memory

    pcops.memory.use_rmm_pool(initial_pool_size=2**28)
    pool = rmm.mr.get_current_device_resource()
    assert isinstance(pool, rmm.mr.PoolMemoryResource), type(pool)
    start = pool.pool_size()
    t = torch.empty(2**28, dtype=torch.uint8, device="cuda")      # 256 MiB from torch
    after_torch = pool.pool_size()
    c = cupy.empty(2**28, dtype=cupy.uint8)                         # 256 MiB from cupy
    after_cupy = pool.pool_size()
    assert after_torch >= start + 2**28 - 2**20 or start >= 2**28, (start, after_torch)
    assert after_cupy > after_torch or after_torch >= 2**29, (after_torch, after_cupy)
    assert torch.cuda.memory_allocated() == 0                       # nothing from torch's own allocator

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
