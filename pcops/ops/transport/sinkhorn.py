"""The debiased Sinkhorn divergence between weighted point clouds: GeomLoss's definition, in
Warp kernels that never store the (N, M) cost matrix.

For weights a (on x) and b (on y) and the cost C(x, y) = |x - y| (``p=1``) or |x - y|^2 / 2
(``p=2``), as GeomLoss's ``SamplesLoss("sinkhorn", p, blur, scaling, debias=True)``:

    OT_eps(a, b) = min_P <P, C> + eps KL(P | a x b)      (P: couplings of a and b)
    S_eps(a, b)  = OT_eps(a, b) - OT_eps(a, a) / 2 - OT_eps(b, b) / 2,      eps = blur^p

computed in the log domain by GeomLoss's symmetric Sinkhorn iterations with epsilon-scaling:
the temperatures ``diameter^p, exp(p log(diameter) + k p log(scaling)) ... , blur^p`` (the
diameter of the sample's two clouds unless given), each step averaging the dual potentials
with their softmin update

    softmin_eps(C, h)_i = -eps log sum_j exp(h_j - C(x_i, y_j) / eps),

then one last update at eps = blur^p. The value is ``<a, f_ba - f_aa> + <b, g_ab - g_bb>``
(GeomLoss's, to rounding). One kernel launch per step computes the four softmins (x against
y, y against x, x against x, y against y) of every sample of a batch: one thread per point,
an online log-sum-exp over the points of its sample, so memory grows as N + M.

Gradients come from the potentials of the last update held fixed (the envelope theorem, no
unrolled iterations), exactly the gradients GeomLoss's autograd gives: to the points, a
softmax-weighted mean of the cost's gradient (one more launch); to the weights, the dual
potentials F and G themselves.
"""


import math
from typing import NamedTuple, Optional

import numpy as np
import torch
import warp as wp

from ... import _layout, _threads, _validate, _warp

BATCH_REDUCTIONS = ("mean", "sum", None)
_TINY = 1e-8  # GeomLoss's floor of the squared distance in its p = 1 cost: sqrt(max(d^2, 1e-8))


class SinkhornDivergence(NamedTuple):
    """Result of :func:`sinkhorn_divergence` with ``potentials=True``: ``loss`` as without it, and
    the dual potentials ``x_potential`` (F = f_ba - f_aa on x) and ``y_potential`` (G = g_ab -
    g_bb on y) in the layouts of ``x`` and ``y`` (0 at padding), GeomLoss's ``potentials=True``."""

    loss: torch.Tensor
    x_potential: torch.Tensor
    y_potential: torch.Tensor


