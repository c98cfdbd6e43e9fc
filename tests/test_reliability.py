"""Reliability: garbage in never hangs, batch ids never merge samples, one rule for sigma,
deterministic gradients, thread safety, far coordinates, bounded memory."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pcops
from tests import reference

CPU_BACKENDS = ["warp", "scipy", "torch"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, timeout: float) -> str:
    """Run ``code`` in a fresh interpreter; a hang fails the test instead of stalling the suite."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"did not finish within {timeout} s (a hang?); output so far:\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# -- NaN/inf points with validate=False terminate -------------------------------------------------

NON_FINITE = """
import itertools, torch, pcops
from tests import reference
ops = [("knn", b) for b in {backends!r}] + [("knn_aggregate", b) for b in {backends!r}] + [("radius_aggregate", "")]
g = torch.Generator().manual_seed(0)
m, n, k = 2100, 2200, 4  # > 2 * 1024 queries: the CPU launch is split across threads
cases = itertools.product(ops, ("query", "ref"), (float("nan"), float("inf"), -float("inf")), (False, True))
for (op, backend), where, value, grouped in cases:
    q, p = torch.rand(m, 3, generator=g, dtype=torch.float64), torch.rand(n, 3, generator=g, dtype=torch.float64)
    f = torch.rand(n, 2, generator=g, dtype=torch.float64)
    bad = torch.tensor([5, 17])
    (q if where == "query" else p)[bad, 1] = value
    kw = dict(query_batch=torch.arange(m) % 2, ref_batch=torch.arange(n) % 2) if grouped else {{}}
    if op == "knn":
        out = pcops.knn(q, p, k, backend, validate=False, **kw)
        assert out.idx.shape == (m, k)
        if not grouped:  # finite queries: the exact kNN among the finite points; NaN/inf points find none
            ok_q = torch.isfinite(q).all(1)
            keep = torch.isfinite(p).all(1).nonzero()[:, 0]
            ref_d, ref_i = reference.knn(q[ok_q], p[keep], k)
            assert torch.equal(out.idx[ok_q], keep[ref_i]), (where, value)
            assert torch.equal(out.idx[~ok_q], torch.full(((~ok_q).sum(), k), -1)), (where, value)
    elif op == "knn_aggregate":
        out = pcops.knn_aggregate(q, p, f, k, 0.1, backend, validate=False, **kw)
        assert out.shape == (m, 2)
    else:
        out = pcops.radius_aggregate(q, p, f, 0.1, 0.1, validate=False, **kw)
        assert out.shape == (m, 2)
    print(op, backend, where, value, grouped, "returned", flush=True)
"""


def test_non_finite_points_without_validation_terminate():
    """knn (every CPU backend), knn_aggregate, radius_aggregate; NaN/inf in query or ref; grouped or not."""
    out = run_python(NON_FINITE.format(backends=CPU_BACKENDS), timeout=300)
    assert out.count("returned") == 7 * 12
