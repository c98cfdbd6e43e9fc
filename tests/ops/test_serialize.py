"""pcops.serialize: space-filling-curve codes against a plain-Python reference written from the
definitions (Morton interleaving; Skilling's Hilbert transform, paper form), hand-derived
values on 2x2x2 and 4x4x4 grids, and the Hilbert curve's locality."""

import importlib
import itertools

import pytest
import torch
import warp as wp

import pcops
from pcops import _warp
from tests.compile_check import assert_compiles

serialize_module = importlib.import_module("pcops.ops.serialize")  # pcops.ops.serialize is the function

ORDERS = ("z", "z-trans", "hilbert", "hilbert-trans")


# -- reference: one point at a time, bit by bit -------------------------------------------------


def ref_morton(x: int, y: int, z: int, depth: int) -> int:
    code = 0
    for i in range(depth):
        code |= ((x >> i) & 1) << (3 * i + 2)
        code |= ((y >> i) & 1) << (3 * i + 1)
        code |= ((z >> i) & 1) << (3 * i)
    return code


def ref_hilbert(x: int, y: int, z: int, depth: int) -> int:
    """Skilling (2004), AxestoTranspose for n = 3 as printed in the paper, then the transposed
    index read out bit by bit (level b from the top, axis 0 first)."""
    X = [x, y, z]
    M = 1 << (depth - 1)
    Q = M
    while Q > 1:  # inverse undo
        P = Q - 1
        for i in range(3):
            if X[i] & Q:
                X[0] ^= P
            else:
                t = (X[0] ^ X[i]) & P
                X[0] ^= t
                X[i] ^= t
        Q >>= 1
    for i in range(1, 3):  # Gray encode
        X[i] ^= X[i - 1]
    t = 0
    Q = M
    while Q > 1:
        if X[2] & Q:
            t ^= Q - 1
        Q >>= 1
    for i in range(3):
        X[i] ^= t
    code = 0
    for b in range(depth - 1, -1, -1):
        for i in range(3):
            code = (code << 1) | ((X[i] >> b) & 1)
    return code


def ref_code(point, batch: int, depth: int, order: str) -> int:
    x, y, z = point
    if order.endswith("-trans"):
        x, y = y, x
    curve = ref_morton(x, y, z, depth) if order.startswith("z") else ref_hilbert(x, y, z, depth)
    return (batch << (3 * depth)) | curve


def all_cells(depth: int) -> torch.Tensor:
    side = 2**depth
    return torch.tensor(list(itertools.product(range(side), repeat=3)), dtype=torch.int32)


# -- against the reference ----------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("depth", [1, 2, 3, 7, 11, 16])
def test_codes_match_the_bitwise_reference(gen, order, depth):
    n = 300
    grid = torch.randint(0, 2**depth, (n, 3), generator=gen, dtype=torch.int32)
    grid[0] = 0
    grid[1] = 2**depth - 1  # the corners
    batch = torch.randint(0, 5, (n,), generator=gen)
    out = pcops.serialize(grid, batch, depth=depth, order=order)
    expected = torch.tensor([ref_code(p, int(b), depth, order) for p, b in zip(grid.tolist(), batch)])
    assert out.code.dtype == torch.int64 and torch.equal(out.code, expected)


def test_largest_batch_id_that_fits_in_63_bits():
    grid = torch.tensor([[65535, 65535, 65535]])
    batch = torch.tensor([2**15 - 1])
    code = pcops.serialize(grid, batch, depth=16, order="hilbert").code
    assert int(code) == ((2**15 - 1) << 48) | ref_hilbert(65535, 65535, 65535, 16)
    assert int(code) > 0 and int(code) < 2**63


# -- hand-derived values --------------------------------------------------------------------------


def test_z_order_of_the_2x2x2_grid_is_4x_plus_2y_plus_z():
    cells = all_cells(1)
    code = pcops.serialize(cells, depth=1, order="z").code
    assert code.tolist() == [4 * x + 2 * y + z for x, y, z in cells.tolist()]


def test_z_order_by_hand_on_4x4x4():
    # (1, 2, 3): x = 01, y = 10, z = 11 -> level 0: (1, 0, 1) = 5, level 1: (0, 1, 1) = 3 -> 3 * 8 + 5
    grid = torch.tensor([[1, 2, 3], [3, 3, 3], [0, 0, 1], [2, 0, 0]])
    assert pcops.serialize(grid, depth=2, order="z").code.tolist() == [29, 63, 1, 32]
    # "-trans" swaps x and y first: (2, 1, 3) -> level 0: (0, 1, 1) = 3, level 1: (1, 0, 1) = 5
    assert pcops.serialize(grid[:1], depth=2, order="z-trans").code.tolist() == [43]