@_warp.kernels
def _kernels(dtype: torch.dtype, p: int):
    """(softmin, weighted): one thread per query row i (of a block-sample ``row[i]``, whose
    reference rows are ``offsets[row[i]] .. offsets[row[i] + 1] - 1``), at the temperature
    ``eps[i]`` (rows with eps <= 0 are skipped: padding, empty samples, finished schedules).
    Reference rows j with ``mass[j] == 0`` (zero weight) are no term of the sums: a flag of
    their own, as no value of h can mark them when h_j - C / eps ranges over every float.

    softmin:  out[i] = -eps log sum_j exp(h_j - C(q_i, r_j) / eps)   (0 for no reference of positive weight)
    weighted: out[i] = sum_j w_ij grad_q C(q_i, r_j), w_ij = softmax_j(h_j - C(q_i, r_j) / eps)
    """
    s = _warp.scalar(dtype)
    v = _warp.vec3(dtype)
    # a term below exp(-cut) of the largest so far (acc >= 1) is below half an ulp of acc: skipped
    # without its exp (even 10^5 of them move the sum by less than 1e-8 of itself in float32)
    cut = s(50.0 if dtype == torch.float64 else 30.0)

    @wp.func(module="unique")
    def cost(d: v):
        if wp.static(p == 2):
            return s(0.5) * wp.dot(d, d)
        return wp.sqrt(wp.max(wp.dot(d, d), s(_TINY)))

    @wp.func(module="unique")
    def cost_grad(d: v):
        if wp.static(p == 2):
            return d
        d2 = wp.dot(d, d)
        if d2 > s(_TINY):
            return d / wp.sqrt(d2)
        return v()

    @wp.kernel(enable_backward=False, module="unique")
    def softmin(
        start: int,
        query: wp.array(dtype=v),
        ref: wp.array(dtype=v),
        h: wp.array(dtype=s),
        mass: wp.array(dtype=wp.uint8),
        row: wp.array(dtype=wp.int32),
        offsets: wp.array(dtype=wp.int32),
        eps: wp.array(dtype=s),
        out: wp.array(dtype=s),
    ):
        i = wp.tid() + start
        e = eps[i]
        if e > s(0.0):
            g = row[i]
            q = query[i]
            inv = s(1.0) / e
            m = s(0.0)
            acc = s(0.0)  # 0 until the first term, then >= 1
            for j in range(offsets[g], offsets[g + 1]):
                if mass[j] != wp.uint8(0):
                    t = h[j] - cost(q - ref[j]) * inv
                    if acc == s(0.0):
                        acc = s(1.0)
                        m = t
                    elif t > m:
                        acc = acc * wp.exp(m - t) + s(1.0)
                        m = t
                    elif t > m - cut:
                        acc = acc + wp.exp(t - m)
            if acc > s(0.0):
                out[i] = -e * (m + wp.log(acc))

    @wp.kernel(enable_backward=False, module="unique")
    def weighted(
        start: int,
        query: wp.array(dtype=v),
        ref: wp.array(dtype=v),
        h: wp.array(dtype=s),
        mass: wp.array(dtype=wp.uint8),
        row: wp.array(dtype=wp.int32),
        offsets: wp.array(dtype=wp.int32),
        eps: wp.array(dtype=s),
        out: wp.array(dtype=v),
    ):
        i = wp.tid() + start
        e = eps[i]
        if e > s(0.0):
            g = row[i]
            q = query[i]
            inv = s(1.0) / e
            m = s(0.0)
            acc = s(0.0)  # 0 until the first term, then >= 1
            total = v()
            for j in range(offsets[g], offsets[g + 1]):
                if mass[j] != wp.uint8(0):
                    d = q - ref[j]
                    t = h[j] - cost(d) * inv
                    if acc == s(0.0):
                        acc = s(1.0)
                        total = cost_grad(d)
                        m = t
                    elif t > m:
                        r = wp.exp(m - t)
                        acc = acc * r + s(1.0)
                        total = total * r + cost_grad(d)
                        m = t
                    elif t > m - cut:
                        w = wp.exp(t - m)
                        acc = acc + w
                        total = total + w * cost_grad(d)
            if acc > s(0.0):
                out[i] = total / acc

    return softmin, weighted


# ----------------------------------------------------------------------------------------------
# The layout of one call: both clouds sorted by sample, the four problems as blocks of rows


