"""pcops.gather against a per-element loop and PyTorch3D's knn_gather written in torch; -1 padding,
gradients, compile."""

import pytest
import torch

import pcops
from tests.compile_check import assert_compiles

F64 = torch.float64


def loop_reference(features: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """One index at a time; padded features index per sample."""
    padded = features.dim() == 3
    out = torch.zeros(*idx.shape, *features.shape[(2 if padded else 1) :], dtype=features.dtype)
    for pos in torch.cartesian_prod(*[torch.arange(s) for s in idx.shape]).reshape(-1, idx.dim()).tolist():
        j = int(idx[tuple(pos)])
        if j >= 0:
            out[tuple(pos)] = features[pos[0], j] if padded else features[j]
    return out


def pytorch3d_knn_gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """PyTorch3D's knn_gather (x (N, P2, U), idx (N, P1, K)) in torch: expand + gather."""
    n, p1, k = idx.shape
    u = x.shape[2]
    expanded = idx[:, :, :, None].expand(-1, -1, -1, u)
    return x[:, :, None].expand(-1, -1, k, -1).gather(1, expanded)


def test_flat_rows_with_padding_match_the_loop(gen):
    features = torch.randn(20, 4, generator=gen, dtype=F64)
    idx = torch.randint(-1, 20, (7, 5), generator=gen)
    out = pcops.gather(features, idx)
    assert out.shape == (7, 5, 4)
    assert torch.equal(out, loop_reference(features, idx))
    assert torch.all(out[idx == -1] == 0)


def test_padded_batches_index_per_sample(gen):
    features = torch.randn(3, 10, 2, generator=gen, dtype=F64)
    idx = torch.randint(-1, 10, (3, 6, 4), generator=gen)
    out = pcops.gather(features, idx)
    assert out.shape == (3, 6, 4, 2)
    assert torch.equal(out, loop_reference(features, idx))
    full = idx.clamp_min(0)
    assert torch.equal(pcops.gather(features, full), pytorch3d_knn_gather(features, full))


def test_any_index_shape_and_1d_features(gen):
    features = torch.randn(9, generator=gen, dtype=F64)
    idx = torch.randint(-1, 9, (2, 3, 4), generator=gen)
    out = pcops.gather(features, idx)
    assert out.shape == (2, 3, 4) and torch.equal(out, loop_reference(features, idx))
    assert pcops.gather(features[:, None].expand(9, 3).contiguous(), idx[0, 0]).shape == (4, 3)


def test_padded_equals_a_per_sample_loop(gen):
    features = torch.randn(4, 8, 3, generator=gen, dtype=F64)
    idx = torch.randint(-1, 8, (4, 5, 2), generator=gen)
    out = pcops.gather(features, idx)
    for b in range(4):
        assert torch.equal(out[b], pcops.gather(features[b], idx[b]))


def test_gradcheck(gen):
    features = torch.randn(12, 3, generator=gen, dtype=F64, requires_grad=True)
    idx = torch.randint(-1, 12, (8, 4), generator=gen)  # repeated rows accumulate
    assert torch.autograd.gradcheck(lambda f: pcops.gather(f, idx), (features,))
    padded = torch.randn(2, 6, 3, generator=gen, dtype=F64, requires_grad=True)
    pidx = torch.randint(-1, 6, (2, 5, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda f: pcops.gather(f, pidx), (padded,))


def test_gradient_counts_each_use_and_skips_padding():
    features = torch.zeros(3, 1, dtype=F64, requires_grad=True)
    pcops.gather(features, torch.tensor([[0, 0, -1], [2, -1, -1]])).sum().backward()
    assert features.grad[:, 0].tolist() == [2, 0, 1]


def test_padding_never_reads_row_zero():
    features = torch.tensor([[float("nan")], [1.0]], requires_grad=True)
    out = pcops.gather(features, torch.tensor([-1, 1]))
    assert out[:, 0].tolist() == [0.0, 1.0]


def test_dtypes_are_kept(gen):
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int64):
        features = (torch.randn(5, 2, generator=gen) * 10).to(dtype)
        out = pcops.gather(features, torch.tensor([4, -1, 0]))
        assert out.dtype == dtype and torch.equal(out, loop_reference(features, torch.tensor([4, -1, 0])))


def test_bad_inputs_raise(gen):
    f = torch.randn(5, 2, generator=gen)
    i = torch.tensor([[0, 1]])
    cases = {
        "list features": (lambda: pcops.gather([1.0], i), TypeError, "features must be a torch.Tensor"),
        "float idx": (lambda: pcops.gather(f, i.float()), TypeError, "idx must have an integer dtype"),
        "4-d features": (lambda: pcops.gather(f[None, None], i), ValueError, "features must be a tensor of shape"),
        "padded batch": (lambda: pcops.gather(f[None].expand(2, 5, 2), i), ValueError, r"idx must be a tensor of shape \(B, ...\)"),
        "idx too large": (lambda: pcops.gather(f, i + 4), ValueError, r"idx values must be in \[-1, N\)"),
        "idx below -1": (lambda: pcops.gather(f, i - 2), ValueError, "idx values must be in"),
    }
    for name, (call, error, match) in cases.items():
        with pytest.raises(error, match=match):
            call()


def test_compile_fullgraph(gen):
    def fn(features, idx, padded, pidx):
        return pcops.gather(features, idx), pcops.gather(padded, pidx)

    calls = []
    for n, m in ((10, 4), (17, 9)):
        calls.append((
            torch.randn(n, 3, generator=gen).requires_grad_(), torch.randint(-1, n, (m, 5), generator=gen),
            torch.randn(2, n, 3, generator=gen).requires_grad_(), torch.randint(-1, n, (2, m, 5), generator=gen),
        ))
    assert_compiles(fn, calls, ops=("index_select",), backend="aot_eager")


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    features = torch.randn(1000, 8, generator=gen)
    idx = torch.randint(-1, 1000, (500, 16), generator=gen)
    assert torch.equal(pcops.gather(features.cuda(), idx.cuda()).cpu(), pcops.gather(features, idx))


def test_an_empty_table_with_only_padding_indices_gives_zeros():
    # a defect: index_select of row 0 of an empty table raised a raw torch error
    for features, idx, shape in (
        (torch.zeros(0, 4), torch.full((3, 2), -1), (3, 2, 4)),
        (torch.zeros(2, 0, 4), torch.full((2, 3, 2), -1), (2, 3, 2, 4)),
    ):
        out = pcops.gather(features, idx)
        assert out.shape == shape and not out.any()


def test_unchecked_indices_out_of_range_give_zeros_not_a_read_out_of_bounds():
    features = torch.arange(12.0).reshape(4, 3)
    idx = torch.tensor([[0, 4, -7], [3, 10**9, -1]])
    out = pcops.gather(features, idx, validate=False)
    expect = torch.stack([torch.stack([features[0], torch.zeros(3), torch.zeros(3)]),
                          torch.stack([features[3], torch.zeros(3), torch.zeros(3)])])
    assert torch.equal(out, expect)
    padded = features.reshape(2, 2, 3)
    out = pcops.gather(padded, torch.tensor([[1, 2], [-2, 0]]), validate=False)
    assert torch.equal(out, torch.stack([torch.stack([padded[0, 1], torch.zeros(3)]), torch.stack([torch.zeros(3), padded[1, 0]])]))


def test_a_0d_index_and_every_integer_dtype(gen):
    """A 0-d index gathers one row (a scalar of 1-d features; view(*()) failed), and indices of
    every integer dtype gather what int64 ones do, validated against [-1, N): the bounds are
    compared in int64 where the dtype cannot hold them (uint8 >= -1 wrapped -1 to 255 and
    rejected every valid index; int8 >= -200 would be False)."""
    f = torch.randn(5, 3, generator=gen)
    assert torch.equal(pcops.gather(f[:, 0], torch.tensor(2)), f[2, 0])
    assert torch.equal(pcops.gather(f, torch.tensor(4)), f[4])
    want = pcops.gather(f, torch.tensor([[4, 0], [2, -1]]))
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
        idx = torch.tensor([[4, 0], [2, -1 if dtype.is_signed else 0]], dtype=dtype)
        got = pcops.gather(f, idx)
        assert torch.equal(got, want if dtype.is_signed else torch.stack([want[0], torch.stack([f[2], f[0]])]))
        with pytest.raises(ValueError, match=r"^idx values must be in \[-1, N\) = \[-1, 5\)"):
            pcops.gather(f, torch.tensor([5], dtype=dtype))
    with pytest.raises(ValueError, match="idx values must be"):
        pcops.gather(f, torch.tensor([-2], dtype=torch.int8))
    ids = torch.tensor([1, 0, 1], dtype=torch.uint8)  # (ids of segments: the same rule)
    assert torch.equal(pcops.segment_reduce(f[:3], ids=ids, num_segments=2), pcops.segment_reduce(f[:3], ids=ids.long(), num_segments=2))
