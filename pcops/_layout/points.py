"""The point layouts: every op runs on flat point sets with per-point sample ids ("groups").

Three layouts of point clouds reach the ops:

* single:  query (M, 3), ref (N, 3), features (N, F)
* padded:  query (B, M, 3), ref (B, N, 3), features (B, N, F), optional ``query_lengths`` and
  ``ref_lengths`` (B,) (PyTorch3D's convention); rows past a sample's length are padding
* packed:  query (M_total, 3) with ``query_batch`` (M_total,) and ref (N_total, 3) with
  ``ref_batch`` (N_total,) int sample ids, sorted or not (PyTorch Geometric's convention)

:func:`pair` (two-cloud ops) and :func:`single` (one-cloud ops) are the one layout layer of
pcops: every public op resolves its numbers, flattens its inputs through one of them, calls its
custom op and unflattens the result (:func:`unflatten`, :func:`local_index`). They own every
shape, value and range check of the layouts, and their messages name the arguments as the
caller typed them (``x``, ``y_lengths`` for ``chamfer_distance``; ``points``, ``batch`` for
one-cloud ops). They turn any layout into flat (P, 3) points plus int32 groups (``None`` for a
single cloud). A padded layout gets group b for the valid rows of sample b, ``B`` for query
padding and ``B + 1`` for reference padding, so padding never meets anything. Packed ids of
any integer range (int64 above 2**31 included) become int32 groups that are equal exactly where
the ids are (:func:`_int32_ids`). All of it is static-shape torch code: no host
synchronisation, nothing that breaks ``torch.compile``.

Integer-data ops take the second layout (:mod:`pcops._layout.sites`), meshes the third
(:mod:`pcops._layout.meshes`).
"""

from __future__ import annotations

import math

from typing import NamedTuple, Optional

import torch

from .. import _threads, _validate


class Names(NamedTuple):
    """The caller's names of an op's inputs, used in every message of the layout layer."""

    query: str = "query"
    ref: str = "ref"
    features: str = "features"
    query_lengths: str = "query_lengths"
    ref_lengths: str = "ref_lengths"
    query_batch: str = "query_batch"
    ref_batch: str = "ref_batch"


def names(query: str = "query", ref: str = "ref", features: str = "features") -> Names:
    """Names of a two-cloud op whose batch keywords follow its clouds' names (``x`` -> ``x_lengths``, ``x_batch``)."""
    return Names(query, ref, features, f"{query}_lengths", f"{ref}_lengths", f"{query}_batch", f"{ref}_batch")


PAIR = names()  # query, ref, features, query_lengths, ref_lengths, query_batch, ref_batch


class Flat(NamedTuple):
    """Flat inputs of an op and how to give its results the caller's layout back."""

    query: torch.Tensor  # (P, 3)
    ref: torch.Tensor  # (R, 3)
    features: Optional[torch.Tensor]  # (R, F)
    query_group: Optional[torch.Tensor]  # (P,) int32, None for a single cloud
    ref_group: Optional[torch.Tensor]  # (R,) int32
    batch_shape: tuple  # (B, M) for padded inputs, () otherwise
    ref_rows: int  # N of a padded layout (to make neighbour indices local), else 0
    validate: bool = False  # what the custom op's own value checks should do: True only where the
    # layout layer could not check the values (under torch.compile) and the caller asked for checks


def padded_groups(b: int, size: int, lengths: Optional[torch.Tensor], pad_id: int, device) -> torch.Tensor:
    sample = torch.arange(b, dtype=torch.int32, device=device)[:, None].expand(b, size)
    if lengths is None:
        return sample.reshape(-1).contiguous()
    valid = torch.arange(size, device=device)[None, :] < lengths[:, None]
    return torch.where(valid, sample, pad_id).reshape(-1).contiguous()


_SMALL_INTS = (torch.int8, torch.uint8, torch.int16, torch.int32)