class _Blocks:
    """x and y sorted by sample; query rows [x, y, x, y] against reference rows [y, x, x, y]
    (blocks f_ba, g_ab, f_aa, g_bb; the first two without ``debias``), each block's rows of
    sample g against the reference rows of the same block and sample."""

    def __init__(self, x, y, a, b, x_group, y_group, samples: int, debias: bool):
        n, m, dev = x.shape[0], y.shape[0], x.device
        self.n, self.m, self.samples, self.k = n, m, samples, 4 if debias else 2
        big = samples + 1  # sample ids 0 .. samples - 1, and one dead id for padding rows
        gx = self._ids(x_group, n, samples, dev)
        gy = self._ids(y_group, m, samples, dev)
        self.order_x = torch.argsort(gx, stable=True)
        self.order_y = torch.argsort(gy, stable=True)
        self.gx, self.gy = gx[self.order_x], gy[self.order_y]
        cx = torch.bincount(gx, minlength=big)
        cy = torch.bincount(gy, minlength=big)
        self.live = (cx[:samples] > 0) & (cy[:samples] > 0)  # a sample with an empty cloud has no problem: loss 0
        xs, ys = x[self.order_x], y[self.order_y]
        self.a, self.b = a[self.order_x], b[self.order_y]
        k = self.k
        self.query = torch.cat([xs, ys, xs, ys][:k]).contiguous()
        self.ref = torch.cat([ys, xs, xs, ys][:k]).contiguous()
        self.row = torch.cat([self.gx, self.gy + big, self.gx + 2 * big, self.gy + 3 * big][:k]).to(torch.int32)
        counts = torch.cat([cy, cx, cx, cy][:k])
        self.offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)
        log_a, log_b = _log_weights(self.a), _log_weights(self.b)
        self.log_ref = torch.cat([log_b, log_a, log_a, log_b][:k])
        mass_a, mass_b = (self.a > 0).to(torch.uint8), (self.b > 0).to(torch.uint8)
        self.mass = torch.cat([mass_b, mass_a, mass_a, mass_b][:k])

    @staticmethod
    def _ids(group, rows: int, samples: int, dev) -> torch.Tensor:
        if group is None:
            return torch.zeros(rows, dtype=torch.int64, device=dev)
        g = group.to(torch.int64)
        return torch.where((g >= 0) & (g < samples), g, samples)

    def rows_of(self, per_sample: torch.Tensor) -> torch.Tensor:
        """A per-sample value (samples,) on every query row (0 on dead rows)."""
        ext = torch.cat([per_sample, per_sample.new_zeros(1)])
        x, y = ext[self.gx], ext[self.gy]
        return torch.cat([x, y, x, y][: self.k])

    def refs_of(self, per_sample: torch.Tensor) -> torch.Tensor:
        """The same on every reference row."""
        ext = torch.cat([per_sample, per_sample.new_zeros(1)])
        x, y = ext[self.gx], ext[self.gy]
        return torch.cat([y, x, x, y][: self.k])

    def swap(self, pot: torch.Tensor) -> torch.Tensor:
        """Potentials by query row -> by reference row (block f_ba's references hold g_ab, ...)."""
        n, m = self.n, self.m
        f, g = pot[:n], pot[n : n + m]
        parts = [g, f] if self.k == 2 else [g, f, pot[n + m : 2 * n + m], pot[2 * n + m :]]
        return torch.cat(parts)

    def sort(self, t: torch.Tensor) -> torch.Tensor:
        """Block rows in the caller's order -> sorted order (and :meth:`unsort` back)."""
        n, m, ox, oy = self.n, self.m, self.order_x, self.order_y
        parts = [t[:n][ox], t[n : n + m][oy]]
        if self.k == 4:
            parts += [t[n + m : 2 * n + m][ox], t[2 * n + m :][oy]]
        return torch.cat(parts)

    def unsort(self, t: torch.Tensor) -> torch.Tensor:
        n, m = self.n, self.m
        out = torch.empty_like(t)
        out[:n][self.order_x] = t[:n]
        out[n : n + m][self.order_y] = t[n : n + m]
        if self.k == 4:
            out[n + m : 2 * n + m][self.order_x] = t[n + m : 2 * n + m]
            out[2 * n + m :][self.order_y] = t[2 * n + m :]
        return out

    def launch(self, which: int, h: torch.Tensor, eps_rows: torch.Tensor, p: int) -> torch.Tensor:
        """softmin (which=0) or weighted (which=1) over every block row."""
        kernel = _kernels(self.query.dtype, p)[which]
        rows = self.query.shape[0]
        out = self.query.new_zeros((rows, 3) if which else (rows,))
        vec = _warp.vec3(out.dtype)
        result = _warp.Typed(out, vec) if which else out
        args = [_warp.Typed(self.query, vec), _warp.Typed(self.ref, vec), h.contiguous(), self.mass, self.row, self.offsets, eps_rows.contiguous(), result]
        _warp.launch(kernel, rows, args, like=self.query, min_chunk=64)
        return out

    def h(self, pot: torch.Tensor, eps_ref: torch.Tensor) -> torch.Tensor:
        """h_j = log w_j + pot_j / eps on every reference row (0 where eps is 0: rows never read)."""
        safe = torch.where(eps_ref > 0, eps_ref, 1)
        return torch.where(eps_ref > 0, self.log_ref + self.swap(pot) / safe, 0)

    def full(self, t: torch.Tensor) -> tuple:
        """Block rows (sorted) -> (f, g, f_aa, g_bb) with zeros for the blocks debias=False omits."""
        n, m = self.n, self.m
        f, g = t[:n], t[n : n + m]
        if self.k == 4:
            return f, g, t[n + m : 2 * n + m], t[2 * n + m :]
        return f, g, torch.zeros_like(f), torch.zeros_like(g)


