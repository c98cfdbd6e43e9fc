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
from tests.compile_check import assert_compiles, compiled_breaks

serialize_module = importlib.import_module("pcops.ops.sparse.serialize")  # pcops.ops.sparse.serialize is the function

ORDERS = ("z", "z-trans", "hilbert", "hilbert-trans")
F64 = torch.float64


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


def test_z_order_and_the_knn_query_order_share_one_morton_bit_spread(gen):
    # one definition (pcops._warp_funcs.spread): serialize's z codes are the Morton table
    # (the kd-tree's and the mesh hierarchy's) interleaved, x highest, on an 8^3 lattice across a
    # 2^10 grid and at random cells; the hierarchy's torch codes are the same table, z highest
    from pcops import _morton

    table = _morton.spread_table(10, torch.device("cpu")).long()
    assert torch.equal(table, torch.tensor([ref_morton(0, 0, c, 10) for c in range(1024)]))
    cells = torch.cat([all_cells(3) * 127, torch.randint(0, 1024, (5000, 3), generator=gen)])
    code = pcops.serialize(cells, depth=10, order="z").code
    assert torch.equal(code, table[cells[:, 0]] << 2 | table[cells[:, 1]] << 1 | table[cells[:, 2]])
    assert torch.equal(_morton.codes(cells.flip(1)), code)


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


