"""The shared argument validators of pcops._validate: each rejects a bad value with the type and
message the ops rely on, naming the argument, and accepts a good one."""

import numpy as np
import pytest
import torch

from pcops import _validate


def test_int_option_bounds_odd_and_type():
    assert _validate.int_option("depth", np.int64(3), 1, 16) == 3
    assert _validate.int_option("kernel_size", 3, 1, odd=True) == 3
    with pytest.raises(ValueError, match=r"^kernel_size must be an odd int >= 1, got 2$"):
        _validate.int_option("kernel_size", 2, 1, odd=True)
    with pytest.raises(ValueError, match=r"^depth must be in \[1, 16\] \(bits per axis\), got 17$"):
        _validate.int_option("depth", 17, 1, 16, note=" (bits per axis)")
    with pytest.raises(ValueError, match=r"^seed must be <= 5, got 6$"):
        _validate.int_option("seed", 6, high=5)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="^num_segments must be an int, got"):
            _validate.int_option("num_segments", bad, 0)


def test_interval_numbers_and_0d_tensors():
    _validate.interval("ratio", 1, 0, 1, closed_high=True)
    _validate.interval("ratio", torch.tensor(0.5), 0, 1, closed_high=True, tensor=True)
    with pytest.raises(ValueError, match=r"^scaling must be in \(0, 1\), got 1.0$"):
        _validate.interval("scaling", 1.0, 0, 1)
    with pytest.raises(TypeError, match="^ratio must be a number, got Tensor"):
        _validate.interval("ratio", torch.tensor(0.5), 0, 1)
    with pytest.raises(TypeError, match=r"^ratio must be a number or a 0-d floating tensor, got a torch.int64 tensor of shape \(\)"):
        _validate.interval("ratio", torch.tensor(1), 0, 1, tensor=True)


def test_how_many_of_a_group_are_given():
    _validate.exactly_one(a=None, b=0)
    _validate.at_most_one(a=1, flag=False)
    _validate.together(a=1, b=2)
    _validate.together(a=None, b=None)
    with pytest.raises(ValueError, match="^give exactly one of a and b: a note$"):
        _validate.exactly_one(": a note", a=1, b=2)
    with pytest.raises(ValueError, match="^give seed or generator, not both$"):
        _validate.at_most_one(seed=1, generator=object())
    with pytest.raises(ValueError, match="^max_vertices and max_faces go together: give both or neither$"):
        _validate.together(max_vertices=3, max_faces=None)


def test_same_size_instance_and_compile_needs():
    _validate.same_size("features", 3, "weight", 3, "number of input channels")
    _validate.instance("generator", torch.Generator(), torch.Generator, "torch.Generator")
    _validate.compile_needs("depth", None, "eagerly it is read from the data")
    with pytest.raises(ValueError, match="^features and weight must have the same number of input channels, got 2 and 3$"):
        _validate.same_size("features", 2, "weight", 3, "number of input channels")
    with pytest.raises(TypeError, match="^generator must be a torch.Generator, got int$"):
        _validate.instance("generator", 3, torch.Generator, "torch.Generator")


def test_shape_takes_several_ranks_and_a_first_size():
    _validate.tensor("weight", torch.zeros(2, 2, 2, 1, 1), ndim=(3, 5), shape_doc="(K^3, C, D) or (K, K, K, C, D)")
    _validate.shape("values", torch.zeros(4, 2), ndim=range(1, 9), shape_doc="(N, ...)")
    with pytest.raises(ValueError, match=r"^weight must be a tensor of shape \(A\) or \(B\), got shape \(2, 2\)$"):
        _validate.tensor("weight", torch.zeros(2, 2), ndim=(3, 5), shape_doc="(A) or (B)")
    with pytest.raises(ValueError, match=r"^bias must be a tensor of shape \(Cout,\) = \(4,\), got shape \(3,\)$"):
        _validate.tensor("bias", torch.zeros(3), ndim=1, size=4, shape_doc="(Cout,)")


def test_one_of_compares_numbers_by_value_never_a_bool():
    _validate.one_of("p", 2.0, (1, 2))
    _validate.one_of("point_reduction", None, ("mean", None))
    for bad in (True, 3, "2"):
        with pytest.raises(ValueError, match=r"^p must be one of \(1, 2\), got"):
            _validate.one_of("p", bad, (1, 2))
    _validate.one_of("p", 1, (True, 1))  # an int option equal to it, after a bool's
    for bad, options in ((1, (True, 2)), (0, (False, 2))):  # a bool option equal to the int only
        with pytest.raises(ValueError, match=r"^p must be one of"):
            _validate.one_of("p", bad, options)


def test_integer_of_one_dtype_and_tensors_of_rows():
    _validate.integer("code", torch.zeros(3, dtype=torch.int64), ndim=(1, 2), dtype=torch.int64)
    _validate.shape("features", torch.zeros(3, 2, 1), ndim=_validate.ROWS)
    with pytest.raises(TypeError, match=r"^code must be int64 \(serialize's codes\), got torch.int32$"):
        _validate.integer("code", torch.zeros(3, dtype=torch.int32), what="serialize's codes", dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^features must be a tensor of shape \(N, ...\), got shape \(\)$"):
        _validate.shape("features", torch.zeros(()), ndim=_validate.ROWS, shape_doc="(N, ...)")


def test_reductions_of_a_loss():
    _validate.reductions("max", "sum", ("mean", "sum", "max", None))
    _validate.reductions(None, None, ("mean", None))
    with pytest.raises(ValueError, match="^batch_reduction must be None when point_reduction is None$"):
        _validate.reductions(None, "mean", ("mean", None))
    with pytest.raises(ValueError, match=r"^point_reduction must be one of \('mean', None\), got 'max'$"):
        _validate.reductions("max", None, ("mean", None))