def _log_weights(w: torch.Tensor) -> torch.Tensor:
    """log w where w > 0, and 0 at zero weights, whose rows the kernels skip by ``mass`` (GeomLoss
    gives them -100000: the same wherever C / eps stays below 10^5)."""
    return torch.log(torch.where(w > 0, w, 1))


def _diameters(x, y, blocks: _Blocks, dtype) -> list[float]:
    """Each sample's GeomLoss diameter: the diagonal of the bounding box of its x and y points."""
    big = blocks.samples + 1
    pts = torch.cat([x[blocks.order_x], y[blocks.order_y]])
    ids = torch.cat([blocks.gx, blocks.gy])[:, None].expand(-1, 3)
    lo = pts.new_full((big, 3), math.inf).scatter_reduce(0, ids, pts, "amin")
    hi = pts.new_full((big, 3), -math.inf).scatter_reduce(0, ids, pts, "amax")
    span = (hi[: blocks.samples] - lo[: blocks.samples]).to(dtype)
    return torch.linalg.vector_norm(span, dim=1).tolist()  # the one host read of the schedule


# The most temperatures a schedule may have: each is a pass of the Sinkhorn loop over every pair
# of points (GeomLoss's settings give tens to a few thousand).
MAX_STEPS = 100_000


def epsilon_schedule(p: int, diameter: float, blur: float, scaling: float) -> list[float]:
    """GeomLoss's temperatures: ``diameter^p``, then ``exp(e)`` for e from ``p log(diameter)``
    down to (excluding) ``p log(blur)`` in steps of ``p log(scaling)``, then ``blur^p``.
    A schedule of more than :data:`MAX_STEPS` temperatures (a scaling too close to 1) raises."""
    count = (math.log(diameter) - math.log(blur)) / -math.log(scaling) if diameter > blur else 0.0
    if count > MAX_STEPS:
        raise ValueError(f"scaling={scaling!r} is so close to 1 that the temperatures from the diameter {diameter:.3g} down to "
                         f"blur={blur!r} take {count:.3g} steps (at most {MAX_STEPS:,}, each a pass over every pair of points): "
                         "use a smaller scaling (GeomLoss's default is 0.5; 0.9-0.99 for a slower, more accurate schedule)")
    steps = np.arange(p * np.log(diameter), p * np.log(blur), p * np.log(scaling))
    return [diameter**p] + [float(np.exp(e)) for e in steps] + [blur**p]


def _schedule(diameters: list[float], live: list[bool], p, blur, scaling) -> np.ndarray:
    """(T, samples) temperatures of the averaged steps, 0 where a sample's schedule has ended
    (or the sample has no problem); row 0 is the initial temperature."""
    lists = [epsilon_schedule(p, d, blur, scaling) if ok and 0 < d < math.inf else [blur**p] * 2  # (NaN/inf points: validate=False)
             for d, ok in zip(diameters, live)]
    steps = max((len(e) for e in lists), default=1)
    table = np.zeros((steps + 1, len(lists)))
    for s, (e, ok) in enumerate(zip(lists, live)):
        if ok:
            table[0, s] = e[0]
            table[1 : len(e) + 1, s] = e
    return table


def _check_weights(validate: bool, x, y, x_weights, y_weights) -> None:
    if not validate:
        return
    checks = _validate.Checks()
    for name, t in (("x", x), ("y", y), ("x_weights", x_weights), ("y_weights", y_weights)):
        checks.finite(name, t)
    for name, t in (("x_weights", x_weights), ("y_weights", y_weights)):
        if t.numel():
            checks.add((t >= 0).all(), lambda name=name, t=t: f"{name} must be >= 0, got min {float(t.min())}")
    checks.run()