def test_hilbert_visits_the_2x2x2_grid_as_a_gray_code():
    # depth 1: code = 4x + 2(x^y) + (x^y^z); its visiting order, derived by hand
    visit = [(0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 0), (1, 1, 0), (1, 1, 1), (1, 0, 1), (1, 0, 0)]
    code = pcops.serialize(torch.tensor(visit), depth=1, order="hilbert").code
    assert code.tolist() == list(range(8))
    trans = pcops.serialize(torch.tensor(visit)[:, [1, 0, 2]], depth=1, order="hilbert-trans").code
    assert trans.tolist() == list(range(8))


def test_hilbert_on_4x4x4_starts_at_the_origin_ends_next_to_it_and_keeps_octants_together():
    cells = all_cells(2)
    out = pcops.serialize(cells, depth=2, order="hilbert")
    path = cells[out.order]
    assert sorted(out.code.tolist()) == list(range(64))  # a bijection onto 0 .. 63
    assert path[0].tolist() == [0, 0, 0] and path[-1].tolist() == [3, 0, 0]
    # first octant, by hand: the top bits are 0, so the inverse undo swaps the low bits of X0
    # with X1, then with X2: (x, y, z) -> (z, x, y); the Gray step makes the low triple
    # (z, z^x, z^x^y), i.e. code = 4z + 2(z^x) + (z^x^y) for codes 0 .. 7
    assert path[:8].tolist() == [[0, 0, 0], [0, 1, 0], [1, 1, 0], [1, 0, 0], [1, 0, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1]]
    # the octants are visited in the depth-1 order
    octants = (path >> 1).reshape(8, 8, 3)
    assert torch.all(octants == octants[:, :1])
    assert octants[:, 0].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 1], [0, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 1], [1, 0, 0]]


# -- locality ------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["hilbert", "hilbert-trans"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_consecutive_hilbert_codes_are_face_adjacent_cells(order, depth):
    cells = all_cells(depth)
    out = pcops.serialize(cells, depth=depth, order=order)
    assert torch.equal(out.code[out.order], torch.arange(cells.shape[0]))  # every cell once
    steps = (cells[out.order][1:] - cells[out.order][:-1]).abs().sum(1)
    assert torch.all(steps == 1)


@pytest.mark.parametrize("order", ORDERS)
def test_every_aligned_run_of_8_to_the_j_codes_is_a_cube(order):
    # what serialized pooling relies on: code >> 3j is the code of grid_coord >> j at depth - j
    depth = 4
    cells = all_cells(depth)
    code = pcops.serialize(cells, depth=depth, order=order).code
    for j in range(1, depth):
        coarse = pcops.serialize(cells >> j, depth=depth - j, order=order).code
        assert torch.equal(code >> (3 * j), coarse)


def test_hilbert_is_more_local_than_z_order(gen):
    cells = all_cells(4)
    jumps = {}
    for order in ("z", "hilbert"):
        path = cells[pcops.serialize(cells, depth=4, order=order).order].float()
        jumps[order] = (path[1:] - path[:-1]).norm(dim=1).max()
    assert jumps["hilbert"] == 1 and jumps["z"] > 10


# -- orders, batches, sort ---------------------------------------------------------------------


def test_a_list_of_orders_stacks_the_single_orders(gen):
    grid = torch.randint(0, 64, (200, 3), generator=gen)
    batch = torch.randint(0, 3, (200,), generator=gen)
    many = pcops.serialize(grid, batch, depth=6, order=["hilbert", "z", "z-trans", "hilbert-trans"])
    assert many.code.shape == many.order.shape == many.inverse.shape == (4, 200)
    for k, order in enumerate(["hilbert", "z", "z-trans", "hilbert-trans"]):
        one = pcops.serialize(grid, batch, depth=6, order=order)
        assert torch.equal(many.code[k], one.code) and torch.equal(many.order[k], one.order)
        assert torch.equal(many.inverse[k], one.inverse)
    assert pcops.serialize(grid, depth=6, order=("z",)).code.shape == (1, 200)


def test_order_is_a_stable_argsort_and_inverse_its_inverse(gen):
    grid = torch.randint(0, 4, (300, 3), generator=gen)  # many repeated cells: ties keep input order
    out = pcops.serialize(grid, depth=2, order="hilbert")
    assert torch.equal(out.order, torch.sort(out.code, stable=True).indices)
    assert torch.equal(out.order[out.inverse], torch.arange(300))
    assert torch.equal(out.inverse[out.order], torch.arange(300))


