"""pcops._threads: CPU threads on a machine other processes share."""

import os
import subprocess
import sys
import time

import pytest
import torch

import pcops
from pcops import _threads
from tests import op_table


@pytest.fixture
def machine(monkeypatch):
    """A scripted machine: ``machine.busy`` ticks of the cores so far, ``machine.own`` seconds of
    this process's CPU time, ``machine.now`` the clock; returns a function that advances them."""

    class Machine:
        busy, own, now = 0, 0.0, 1000.0

        def advance(self, seconds: float, others: float, own: float = 0.0) -> None:
            """``seconds`` pass with other processes using ``others`` cores and this one ``own``."""
            self.now += seconds
            self.own += own * seconds
            self.busy += round((others + own) * seconds * _threads._TICKS)

    m = Machine()
    monkeypatch.setattr(_threads, "_busy_ticks", lambda cores: m.busy)
    monkeypatch.setattr(_threads.os, "times", lambda: os.times_result((m.own, 0.0, 0.0, 0.0, 0.0)))
    monkeypatch.setattr(_threads.time, "monotonic", lambda: m.now)
    monkeypatch.setattr(_threads, "_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(_threads, "_last", [None, None, None, None])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    return m


def test_every_thread_until_two_readings_and_on_a_quiet_machine(machine):
    assert _threads.available() == 4  # one reading: nothing known yet
    machine.advance(1.0, others=0.3, own=2.0)
    assert _threads.available() == 4  # a third of a core: not a core kept busy


@pytest.mark.parametrize("others, expected", [(1.0, 3), (0.8, 3), (2.0, 2), (3.4, 1), (4.0, 1), (7.0, 1)])
def test_the_cores_other_processes_keep_busy_are_left_out(machine, others, expected):
    _threads.available()
    machine.advance(1.0, others=others, own=1.0)
    assert _threads.available() == expected


def test_a_reading_holds_for_a_window_then_the_next_one_counts(machine):
    _threads.available()
    machine.advance(1.0, others=2.0)
    assert _threads.available() == 2
    machine.advance(_threads.WINDOW / 2, others=0.0)
    assert _threads.available() == 2  # within the window: the last reading
    machine.advance(_threads.WINDOW, others=0.0)
    assert _threads.available() == 4  # the machine is quiet again


def test_the_quiet_check_of_each_call_agrees_with_the_reading(machine):
    """An eager call skips torch's count only where the last reading, within its window, found
    every core free; a busy reading, a stale one or none at all go through :func:`available`."""
    seen = []

    @_threads.limits
    def public():
        seen.append(_threads.requested())  # (the caller's count inside a limited call)
        return torch.get_num_threads()

    assert not _threads._all_free()  # no reading yet
    _threads.available()
    assert _threads._all_free()  # one reading: nothing known, every thread (as available says)
    machine.advance(1.0, others=0.3, own=1.0)
    _threads.available()
    assert _threads._all_free() and public() == 4
    machine.advance(_threads.WINDOW, others=2.0)
    assert not _threads._all_free()  # a stale reading
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "set_num_threads", lambda n: seen.append(("set", n)))
        public()
    assert ("set", 2) in seen and not _threads._all_free()  # the new reading found two cores busy
    machine.advance(_threads.WINDOW, others=0.0)
    _threads.available()
    assert _threads._all_free()