def test_depth_none_takes_pointcepts_adaptive_depth():
    """Pointcept's ``int(grid_coord.max() + 1).bit_length()``: 3 bits for a largest coordinate of
    5 or 6, 4 for 7 (2**3 - 1), 16 for 65534; for 65535 that rule gives 17 bits, an error that says
    so (depth=16 takes it)."""
    for top, bits in ((5, 3), (6, 3), (7, 4), (8, 4), (1, 2), (0, 1), (2**16 - 2, 16)):
        grid = torch.tensor([[0, top, 0], [top // 2, 0, top]])
        for order in ("z", "hilbert"):
            assert torch.equal(pcops.serialize(grid, depth=None, order=order).code, pcops.serialize(grid, depth=bits, order=order).code)
    # a coordinate of 2**16 - 1 or more: the data's fault, not a depth the caller never gave
    for top in (2**16 - 1, 2**16):
        with pytest.raises(ValueError, match=rf"^grid_coord values must be below 2\*\*16 - 1 = 65535 with depth=None .*got max {top}$"):
            pcops.serialize(torch.tensor([[top, 0, 0]]), depth=None)
    assert pcops.serialize(torch.tensor([[2**16 - 1, 0, 0]]), depth=16).code.shape == (1,)  # (depth 16 takes it)
    with pytest.raises(ValueError, match=r"^grid_coord values must be in \[0, .*got min -100000"):  # (not "below 65535 ... got max -100000")
        pcops.serialize(torch.full((2, 3), -100000), depth=None)


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


# -- serialized pooling (PTv3's SerializedPooling / SerializedUnpooling) ----------------------------


def pool_reference(code0, k, features, coord, grid_coord, batch, reduce):
    """A dictionary of parents keyed by code >> 3k, float64, one point at a time."""
    groups = {}
    for i, c in enumerate(code0.tolist()):
        groups.setdefault(c >> (3 * k), []).append(i)
    keys = sorted(groups)
    cluster = torch.empty(code0.shape[0], dtype=torch.int64)
    feats, coords, grids, batches, heads = [], [], [], [], []
    for v, key in enumerate(keys):
        rows = groups[key]
        cluster[rows] = v
        heads.append(rows[0])
        f = features[rows].double()
        feats.append({"sum": f.sum(0), "mean": f.mean(0), "max": f.max(0).values, "min": f.min(0).values}[reduce])
        coords.append(coord[rows].double().mean(0))
        grids.append(grid_coord[rows[0]] >> k)
        batches.append(batch[rows[0]])
    return dict(code=torch.tensor(keys, dtype=torch.int64), features=torch.stack(feats), coord=torch.stack(coords),
                grid_coord=torch.stack(grids), batch=torch.stack(batches), cluster=cluster, head=torch.tensor(heads))


def pool_inputs(gen, n=300, depth=5):
    grid = torch.randint(0, 2**depth, (n, 3), generator=gen)
    batch = torch.randint(0, 3, (n,), generator=gen)
    features = torch.randn(n, 4, generator=gen, dtype=F64)
    coord = (grid + torch.rand(n, 3, generator=gen, dtype=F64)) * 0.02
    return grid, batch, features, coord


@pytest.mark.parametrize("reduce", ["max", "mean", "sum", "min"])
@pytest.mark.parametrize("k", [1, 2])
def test_pool_matches_a_dictionary_of_parents(gen, reduce, k):
    grid, batch, features, coord = pool_inputs(gen)
    code = pcops.serialize(grid, batch, depth=5, order=["hilbert", "z"]).code
    out = pcops.serialized_pool(code, k, features, coord, grid, batch, reduce=reduce)
    expected = pool_reference(code[0], k, features, coord, grid, batch, reduce)
    assert torch.equal(out.code[0], expected["code"])
    for name in ("cluster", "head", "grid_coord", "batch"):
        assert torch.equal(getattr(out, name), expected[name]), name
    torch.testing.assert_close(out.features, expected["features"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.coord, expected["coord"], rtol=1e-12, atol=1e-12)
    # Pointcept's own construction: unique(code[0] >> 3k) with its inverse
    parents, cluster = torch.unique(code[0] >> (3 * k), sorted=True, return_inverse=True)
    assert torch.equal(out.code[0], parents) and torch.equal(out.cluster, cluster)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_pooled_codes_are_the_codes_of_the_coarser_grid(gen, k):
    grid, batch, _, _ = pool_inputs(gen, depth=6)
    orders = ["z", "z-trans", "hilbert", "hilbert-trans"]
    fine = pcops.serialize(grid, batch, depth=6, order=orders)
    out = pcops.serialized_pool(fine.code, k, grid_coord=grid, batch=batch)
    coarse = pcops.serialize(out.grid_coord, out.batch, depth=6 - k, order=orders)
    assert torch.equal(out.code, coarse.code)
    assert torch.equal(out.order, coarse.order) and torch.equal(out.inverse, coarse.inverse)


def test_pooling_depth_0_merges_only_points_of_one_cell():
    grid = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 1], [1, 1, 1]])
    out = pcops.serialized_pool(pcops.serialize(grid, depth=1).code, 0, grid_coord=grid)
    assert out.cluster.tolist() == [1, 0, 1, 1] and out.head.tolist() == [1, 0]
    assert out.grid_coord.tolist() == [[0, 0, 0], [1, 1, 1]]


def test_unpool_gives_each_point_its_parent_features(gen):
    grid, batch, features, coord = pool_inputs(gen)
    code = pcops.serialize(grid, batch, depth=5).code
    out = pcops.serialized_pool(code, 1, features, reduce="mean")
    back = pcops.serialized_unpool(out.features, out.cluster)
    assert back.shape == features.shape
    for i in range(0, 300, 37):
        members = out.cluster == out.cluster[i]
        torch.testing.assert_close(back[i], features[members].mean(0))


def _pool_against_a_per_sample_loop(gen, **bound):
    """serialized_pool of a shuffled packed batch (an empty sample included) against each sample
    pooled alone: the same parents in sample order; returns (result, parents of all samples)."""
    sizes = [50, 0, 9, 1]
    grids = [torch.randint(0, 16, (n, 3), generator=gen) for n in sizes]
    feats = [torch.randn(n, 3, generator=gen, dtype=F64) for n in sizes]
    batch = torch.cat([torch.full((n,), b) for b, n in enumerate(sizes)])
    perm = torch.randperm(batch.numel(), generator=gen)
    grid, features, batch = torch.cat(grids)[perm], torch.cat(feats)[perm], batch[perm]
    code = pcops.serialize(grid, batch, depth=4, order="hilbert").code
    out = pcops.serialized_pool(code, 1, features, grid_coord=grid, batch=batch, **bound)
    first = 0
    for b in range(len(sizes)):
        rows = batch == b
        alone = pcops.serialized_pool(pcops.serialize(grid[rows], depth=4, order="hilbert").code, 1, features[rows], grid_coord=grid[rows])
        v = alone.features.shape[0]
        assert torch.equal(out.features[first : first + v], alone.features)
        assert torch.equal(out.grid_coord[first : first + v], alone.grid_coord)
        assert torch.equal(out.code[first : first + v], alone.code + (b << 9))
        assert torch.all(out.batch[first : first + v] == b)
        assert torch.equal(out.cluster[rows] - first, alone.cluster)
        first += v
    return out, first


def test_pool_batch_equals_a_per_sample_loop(gen):
    out, first = _pool_against_a_per_sample_loop(gen)
    assert first == out.features.shape[0]


@pytest.mark.parametrize("reduce", ["max", "mean", "sum", "min"])
def test_pool_and_unpool_gradcheck(gen, reduce):
    grid, batch, features, coord = pool_inputs(gen, n=40, depth=3)
    code = pcops.serialize(grid, batch, depth=3).code

    def fn(f, c):
        out = pcops.serialized_pool(code, 1, f, c, reduce=reduce)
        return out.features, out.coord, pcops.serialized_unpool(out.features, out.cluster)

    assert torch.autograd.gradcheck(fn, (features.requires_grad_(), coord.requires_grad_()))


def test_pool_empty_cloud():
    code = pcops.serialize(torch.zeros(0, 3, dtype=torch.long), depth=4).code
    out = pcops.serialized_pool(code, 1, torch.zeros(0, 2), torch.zeros(0, 3))
    assert out.code.shape == (0,) and out.features.shape == (0, 2) and out.cluster.shape == (0,)


def test_pool_bad_inputs_raise(gen):
    grid, batch, features, coord = pool_inputs(gen, n=10)
    code = pcops.serialize(grid, depth=5).code
    sp = pcops.serialized_pool
    cases = {
        "int32 code": (lambda: sp(code.int()), TypeError, "code must be int64"),
        "3-d code": (lambda: sp(code[None, None]), ValueError, "code must be a tensor of shape"),
        "negative pooling_depth": (lambda: sp(code, -1), ValueError, "pooling_depth must be in"),
        "float pooling_depth": (lambda: sp(code, 1.0), TypeError, "pooling_depth must be an int"),
        "reduce": (lambda: sp(code, 1, features, reduce="prod"), ValueError, "reduce must be one of"),
        "feature rows": (lambda: sp(code, 1, features[:9]), ValueError, "features and code must have the same number of points N, got 9 and"),
        "int features": (lambda: sp(code, 1, grid), TypeError, "features must have a floating dtype"),
        "coord shape": (lambda: sp(code, 1, coord=coord[:, :2]), ValueError, "coord must be a tensor of shape"),
        "grid_coord dtype": (lambda: sp(code, 1, grid_coord=coord), TypeError, "grid_coord must have an integer dtype"),
        "batch rows": (lambda: sp(code, 1, batch=batch[:3]), ValueError, "batch must be a tensor of shape"),
        "unpool cluster range": (lambda: pcops.serialized_unpool(features[:2], torch.tensor([0, 2])), ValueError, "cluster values"),
        "unpool cluster dtype": (lambda: pcops.serialized_unpool(features, torch.zeros(3)), TypeError, "cluster must have an integer dtype"),
    }
    for name, (call, error, match) in cases.items():
        with pytest.raises(error, match=match):
            call()


def test_pool_opcheck(gen):
    code = pcops.serialize(torch.randint(0, 8, (60, 3), generator=gen), torch.randint(0, 2, (60,), generator=gen), depth=3).code
    for shift in (0, 3, 6):
        torch.library.opcheck(torch.ops.pcops.serialized_cluster.default, (code, shift))


def test_pool_compiles_fullgraph_with_a_dynamic_number_of_parents(gen):
    def fn(grid, batch, features, coord):
        s = pcops.serialize(grid, batch, depth=4, order=["hilbert", "z-trans"])
        out = pcops.serialized_pool(s.code, 1, features, coord, grid, batch, reduce="max")
        return out.code, out.features, out.coord, pcops.serialized_unpool(out.features, out.cluster), out.grid_coord

    calls = []
    for n in (40, 57):
        grid = torch.randint(0, 16, (n, 3), generator=gen)
        calls.append((grid, torch.randint(0, 2, (n,), generator=gen), torch.randn(n, 3, generator=gen).requires_grad_(),
                      (grid * 0.1).float().requires_grad_()))
    assert_compiles(fn, calls, ops=("pcops.serialize_codes", "pcops.serialized_cluster", "pcops.segment_reduce"), backend="aot_eager")


# -- bounded pooling: max_clusters (static shapes, padded rows, the true count) -------------------

INDEX_FIELDS = ("code", "order", "inverse", "grid_coord", "batch", "head")  # padded with -1 (features, coord: 0)


def assert_padded_pool(out, full, bound):
    """``out`` (bounded) holds ``full``'s (unbounded) first min(V, bound) parents, then padding;
    cluster -1 for the points of dropped parents; count V. With overflow, order / inverse are
    the argsort of the kept parents (compared by the codes they sort)."""
    SP = serialize_module.SerializedPool
    v = full.head.shape[0]
    keep = min(v, bound)
    assert type(out) is serialize_module.SerializedPoolPadded and type(full) is SP and out._fields == (*SP._fields, "count")
    assert out.count.dtype == torch.int64 and out.count.shape == () and int(out.count) == v
    assert torch.equal(out.cluster, torch.where(full.cluster < bound, full.cluster, -1))
    for name in SP._fields:
        a, e = getattr(out, name), getattr(full, name)
        if name == "cluster" or e is None:
            assert (a is None) == (e is None), name
            continue
        rows_a, rows_e = (a, e) if name in ("code", "order", "inverse") and e.dim() == 2 else (a[None], e[None])  # parents along dim 1
        assert rows_a.shape[1] == bound and rows_a.shape[2:] == rows_e.shape[2:] and a.dtype == e.dtype, name
        assert torch.all(rows_a[:, keep:] == (0 if a.dtype.is_floating_point else -1)), name
        if name in ("order", "inverse") and keep < v:
            continue
        assert torch.equal(rows_a[:, :keep], rows_e[:, :keep]), name
    codes = out.code if out.code.dim() == 2 else out.code[None]
    order = out.order if out.order.dim() == 2 else out.order[None]
    for c, o in zip(codes, order):  # order sorts the kept parents' codes
        assert torch.equal(c[o[:keep]], torch.sort(c[:keep], stable=True).values)
        assert torch.equal(o[:keep], torch.sort(c[:keep], stable=True).indices)


@pytest.mark.parametrize("reduce", ["max", "mean", "sum", "min"])
@pytest.mark.parametrize("extra", [0, 11, -100], ids=["exact", "padded", "overflow"])
def test_bounded_pool_equals_unbounded_on_the_first_count_rows(gen, reduce, extra):
    grid, batch, features, coord = pool_inputs(gen)
    code = pcops.serialize(grid, batch, depth=5, order=["hilbert", "z"]).code
    full = pcops.serialized_pool(code, 1, features, coord, grid, batch, reduce=reduce)
    v = full.head.shape[0]
    assert v > 100
    out = pcops.serialized_pool(code, 1, features, coord, grid, batch, reduce=reduce, max_clusters=v + extra)
    assert_padded_pool(out, full, v + extra)
    expected = pool_reference(code[0], 1, features, coord, grid, batch, reduce)  # the independent reference
    keep = min(v, v + extra)
    for name in ("grid_coord", "batch", "head"):
        assert torch.equal(getattr(out, name)[:keep], expected[name][:keep]), name
    assert torch.equal(out.code[0, :keep], expected["code"][:keep])
    torch.testing.assert_close(out.features[:keep], expected["features"][:keep], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.coord[:keep], expected["coord"][:keep], rtol=1e-12, atol=1e-12)


def test_bounded_pool_of_one_order_and_no_attributes(gen):
    grid = torch.randint(0, 8, (60, 3), generator=gen)
    code = pcops.serialize(grid, depth=3).code
    full = pcops.serialized_pool(code, 1)
    for bound in (3, 100):
        assert_padded_pool(pcops.serialized_pool(code, 1, max_clusters=bound), full, bound)


def test_bounded_pool_batch_equals_a_per_sample_loop(gen):
    out, first = _pool_against_a_per_sample_loop(gen, max_clusters=80)
    assert int(out.count) == first and torch.all(out.batch[first:] == -1)


def test_bounded_pool_overflow_drops_the_last_parents_and_marks_their_points(gen):
    grid, batch, features, _ = pool_inputs(gen, n=80)
    code = pcops.serialize(grid, batch, depth=5).code
    full = pcops.serialized_pool(code, 1, features, batch=batch, reduce="sum")
    out = pcops.serialized_pool(code, 1, features, batch=batch, reduce="sum", max_clusters=10)
    assert int(out.count) == full.head.shape[0] > 10 and out.features.shape == (10, 4)
    dropped = full.cluster >= 10
    assert torch.all(out.cluster[dropped] == -1) and torch.equal(out.cluster[~dropped], full.cluster[~dropped])
    assert torch.equal(out.features, full.features[:10])  # the kept sums hold none of the dropped points
    x = features.clone().requires_grad_()
    (g,) = torch.autograd.grad(pcops.serialized_pool(code, 1, x, max_clusters=10, reduce="sum").features.sum(), x)
    assert torch.all(g[dropped] == 0) and torch.all(g[~dropped] == 1)


def test_bounded_pool_empty_cloud_is_all_padding():
    code = pcops.serialize(torch.zeros(0, 3, dtype=torch.long), depth=4, order=["z", "hilbert"]).code
    out = pcops.serialized_pool(code, 1, torch.zeros(0, 2), torch.zeros(0, 3), max_clusters=3)
    assert out.code.shape == out.order.shape == (2, 3) and torch.all(out.code == -1) and torch.all(out.order == -1)
    assert out.features.shape == (3, 2) and torch.all(out.features == 0) and out.head.tolist() == [-1] * 3
    assert out.cluster.shape == (0,) and int(out.count) == 0


@pytest.mark.parametrize("reduce, extra", [("mean", 3), ("max", -2)], ids=["padded-mean", "overflow-max"])
def test_bounded_pool_gradcheck(gen, reduce, extra):
    grid, batch, features, coord = pool_inputs(gen, n=24, depth=3)
    code = pcops.serialize(grid, batch, depth=3).code
    m = pcops.serialized_pool(code, 1).head.shape[0] + extra  # overflowing: the dropped points get zero gradient

    def fn(f, c):
        out = pcops.serialized_pool(code, 1, f, c, reduce=reduce, max_clusters=m)
        return out.features, out.coord

    assert torch.autograd.gradcheck(fn, (features.clone().requires_grad_(), coord.clone().requires_grad_()))


def test_bounded_pool_opcheck(gen):
    code = pcops.serialize(torch.randint(0, 8, (60, 3), generator=gen), torch.randint(0, 2, (60,), generator=gen), depth=3).code
    op = torch.ops.pcops.serialized_cluster.default
    for shift in (0, 3, 6):
        for size in (-1, 1, 5, 100):
            torch.library.opcheck(op, (code, shift, size))
    torch.library.opcheck(op, (code[:0], 3, 4))


def _pool_fn(max_clusters):
    def fn(grid, batch, features, coord):
        s = pcops.serialize(grid, batch, depth=4, order=["hilbert", "z-trans"])
        out = pcops.serialized_pool(s.code, 1, features, coord, grid, batch, reduce="max", max_clusters=max_clusters)
        return (*(x for x in out if x is not None), pcops.serialized_unpool(out.features, out.cluster.clamp_min(0)))

    return fn


def _pool_calls(gen):
    calls = []
    for n in (40, 57):
        grid = torch.randint(0, 16, (n, 3), generator=gen)
        calls.append((grid, torch.randint(0, 2, (n,), generator=gen), torch.randn(n, 3, generator=gen).requires_grad_(),
                      (grid * 0.1).float().requires_grad_()))
    return calls


@pytest.mark.parametrize("options", [{}, {"dynamic": True}], ids=["default", "dynamic"])
def test_bounded_pool_compiles_without_graph_breaks(gen, options):
    for bound in (64, 8):  # padded, and overflowing
        assert compiled_breaks(_pool_fn(bound), _pool_calls(gen), **options) == {}


def test_bounded_pool_compiles_fullgraph(gen):
    ops = ("pcops.serialize_codes", "pcops.serialized_cluster", "pcops.segment_reduce")
    assert_compiles(_pool_fn(64), _pool_calls(gen), ops=ops, backend="aot_eager")


def test_unbounded_pool_breaks_the_graph_at_the_op_under_default_compile(gen):
    breaks = compiled_breaks(_pool_fn(None), _pool_calls(gen))
    assert breaks and all("pcops.serialized_cluster" in reason for reason in breaks), breaks


def test_bad_max_clusters_raises(gen):
    code = pcops.serialize(torch.randint(0, 8, (10, 3), generator=gen), depth=3).code
    for bad, error in ((0, ValueError), (-2, ValueError), (True, TypeError), (4.0, TypeError), ("3", TypeError)):
        with pytest.raises(error, match="max_clusters"):
            pcops.serialized_pool(code, 1, max_clusters=bad)


@pytest.mark.cuda
def test_bounded_pool_cuda_matches_cpu(gen):
    grid = torch.randint(0, 2**8, (10_000, 3), generator=gen)
    batch = torch.randint(0, 4, (10_000,), generator=gen)
    features = torch.randn(10_000, 8, generator=gen)
    code = pcops.serialize(grid, batch, depth=8, order=["z", "hilbert"]).code
    for m in (20_000, 500):  # padded, and overflowing
        cpu = pcops.serialized_pool(code, 2, features, grid_coord=grid, batch=batch, max_clusters=m)
        gpu = pcops.serialized_pool(code.cuda(), 2, features.cuda(), grid_coord=grid.cuda(), batch=batch.cuda(), max_clusters=m)
        for a, b in zip(gpu, cpu):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a.cpu(), b)