def test_batch_equals_a_per_sample_loop_with_the_id_above_bit_3_depth(gen):
    sizes = [40, 0, 7, 1]
    grids = [torch.randint(0, 32, (n, 3), generator=gen) for n in sizes]
    batch = torch.cat([torch.full((n,), b) for b, n in enumerate(sizes)])
    perm = torch.randperm(batch.numel(), generator=gen)  # samples interleaved
    grid, batch = torch.cat(grids)[perm], batch[perm]
    out = pcops.serialize(grid, batch, depth=5, order="hilbert")
    for b, g in enumerate(grids):
        rows = batch == b  # sample b's points, as packed
        alone = pcops.serialize(grid[rows], depth=5, order="hilbert").code
        assert torch.equal(out.code[rows], alone + (b << 15))
        assert torch.equal(torch.sort(alone).values, torch.sort(pcops.serialize(g, depth=5, order="hilbert").code).values)
    assert torch.all(batch[out.order][1:] >= batch[out.order][:-1])  # a sample's points sort together


def test_depth_none_takes_the_bits_of_the_largest_coordinate():
    grid = torch.tensor([[0, 5, 2], [1, 1, 1]])
    assert torch.equal(pcops.serialize(grid, depth=None).code, pcops.serialize(grid, depth=3).code)


def test_empty_cloud():
    out = pcops.serialize(torch.zeros(0, 3, dtype=torch.int32), order=["z", "hilbert"])
    assert out.code.shape == out.order.shape == (2, 0)


def test_bad_inputs_raise(gen):
    g = torch.randint(0, 8, (10, 3), generator=gen)
    s = pcops.serialize
    cases = {
        "float grid_coord": (lambda: s(g.float()), TypeError, "grid_coord must have an integer dtype"),
        "grid_coord shape": (lambda: s(g[:, :2]), ValueError, r"grid_coord must be a tensor of shape \(N, 3\)"),
        "negative grid_coord": (lambda: s(g - 1, depth=3), ValueError, "grid_coord values must be in"),
        "grid_coord too large": (lambda: s(g, depth=2), ValueError, r"grid_coord values must be in \[0, 2\*\*depth\)"),
        "depth 0": (lambda: s(g, depth=0), ValueError, "depth must be in"),
        "depth 17": (lambda: s(g, depth=17), ValueError, "depth must be in"),
        "float depth": (lambda: s(g, depth=3.0), TypeError, "depth must be an int"),
        "order": (lambda: s(g, order="peano"), ValueError, "order must be one of"),
        "empty order list": (lambda: s(g, order=[]), TypeError, "order must be one of"),
        "batch dtype": (lambda: s(g, torch.zeros(10)), TypeError, "batch must have an integer dtype"),
        "batch shape": (lambda: s(g, torch.zeros(9, dtype=torch.long)), ValueError, "batch must be a tensor of shape"),
        "negative batch": (lambda: s(g, -torch.ones(10, dtype=torch.long)), ValueError, "batch values must be in"),
        "batch beyond 63 bits": (lambda: s(g, torch.full((10,), 2**15), depth=16), ValueError, "batch values must be in"),
    }
    for name, (call, error, match) in cases.items():
        with pytest.raises(error, match=match):
            call()


# -- compile promises ------------------------------------------------------------------------


def test_opcheck(gen):
    g = torch.randint(0, 16, (50, 3), generator=gen, dtype=torch.int32)
    b = torch.randint(0, 3, (50,), generator=gen)
    op = torch.ops.pcops.serialize_codes.default
    torch.library.opcheck(op, (g, None, 4, [0]))
    torch.library.opcheck(op, (g.long(), b, 16, [2, 3, 1, 0]))


def test_compile_fullgraph_dynamic_sizes(gen):
    def fn(grid, batch):
        return tuple(pcops.serialize(grid, batch, depth=8, order=["z", "hilbert"]))

    calls = [(torch.randint(0, 256, (n, 3), generator=gen), torch.randint(0, 2, (n,), generator=gen)) for n in (30, 47)]
    assert_compiles(fn, calls, backend="aot_eager")


def test_kernel_compiles_for_a_gpu(tmp_path):
    _warp.init()
    kernel = serialize_module._codes_kernel()
    try:
        paths = wp.compile_aot_module(kernel.module, arch=90, module_dir=tmp_path, use_ptx=True)
    except Exception as err:  # noqa: BLE001 (no NVRTC in this Warp build)
        pytest.skip(f"Warp cannot compile for a GPU here: {err}")
    assert any(str(p).endswith(".ptx") and p.stat().st_size > 0 for p in paths)


@pytest.mark.cuda
def test_cuda_matches_cpu(gen):
    grid = torch.randint(0, 2**16, (10_000, 3), generator=gen)
    batch = torch.randint(0, 8, (10_000,), generator=gen)
    cpu = pcops.serialize(grid, batch, order=list(ORDERS))
    gpu = pcops.serialize(grid.cuda(), batch.cuda(), order=list(ORDERS))
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())