def _int32_ids(query_batch: torch.Tensor, ref_batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sample ids as the int32 groups of the kernels, equal exactly where the ids are equal.

    Ids of a wider type (int64) are kept when all of them fit in int32 (ops may index per-sample
    tensors with them); otherwise (e.g. 2**32 + 1) all are replaced by their rank in the sorted
    union of query and ref ids, so ids that differ only above bit 31 never merge two samples.
    On CUDA (and under torch.compile) both are computed and one is picked on the device: static
    shapes, no host synchronisation; on the CPU the sort runs only when some id does not fit.
    One tensor of ids for both (a cloud searched in itself) gives one tensor of groups for both,
    so the search sees the same cloud (a kd-tree forest's self-query takes its queries in the
    trees' order).
    """
    if query_batch is ref_batch:
        groups = _int32_ids(query_batch, query_batch[:0])[0]
        return groups, groups
    if query_batch.dtype in _SMALL_INTS and ref_batch.dtype in _SMALL_INTS:
        return query_batch.to(torch.int32), ref_batch.to(torch.int32)
    info = torch.iinfo(torch.int32)
    if query_batch.device.type == "cpu" and ref_batch.device.type == "cpu" and not torch.compiler.is_compiling():  # no device to sync
        if all(_fits(t, info) for t in (query_batch, ref_batch)):  # the common case: no sort, no concatenation
            return query_batch.to(torch.int32), ref_batch.to(torch.int32)
    both = torch.cat([query_batch.to(torch.int64), ref_batch.to(torch.int64)])
    fits = ((both >= info.min) & (both <= info.max)).all()
    groups = torch.where(fits, both, torch.searchsorted(torch.sort(both).values, both)).to(torch.int32)
    return groups[: query_batch.shape[0]], groups[query_batch.shape[0] :]


def _fits(ids: torch.Tensor, info) -> bool:
    """Whether every id of a CPU tensor lies in the range of ``info`` (an empty tensor: yes)."""
    if not ids.numel():
        return True
    low, high = torch.aminmax(ids)
    return int(low) >= info.min and int(high) <= info.max


def pair(
    query,
    ref,
    features=None,
    *,
    query_lengths=None,
    ref_lengths=None,
    query_batch=None,
    ref_batch=None,
    validate: bool = True,
    dim: Optional[int] = 3,
    names: Names = PAIR,
    finite: Optional[dict] = None,
    positive: Optional[dict] = None,
    ranges: Optional[dict] = None,
) -> Flat:
    """The layout of a two-cloud op, checked and flattened (see the module docs).

    Every check of the layout runs here, and every message names the caller's argument (``names``).
    Shapes, dtypes and devices always; with ``validate`` and not under ``torch.compile``, the values
    too, in one host read for the whole call: lengths and ids in range, no NaN/inf in the points
    and features, and the op's own tensors ``finite`` (name -> tensor, no NaN/inf) and ``positive``
    (name -> tensor, finite and > 0 in the op's compute dtype) and ``ranges`` (name -> (tensor, low,
    high), e.g. packed ids below a given number of samples). Under ``torch.compile`` the range checks are skipped and the
    NaN/inf checks are left to the custom op (``Flat.validate``). ``dim`` is the points' last
    dimension; None accepts any D >= 1 shared by query and ref (feature-space search).
    """
    if query_lengths is None and ref_lengths is None and query_batch is None and ref_batch is None and positive is None \
            and ranges is None and _plain(validate, dim, finite, query, ref, features):
        return Flat(query, ref, features, None, None, (), 0)
    batch = dict(query_lengths=query_lengths, ref_lengths=ref_lengths, query_batch=query_batch, ref_batch=ref_batch)
    padded = _validate.layout(query, ref, features, **batch, dim=dim, names=names)
    checked = _check_values(validate, names, query, ref, features, batch, finite, positive, same=False, ranges=ranges)
    return _flat(query, ref, features, padded, batch, validate and not checked)


def single(
    points,
    features=None,
    *,
    lengths=None,
    batch=None,
    validate: bool = True,
    dim: Optional[int] = 3,
    name: str = "points",
    features_name: str = "features",
    finite: Optional[dict] = None,
    positive: Optional[dict] = None,
    ranges: Optional[dict] = None,
    flatten: bool = True,
) -> Flat:
    """The layout of a one-cloud op (a cloud searched against itself): ``points`` (P, 3), padded
    (B, P, 3) with ``lengths`` (B,), or packed (P_total, 3) with ``batch`` (P_total,). Checked as
    :func:`pair` checks (messages name ``name``, ``lengths``, ``batch``) and flattened with the
    points as both query and ref. ``ranges`` (name -> (tensor, low, high)) adds range checks of
    the op's own (e.g. packed ids below the number of per-sample viewpoints). ``flatten=False``
    only checks: the result holds the tensors as given and ``validate`` for the op."""
    if lengths is None and batch is None and positive is None and ranges is None and _plain(validate, dim, finite, points, points, features):
        return Flat(points, points, features, None, None, (), 0)
    names = Names(name, name, features_name, "lengths", "lengths", "batch", "batch")
    layout = dict(query_lengths=lengths, ref_lengths=lengths, query_batch=batch, ref_batch=batch)
    padded = _validate.layout(points, points, features, **layout, dim=dim, names=names)
    checked = _check_values(validate, names, points, points, features, layout, finite, positive, same=True, ranges=ranges)
    if not flatten:  # an op that takes the layout as it is (FPS runs on padded blocks): checks only
        return Flat(points, points, features, None, None, (), 0, validate and not checked)
    return _flat(points, points, features, padded, layout, validate and not checked)


def _plain(validate: bool, dim, finite, query, ref, features) -> bool:
    """Whether an eager call's clouds are one plain CPU cloud each ((P, dim) and (R, dim) floating
    tensors, features (R, F) or None), the values finite where ``validate`` asks (with the op's
    ``finite`` tensors): then every check of :func:`pair` / :func:`single` passes and nothing is to
    flatten, and the layout is the tensors themselves, its values checked (a sum each, read at once).
    False sends the call through the checks, which decide (and name what fails)."""
    if type(query) is not torch.Tensor or type(ref) is not torch.Tensor or dim is None or torch.compiler.is_compiling():
        return False
    if query.dim() != 2 or ref.dim() != 2 or query.shape[1] != dim or ref.shape[1] != dim or not (query.is_cpu and ref.is_cpu):
        return False
    if not (query.dtype.is_floating_point and ref.dtype.is_floating_point):
        return False
    if features is not None and (type(features) is not torch.Tensor or features.dim() != 2 or features.shape[0] != ref.shape[0]
                                 or not features.is_cpu or not features.dtype.is_floating_point):
        return False
    if not validate:
        return True
    extra = tuple((finite or {}).values())
    if not all(t is None or (type(t) is torch.Tensor and t.is_cpu) for t in extra):
        return False
    return _finite_sums(query, ref, features, *extra)


def _finite_sums(*tensors) -> bool:
    """Whether the sum of each CPU tensor is finite (None skipped; a tensor given twice, such as
    a cloud that is both query and ref, summed once): the layout's value check of plain inputs."""
    summed: list = []  # (loops: a small call's generators cost more than its sums)
    for t in tensors:
        if t is None or _any_is(t, summed):
            continue
        if not _validate.sum_is_finite(t):
            return False
        summed.append(t)
    return True