def test_fewer_threads_asked_than_cores_free(machine, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _threads.available()
    machine.advance(1.0, others=1.0)
    assert _threads.available() == 2  # three cores free: torch's two


def test_an_unreadable_machine_uses_every_thread(machine, monkeypatch):
    monkeypatch.setattr(_threads, "_busy_ticks", lambda cores: None)
    _threads.available()
    machine.advance(1.0, others=3.0)
    assert _threads.available() == 4


def test_busy_ticks_read_the_cores_of_this_process():
    cores = _threads._cores()
    first = _threads._busy_ticks(cores)
    if first is None:
        pytest.skip("no /proc/stat here")
    spent = time.process_time()
    while time.process_time() - spent < 0.2:  # this process keeps one of its cores busy
        pass
    assert _threads._busy_ticks(cores) - first >= 0.1 * _threads._TICKS
    assert _threads._busy_ticks([]) == 0


@pytest.mark.skipif(len(_threads._cores()) < 2 or _threads._busy_ticks([0]) is None, reason="needs 2 cores and /proc/stat")
def test_a_spinning_neighbour_takes_a_core_away(monkeypatch):
    monkeypatch.setattr(_threads, "_last", [None, None, None, None])
    monkeypatch.setattr(torch, "get_num_threads", lambda: len(_threads._cores()))
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        _threads.available()
        time.sleep(2 * _threads.WINDOW)
        assert _threads.available() <= len(_threads._cores()) - 1
    finally:
        spin.kill()
        spin.wait()


def test_limited_sets_and_restores_torchs_count(monkeypatch):
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("one thread: nothing to limit")
    monkeypatch.setattr(_threads, "available", lambda: 1)
    monkeypatch.setattr(_threads, "_all_free", lambda: False)  # (the quiet machine's check: not quiet)
    with _threads.limited():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), _threads.limited():
        raise RuntimeError("restored on an error too")
    assert torch.get_num_threads() == before


@_threads.custom_op("pcops_test::threads_seen", mutates_args=())
def _threads_seen(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, torch.get_num_threads())


_threads_seen.register_fake(torch.empty_like)


@_threads.limits
def _public(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, torch.get_num_threads()) + _threads_seen(x)


def test_custom_ops_and_public_functions_run_limited(monkeypatch):
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("one thread: nothing to limit")
    x = torch.zeros(3)
    monkeypatch.setattr(_threads, "available", lambda: before)  # a quiet machine
    assert _threads_seen(x).tolist() == [before] * 3 and _public(x).tolist() == [2 * before] * 3
    monkeypatch.setattr(_threads, "available", lambda: 1)  # a busy one
    monkeypatch.setattr(_threads, "_all_free", lambda: False)
    assert _threads_seen(x).tolist() == [1.0] * 3
    assert _public(x).tolist() == [2.0] * 3
    assert torch.get_num_threads() == before
    compiled = torch.compile(_threads.limits(lambda y: 2 * _threads_seen(y)), fullgraph=True)
    assert compiled(x).tolist() == [2.0] * 3  # traced as the function (no graph break); the op's kernel limited


def test_a_public_function_that_raises_on_a_busy_machine_restores_the_counts(monkeypatch):
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("one thread: nothing to limit")
    monkeypatch.setattr(_threads, "available", lambda: 1)
    monkeypatch.setattr(_threads, "_all_free", lambda: False)
    seen = []

    @_threads.limits
    def failing():
        seen.append((torch.get_num_threads(), _threads.requested()))
        raise ValueError("restored on an error")

    with pytest.raises(ValueError, match="restored on an error"):
        failing()
    assert seen == [(1, before)]  # on the free core, its chunks still the caller's count
    assert torch.get_num_threads() == before and _threads.requested() == before and _threads._local.requested is None


def test_public_functions_keep_their_names_and_signatures():
    import inspect

    assert pcops.knn.__name__ == "knn" and "k" in inspect.signature(pcops.knn).parameters
    assert inspect.unwrap(pcops.knn) is not pcops.knn


def test_a_busy_machine_runs_the_same_chunks_so_sums_do_not_change(monkeypatch):
    """Scattered sums (radius_aggregate's backward adds each chunk's private copy) are the same
    bits whether the machine is quiet or busy: the chunks follow torch's count, not the free cores."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: one chunk either way")
    gen = torch.Generator().manual_seed(0)
    query, ref = torch.rand(3000, 3, generator=gen), torch.rand(3000, 3, generator=gen)
    features = torch.randn(3000, 8, generator=gen, requires_grad=True)

    def grad():
        features.grad = None
        pcops.radius_aggregate(query, ref, features, 0.1, weights="uniform").square().sum().backward()
        return features.grad.clone()

    monkeypatch.setattr(_threads, "available", lambda: torch.get_num_threads())
    quiet = grad()
    monkeypatch.setattr(_threads, "available", lambda: 1)
    monkeypatch.setattr(_threads, "_all_free", lambda: False)
    assert torch.equal(grad(), quiet)


def test_a_forked_child_reads_the_machine_under_a_lock_of_its_own():
    """A DataLoader worker forked while another thread held the reading's lock must not hang."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork here")
    context = multiprocessing.get_context("fork")
    with _threads._lock:
        child = context.Process(target=_threads.available)
        child.start()
        child.join(timeout=60)
    assert child.exitcode == 0