def _solve(x, y, a, b, x_group, y_group, samples, p, blur, scaling, diameter, debias, validate: bool = False):
    """(blocks, old potentials, new potentials (both sorted block rows), per-row temperature of the last step);
    ``validate``: the clouds' spans checked (:func:`_check_spans`)."""
    blocks = _Blocks(x, y, a, b, x_group, y_group, samples, debias)
    live = blocks.live.tolist()
    spans = _diameters(x, y, blocks, x.dtype) if validate or diameter is None else None
    if validate:
        _check_spans([d for d, ok in zip(spans, live) if ok], p, x.dtype)
    diameters = [diameter] * samples if diameter is not None else spans
    table = torch.as_tensor(_schedule(diameters, live, p, blur, scaling), dtype=x.dtype).to(x.device)
    pot = blocks.launch(0, blocks.log_ref, blocks.rows_of(table[0]), p)  # GeomLoss's start: h = log w
    for t in range(1, table.shape[0]):
        eps_rows = blocks.rows_of(table[t])
        new = blocks.launch(0, blocks.h(pot, blocks.refs_of(table[t])), eps_rows, p)
        pot = torch.where(eps_rows > 0, 0.5 * (pot + new), pot)
    last = blocks.live.to(x.dtype) * (blur**p)  # (a Python number in torch.where would be float32)
    new = blocks.launch(0, blocks.h(pot, blocks.refs_of(last)), blocks.rows_of(last), p)
    return blocks, pot, new