def _any_is(t, items) -> bool:
    """Whether ``t`` is one of ``items`` (identity: ``in`` would compare tensors by value)."""
    for u in items:
        if u is t:
            return True
    return False


def plain_clouds(validate: bool, *clouds, features: Optional[torch.Tensor] = None, dims: int = 2) -> bool:
    """Whether the clouds of an eager call are plain, for the ops that then call their kernels
    directly (``knn``, ``ball_query``, ``farthest_point_sample``, ``radius_aggregate``): each a
    (P, 3) CPU tensor, all of one dtype, float32 or float64, with nothing to differentiate and no
    mode, transform or tracer active (:func:`pcops._threads.plain_device`), and with ``validate``
    each one's sum finite (a cloud given twice is summed once); ``features`` too, if given, (R, F)
    of any F. Every layout check passes on such clouds, and nothing is to flatten or convert.
    ``dims=3``: each cloud one padded sample (1, P, 3) instead (chamfer's call as PyTorch3D's).
    False sends the call through the layout layer, which decides."""
    if type(clouds[0]) is not torch.Tensor or not _threads.plain_eager():  # (not a tensor, traced: the layout layer's checks)
        return False
    dtype = clouds[0].dtype
    if dtype is not torch.float32 and dtype is not torch.float64:
        return False
    grad = torch.is_grad_enabled()
    last = None
    for t in clouds:  # (:func:`pcops._threads.plain_device`'s tests, inline: a float tensor is never conjugated)
        if t is last:  # (a cloud searched in itself: tested once)
            continue
        if (type(t) is not torch.Tensor or t.dim() != dims or t.shape[-1] != 3 or (dims != 2 and t.shape[0] != 1) or t.dtype is not dtype
                or not t.is_cpu or (grad and t.requires_grad) or t.is_neg()):
            return False
        last = t
    if features is not None:
        if (type(features) is not torch.Tensor or features.dim() != 2 or features.dtype is not dtype or not features.is_cpu
                or (grad and features.requires_grad) or features.is_neg()):
            return False
        clouds = (*clouds, features)
    return not validate or _finite_sums(*clouds)