def _results(op, inputs: dict, grad: bool):
    """The row's outputs (and its inputs' gradients where ``grad``), flattened, as plain tensors."""
    inputs = {k: v.detach().requires_grad_(grad and k in op.grad) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    out = op.call(inputs)
    flat = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    if grad and op.grad:
        torch.autograd.backward([t.sum() for t in flat if t.requires_grad])
        flat += [inputs[k].grad for k in op.grad]
    return [t.detach() for t in flat if t is not None]


@pytest.mark.parametrize("op", op_table.OPS, ids=lambda op: op.name)
def test_plain_eager_calls_run_the_kernels_directly_with_the_dispatchers_results(op, monkeypatch):
    """An op's custom ops called in plain eager mode skip the dispatcher (pcops._threads._call):
    every op of the table gives the same bits either way, with and without gradients."""
    from torch._library.custom_ops import CustomOpDef

    inputs = op.inputs(seed=3)
    dispatched_calls = []
    call = CustomOpDef.__call__
    monkeypatch.setattr(CustomOpDef, "__call__", lambda self, *a, **kw: dispatched_calls.append(self._name) or call(self, *a, **kw))
    for grad in (False, True):
        direct = _results(op, inputs, grad)
        if not grad:
            assert dispatched_calls == [], f"{op.name}: {dispatched_calls} went through the dispatcher"
        monkeypatch.setattr(_threads, "DIRECT", [False])
        dispatched = _results(op, inputs, grad)
        monkeypatch.setattr(_threads, "DIRECT", [True])
        assert len(direct) == len(dispatched)
        for a, b in zip(direct, dispatched):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()), op.name


def test_only_plain_eager_calls_skip_the_dispatcher():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.zeros(3)
    assert _threads.plain_device((x, 2), {}) == "cpu" and _threads.plain_device((), {"x": [x, x]}) == "cpu"
    assert _threads.plain_device((x.requires_grad_(),), {}) is None  # a gradient to record
    with torch.no_grad():
        assert _threads.plain_device((x,), {}) == "cpu"
    x = torch.zeros(3)
    assert _threads.plain_device((torch.nn.Parameter(x),), {}) is None  # a subclass
    assert _threads.plain_device((x, x.to("meta")), {}) is None
    with FakeTensorMode():
        assert _threads.plain_device((x,), {}) is None
        fake = torch.empty(3)
        assert _threads_seen(fake).shape == (3,)  # the fake ran
    with torch.autograd.profiler.profile():
        assert _threads.plain_device((x,), {}) is None
    assert torch.vmap(lambda y: _threads_seen(y))(torch.zeros(2, 3)).shape == (2, 3)  # through functorch's dispatch
    with torch.overrides.TorchFunctionMode():
        assert _threads.plain_device((x,), {}) is None
    assert _threads.plain_device((torch._neg_view(x),), {}) is None  # a negated view: materialised by the dispatcher
    assert _threads.plain_device((torch.complex(x, x).conj(),), {}) is None
    from torch.autograd import forward_ad

    with forward_ad.dual_level():
        assert _threads.plain_device((forward_ad.make_dual(x, torch.ones(3)),), {}) is None
    seen = []
    torch.jit.trace(lambda y: seen.append(_threads.plain_device((y,), {})) or y + 1, (x,), check_trace=False)
    assert seen == [None]


def test_negated_views_and_dual_tensors_give_the_dispatchers_results():
    from torch.autograd import forward_ad

    gen = torch.Generator().manual_seed(2)
    p, f = torch.rand(40, 3, generator=gen), torch.rand(40, 2, generator=gen)
    neg = torch._neg_view(p)  # a view whose values are -p, its memory p's
    assert torch.equal(pcops.knn(neg, neg, 4).idx, pcops.knn(-p, -p, 4).idx)
    with forward_ad.dual_level():  # the op has no forward-mode formula: an error, not the dispatcher's missing tangent
        with pytest.raises(NotImplementedError, match="^radius_aggregate has no forward-mode derivative"):
            pcops.radius_aggregate(p, p, forward_ad.make_dual(f, torch.ones_like(f)), 0.3, 0.1)