def test_validate_false_skips_the_value_checks():
    grid = torch.tensor([[0, 1, 2], [3, 4, 70]])
    with pytest.raises(ValueError, match="grid_coord"):
        pcops.serialize(grid, depth=6)
    assert pcops.serialize(grid, depth=6, validate=False).code.shape == (2,)
    features = torch.arange(6.0).reshape(3, 2)
    cluster = torch.tensor([0, 2, 5, -1])
    with pytest.raises(ValueError, match="cluster"):
        pcops.serialized_unpool(features, cluster)
    out = pcops.serialized_unpool(features, cluster, validate=False)  # out of range: zeros, never a read out of bounds
    assert torch.equal(out, torch.stack([features[0], features[2], torch.zeros(2), torch.zeros(2)]))
    with pytest.raises(ValueError, match="features contains NaN"):
        pcops.serialized_pool(pcops.serialize(grid[:1]).code, features=torch.tensor([[float("nan")]]))


def test_a_pooling_depth_beyond_the_codes_depth_that_joins_samples_is_an_error():
    """serialize(depth=d) keeps the sample id above bit 3d: pooling deeper than d shifted it into
    the parent cell and joined samples silently (one parent of two samples, its features reduced
    across both). With batch given (validation on) that is a ValueError; a depth up to d, or one
    that joins no samples (one sample), pools as before."""
    grid = torch.tensor([[0, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1]])
    batch = torch.tensor([0, 0, 1, 1])
    code = pcops.serialize(grid, batch, depth=1).code
    f = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    out = pcops.serialized_pool(code, 1, f, grid_coord=grid, batch=batch)
    assert out.cluster.tolist() == [0, 0, 1, 1] and out.batch.tolist() == [0, 1] and out.features.flatten().tolist() == [2.0, 4.0]
    for bound in (None, 4):
        with pytest.raises(ValueError, match="pooling_depth=2 joins points of different samples"):
            pcops.serialized_pool(code, 2, f, grid_coord=grid, batch=batch, max_clusters=bound)
    assert pcops.serialized_pool(code, 2, f, batch=batch, validate=False).cluster.tolist() == [0, 0, 0, 0]  # (unchecked, as documented)
    one = pcops.serialize(grid[:2], depth=1).code
    assert pcops.serialized_pool(one, 3, f[:2], batch=batch[:2]).cluster.tolist() == [0, 0]