def _check_values(validate, names: Names, query, ref, features, batch: dict, finite, positive, same: bool, ranges=None) -> bool:
    """The value checks of a layout (and the op's tensors), in one host read; whether they ran."""
    checks = _validate.checks(validate)
    if checks is None:
        return False
    if any(t is not None for t in batch.values()):
        padded = query.dim() == 3
        for which, rows in (("query", query), ("ref", ref))[: 1 if same else 2]:
            checks.in_range(getattr(names, f"{which}_lengths"), batch[f"{which}_lengths"], 0, rows.shape[1] if padded else 0)
            checks.in_range(getattr(names, f"{which}_batch"), batch[f"{which}_batch"], 0, None)
    checks.finite(names.query, query)
    if not same and ref is not query:  # knn(points, points): one cloud, checked once
        checks.finite(names.ref, ref)
    checks.finite(names.features, features)
    for name, t in (finite or {}).items():
        checks.finite(name, t)
    if positive:
        dtype = _validate.compute_dtype(*(t for t in (query, ref, features) if t is not None))[0]
        for name, t in positive.items():
            checks.positive(name, t.to(dtype))  # > 0 in the dtype it is computed in
    for name, (t, low, high) in (ranges or {}).items():
        checks.in_range(name, t, low, high)
    checks.run()
    return True


def _flat(query, ref, features, padded: bool, batch: dict, validate: bool) -> Flat:
    d = query.shape[-1]
    if not padded:
        qb, rb = batch["query_batch"], batch["ref_batch"]
        qg, rg = (None, None) if qb is None else _int32_ids(qb, rb)
        return Flat(query, ref, features, qg, rg, (), 0, validate)
    b, m, n = query.shape[0], query.shape[1], ref.shape[1]
    lengths_q, lengths_r = batch["query_lengths"], batch["ref_lengths"]
    flat_features = None if features is None else features.reshape(b * n, features.shape[-1])
    if b == 1 and lengths_q is None and lengths_r is None:  # one whole cloud: no groups needed
        return Flat(query.reshape(m, d), ref.reshape(n, d), flat_features, None, None, (b, m), n, validate)
    qg = padded_groups(b, m, lengths_q, b, query.device)
    rg = padded_groups(b, n, lengths_r, b + 1, query.device)
    return Flat(query.reshape(b * m, d), ref.reshape(b * n, d), flat_features, qg, rg, (b, m), n, validate)


def unflatten(flat: Flat, out: torch.Tensor) -> torch.Tensor:
    """A per-query result (P, ...) in the caller's layout: (B, M, ...) for padded inputs."""
    return out.reshape(*flat.batch_shape, *out.shape[1:]) if flat.batch_shape else out


def local_index(flat: Flat, idx: torch.Tensor) -> torch.Tensor:
    """Neighbour indices into the flat ref as the caller indexes ref: per sample for padded inputs."""
    if not flat.batch_shape:
        return idx
    b, m = flat.batch_shape  # query row r is in sample r // m, whose ref rows start at (r // m) * N
    start = torch.arange(b, device=idx.device) * flat.ref_rows
    local = idx.reshape(b, m * math.prod(idx.shape[1:])) - start[:, None]  # a sample's own rows: 0 .. N - 1; -1 (none): below 0 (no -1 in the shape: B may be 0)
    return local.clamp_min_(-1).view(idx.shape)


def select_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for flat rows x (P, ...) and any shape of indices: one ``index_select``,
    whose backward on the CPU (an index_add) is several times faster than advanced
    indexing's (an accumulating index_put) (docs/benchmarks.md, design choices)."""
    return x.index_select(0, idx.reshape(-1)).view((*idx.shape, *x.shape[1:]))  # (a tuple: a 0-d idx of 1-d x is view(()))


def sample_count(x, x_batch, y_batch, batch_size, rows: bool = True) -> tuple[int, dict | None]:
    """The number of samples of a pair of clouds x, y (padded x: its batch; packed: ``batch_size``,
    else the largest id + 1, one host read), and the range checks of packed ids that it implies
    (below it), for :func:`values`: the one rule of chamfer, Sinkhorn and EMD.
    Packed ids number the samples: ``rows`` (a result or work with a row per sample) rejects ids
    that ask for more samples than there are points (ids near 2**32 asked for 2**32 rows)."""
    if x.dim() == 3:
        return x.shape[0], None
    if x_batch is None:
        return 1, None
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, torch.SymInt)) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        # ids past batch_size would index out of range: checked with the layout's values
        return batch_size, dict(x_batch=(x_batch, 0, batch_size - 1), y_batch=(y_batch, 0, batch_size - 1))
    _validate.compile_needs("batch_size", batch_size, "the number of samples of packed inputs, else read from the ids")
    ids = [t for t in (x_batch, y_batch) if t is not None and t.numel()]
    samples = max((int(t.max()) for t in ids), default=0) + 1
    points = sum(t.shape[0] for t in ids)
    if rows and samples > max(points, 1):
        raise ValueError(f"x_batch and y_batch number the samples (the result has a row for each number up to the largest): "
                         f"the largest, {samples - 1}, asks for {samples} rows for {points} points; number the samples "
                         "0 .. B-1, or pass batch_size=B")
    return samples, None