def _per_sample(blocks: _Blocks, values: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    terms = torch.where(weights > 0, weights * values, 0)
    return values.new_zeros(blocks.samples + 1).index_add(0, ids, terms)[: blocks.samples]


@_threads.custom_op("pcops::sinkhorn", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    x_weights: torch.Tensor,
    y_weights: torch.Tensor,
    x_group: Optional[torch.Tensor],
    y_group: Optional[torch.Tensor],
    samples: int,
    p: int,
    blur: float,
    scaling: float,
    diameter: Optional[float],
    debias: bool,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, 3), y (M, 3), weights (N,), (M,), groups (sample ids; others are padding) -> (loss
    (samples,), state (2, 2N + 2M): the potentials [f_ba, g_ab, f_aa, g_bb] before and after the
    last update, in the caller's row order; f_aa and g_bb are 0 without debias)."""
    _validate.groups_paired(x_group, y_group)
    _check_options(p, blur, scaling, diameter)
    _check_temperatures(p, blur, diameter, x.dtype)
    _check_weights(validate, x, y, x_weights, y_weights)
    n, m = x.shape[0], y.shape[0]
    state = x.new_zeros((2, 2 * n + 2 * m))
    if n == 0 or m == 0:
        return x.new_zeros(samples), state
    _warp.init()
    blocks, old, new = _solve(x, y, x_weights, y_weights, x_group, y_group, samples, p, blur, scaling, diameter, debias, validate)
    f, g, faa, gbb = blocks.full(new)
    loss = _per_sample(blocks, f - faa, blocks.a, blocks.gx) + _per_sample(blocks, g - gbb, blocks.b, blocks.gy)
    for r, t in enumerate((old, new)):
        state[r] = torch.cat(blocks.full(blocks.unsort(t)))
    return loss, state


@_sinkhorn.register_fake
def _(x, y, x_weights, y_weights, x_group, y_group, samples, p, blur, scaling, diameter, debias, validate):
    return x.new_empty((samples,)), x.new_empty((2, 2 * x.shape[0] + 2 * y.shape[0]))


@_threads.custom_op("pcops::sinkhorn_backward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _sinkhorn_backward(
    x: torch.Tensor,
    y: torch.Tensor,
    x_weights: torch.Tensor,
    y_weights: torch.Tensor,
    x_group: Optional[torch.Tensor],
    y_group: Optional[torch.Tensor],
    state: torch.Tensor,
    grad_loss: torch.Tensor,
    samples: int,
    p: int,
    blur: float,
    debias: bool,
    points: bool,
    weights: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (x, y, x_weights, y_weights) of sum(grad_loss * loss) with the potentials of the
    last update fixed; those not asked for (``points``, ``weights``) are zeros."""
    n, m = x.shape[0], y.shape[0]
    gx, gy, ga, gb = torch.zeros_like(x), torch.zeros_like(y), torch.zeros_like(x_weights), torch.zeros_like(y_weights)
    if n == 0 or m == 0 or not (points or weights):
        return gx, gy, ga, gb
    _warp.init()
    blocks = _Blocks(x, y, x_weights, y_weights, x_group, y_group, samples, debias)
    k = blocks.k
    old, new = (blocks.sort(state[r, : (2 * n + 2 * m) if k == 4 else n + m]) for r in (0, 1))
    eps = blur**p
    last = blocks.live.to(x.dtype) * eps
    eps_rows, eps_ref = blocks.rows_of(last), blocks.refs_of(last)
    scale = blocks.rows_of(grad_loss.to(x.dtype))  # d loss_g on each row of sample g
    sa, sb = scale[:n], scale[n : n + m]
    if points:
        mean = blocks.launch(1, blocks.h(old, eps_ref), eps_rows, p)  # softmax-weighted grad C per row
        fx, fy, faa, gbb = blocks.full(mean)
        gx[blocks.order_x] = (sa * blocks.a)[:, None] * (fx - faa)
        gy[blocks.order_y] = (sb * blocks.b)[:, None] * (fy - gbb)
    if weights:  # the potentials themselves (GeomLoss's last update reads the weights detached)
        f1, g1, faa1, gbb1 = blocks.full(new)
        ga[blocks.order_x] = sa * (f1 - faa1)
        gb[blocks.order_y] = sb * (g1 - gbb1)
    return gx, gy, ga, gb


@_sinkhorn_backward.register_fake
def _(x, y, x_weights, y_weights, x_group, y_group, state, grad_loss, samples, p, blur, debias, points, weights):
    return torch.empty_like(x), torch.empty_like(y), torch.empty_like(x_weights), torch.empty_like(y_weights)


def _setup_context(ctx, inputs, output):
    x, y, a, b, xg, yg, samples, p, blur, scaling, diameter, debias, validate = inputs
    ctx.save_for_backward(x, y, a, b, xg, yg, output[1])
    ctx.options = (samples, p, blur, debias)


def _backward(ctx, grad_loss, grad_state):
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # create_graph=True
        raise RuntimeError(
            "pcops.sinkhorn_divergence does not support gradients of gradients (its backward holds the dual "
            "potentials fixed, the envelope theorem): take first gradients only (create_graph=False)"
        )
    x, y, a, b, xg, yg, state = ctx.saved_tensors
    samples, p, blur, debias = ctx.options
    need = ctx.needs_input_grad
    gx, gy, ga, gb = _sinkhorn_backward(
        x, y, a, b, xg, yg, state, grad_loss, samples, p, blur, debias, bool(need[0] or need[1]), bool(need[2] or need[3])
    )
    return gx, gy, ga, gb, None, None, None, None, None, None, None, None, None


_sinkhorn.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# The public function


_NAMES = _layout.names("x", "y")


def _check_options(p, blur, scaling, diameter) -> None:
    _validate.one_of("p", p, (1, 2))
    _validate.positive_number("blur", blur)
    _validate.interval("scaling", scaling, 0, 1)
    if diameter is not None:
        _validate.positive_number("diameter", diameter)


def _check_temperatures(p: int, blur: float, diameter, dtype) -> None:
    """The temperatures the kernels divide by are normal numbers of ``dtype`` and the first one
    finite: ``blur^p`` below the smallest normal number had an infinite inverse (NaN losses;
    rounded to 0, a loss of 0), a given ``diameter^p`` above the largest number no first step,
    and a ``blur^p`` above it no last (a NaN loss, or Python's OverflowError)."""
    info = torch.finfo(dtype)
    if p * math.log(blur) < math.log(info.tiny):
        raise ValueError(f"blur must be large enough that blur**p is a normal {dtype} number (>= {info.tiny:.3g}; the kernels divide "
                         f"by it), got blur={blur!r} with p={p}")
    if p * math.log(blur) > math.log(info.max):
        raise ValueError(f"blur**p must be finite in {dtype}, got blur={blur!r} with p={p}")
    if diameter is not None and p * math.log(diameter) > math.log(info.max):
        raise ValueError(f"diameter**p must be finite in {dtype}, got diameter={diameter!r} with p={p}")


def _check_spans(diameters: list[float], p: int, dtype) -> None:
    """Each sample's clouds span a box whose diagonal (measured in ``dtype``) and its p-th power
    (the largest cost) are finite (finite points farther apart give costs of inf and NaN losses)."""
    top = math.log(torch.finfo(dtype).max)
    for d in diameters:
        if not d < math.inf or (d > 0 and p * math.log(d) > top):
            raise ValueError(f"x and y span {d:.3g} (a sample's bounding-box diagonal): its costs |x - y|^p overflow {dtype}; "
                             "rescale the clouds or compute in float64")


def _weights(name: str, w, points: torch.Tensor, flat_group, samples: int, dtype) -> torch.Tensor:
    """The flat weights (P,) in ``dtype``: the caller's (shape points.shape[:-1]) or uniform per sample."""
    rows = points.shape[:-1]
    if w is not None:
        _validate.tensor(name, w, ndim=len(rows), size=rows[0], last=rows[-1], shape_doc="(B, N)" if len(rows) == 2 else "(N,)")
        _validate.same_device(**{name.removesuffix("_weights"): points, name: w})
        return w.reshape(-1).to(dtype)
    total = points.reshape(-1, 3).shape[0]
    if flat_group is None:
        return points.new_full((total,), 1.0, dtype=dtype) / max(total, 1)
    g = flat_group.to(torch.int64)
    g = torch.where((g >= 0) & (g < samples), g, samples)
    counts = torch.zeros(samples + 1, dtype=dtype, device=points.device).index_add(0, g, torch.ones(total, dtype=dtype, device=points.device))
    return torch.where(g < samples, 1 / counts.clamp_min(1)[g], 0)




def _reduce(loss: torch.Tensor, x, x_batch, batch_reduction) -> torch.Tensor:
    _validate.one_of("batch_reduction", batch_reduction, BATCH_REDUCTIONS)
    if batch_reduction is not None:
        return loss.sum() if batch_reduction == "sum" else loss.sum() / max(loss.shape[0], 1)
    if x.dim() == 2 and x_batch is None:
        return loss.reshape(())
    return loss


@_threads.limits
def sinkhorn_divergence(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    x_weights: Optional[torch.Tensor] = None,
    y_weights: Optional[torch.Tensor] = None,
    x_lengths: Optional[torch.Tensor] = None,
    y_lengths: Optional[torch.Tensor] = None,
    x_batch: Optional[torch.Tensor] = None,
    y_batch: Optional[torch.Tensor] = None,
    p: int = 2,
    blur: float = 0.05,
    scaling: float = 0.5,
    diameter: Optional[float] = None,
    debias: bool = True,
    batch_reduction: Optional[str] = "mean",
    batch_size: Optional[int] = None,
    potentials: bool = False,
    validate: bool = True,
):
    """The debiased Sinkhorn divergence of GeomLoss's ``SamplesLoss("sinkhorn", p=p, blur=blur,
    scaling=scaling, debias=True)``, memory linear in the number of points.

    ``S(a, b) = OT_eps(a, b) - OT_eps(a, a) / 2 - OT_eps(b, b) / 2`` with ``eps = blur^p`` and the
    cost ``|x - y|`` (``p=1``) or ``|x - y|^2 / 2`` (``p=2``), computed by log-domain Sinkhorn
    iterations with epsilon-scaling (GeomLoss's schedule, from each sample's diameter) in Warp
    kernels that never store the (N, M) cost matrix. ``debias=False`` gives ``OT_eps(a, b)``.
    As blur -> 0 the divergence tends to the optimal transport cost: for uniform weights on n
    points, ``|S - W| <= blur^p log(n)`` with ``W = earth_movers_distance(x, y, p=p) / p``
    (docs/ops/transport.md).

    Args:
        x: Tensor of shape (N, 3); (B, N, 3) padded; or (N_total, 3) packed.
        y: Tensor of shape (M, 3); (B, M, 3) padded; or (M_total, 3) packed.
        x_weights, y_weights: non-negative weights of the points, shaped as the points without
            their last dimension ((N,), (B, N), (N_total,)); by default 1 / (the sample's number
            of points). Each sample's weights should have the same total on both sides (the
            balanced problem); zero weights are allowed (those points carry no mass).
        x_lengths, y_lengths: optional int tensors (B,) for padded inputs.
        x_batch, y_batch: int sample ids (N_total,) / (M_total,) of packed inputs.
        p: 1 or 2, the cost's exponent (GeomLoss's p).
        blur: the final temperature's length scale (> 0): eps = blur^p.
        scaling: the ratio of successive blurs of the schedule, in (0, 1).
        diameter: the schedule's starting length for every sample; by default each sample's
            own (the diagonal of its clouds' bounding box), so a batch equals a per-sample loop.
        debias: the debiased divergence (True) or the entropic OT cost OT_eps(a, b).
        batch_reduction: "mean", "sum" or None (per-sample values (B,); a 0-d tensor for one
            cloud). A sample with an empty cloud has the value 0.
        batch_size: number of samples of packed inputs; by default one more than the largest
            id (a host read; required under ``torch.compile``).
        potentials: also return the dual potentials (a :class:`SinkhornDivergence`).
        validate: check the points and weights for NaN/inf, the weights for signs, lengths and
            ids for range.

    Returns:
        The loss in the promoted dtype of the points (float16/bfloat16 computed in float32),
        differentiable with respect to ``x``, ``y``, ``x_weights`` and ``y_weights`` (gradients
        of the last Sinkhorn update with the potentials held fixed, as GeomLoss's); with
        ``potentials=True``, ``SinkhornDivergence(loss, x_potential, y_potential)``, the
        potentials detached.

    Example:
        >>> import torch, pcops
        >>> x, y = torch.rand(500, 3), torch.rand(400, 3) + 0.5
        >>> loss = pcops.sinkhorn_divergence(x, y, blur=0.01)
        >>> loss.shape, bool(loss > 0)
        (torch.Size([]), True)
    """
    blur, scaling, diameter = _validate.plain(blur), _validate.plain(scaling), _validate.plain(diameter)
    p, batch_size = _validate.plain(p), _validate.plain(batch_size)
    _check_options(p, blur, scaling, diameter)
    p = int(p)  # 2.0 means 2 (the op's schema takes an int)
    _validate.flag(debias=debias, potentials=potentials)
    _validate.one_of("batch_reduction", batch_reduction, BATCH_REDUCTIONS)
    layout = dict(query_lengths=x_lengths, ref_lengths=y_lengths, query_batch=x_batch, ref_batch=y_batch)
    _validate.layout(x, y, None, **layout, names=_NAMES)
    samples, ranges = _layout.sample_count(x, x_batch, y_batch, batch_size)
    finite = {k: v for k, v in (("x_weights", x_weights), ("y_weights", y_weights)) if isinstance(v, torch.Tensor)}
    flat = _layout.pair(x, y, **layout, validate=validate, names=_NAMES, ranges=ranges, finite=finite)
    dtype, out_dtype = _validate.compute_dtype(x, y)
    a = _weights("x_weights", x_weights, x, flat.query_group, samples, dtype)
    b = _weights("y_weights", y_weights, y, flat.ref_group, samples, dtype)
    _threads.reverse_only("sinkhorn_divergence", x, y, a, b)
    loss, state = _sinkhorn(
        flat.query.to(dtype), flat.ref.to(dtype), a, b, flat.query_group, flat.ref_group, samples, p,
        float(blur), float(scaling), None if diameter is None else float(diameter), debias, bool(validate),
    )
    loss = _reduce(loss, x, x_batch, batch_reduction).to(out_dtype)
    if not potentials:
        return loss
    n, m = flat.query.shape[0], flat.ref.shape[0]
    new = state[1].detach()
    fx, gy = new[:n] - new[n + m : 2 * n + m], new[n : n + m] - new[2 * n + m :]
    return SinkhornDivergence(loss, fx.reshape(x.shape[:-1]).to(out_dtype), gy.reshape(y.shape[:-1]).to(out_dtype))


__all__ = ["SinkhornDivergence", "sinkhorn_divergence", "epsilon_schedule"]
