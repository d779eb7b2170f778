"""vllm_fafo.direct_call: a numba kernel called past its dispatcher, against the dispatcher."""

import operator

import numpy as np
import pytest
from numba import njit

from vllm_fafo.direct_call import DirectCall


@njit(cache=True)
def _first_plus(values, scale, offset):
    """``values[0] * scale + offset`` (a kernel whose answer depends on its array's dtype being read right)."""
    return values[0] * scale + offset


def test_a_direct_call_answers_as_the_dispatcher_and_resolves_only_where_an_array_is_another_object():
    call = DirectCall(_first_plus, 1)
    ints = np.array([7, 1], dtype=np.int32)
    assert call(ints, 3, 1) == _first_plus(ints, 3, 1) == 22
    assert call.resolutions == 1 and call.arrays[0] is ints
    ints[0] = 5  # the same object, new contents: no new resolution, the new answer
    assert call(ints, 2, 0) == 10
    assert call.resolutions == 1
    # another object of another dtype: read through the dispatcher and resolved again;
    # the int32 entry point would read these float64 bytes as garbage
    floats = np.array([2.5, 0.0], dtype=np.float64)
    assert call(floats, 2, 0) == 5.0
    assert call.resolutions == 2 and call.arrays[0] is floats
    assert call(floats, 4, 1) == 11.0
    assert call(ints, 1, 0) == 5  # back: resolved again
    assert call.resolutions == 3


def test_the_hot_paths_inline_form_takes_the_entry_point_only_for_the_resolved_arrays():
    call = DirectCall(_first_plus, 1)
    values = np.array([4], dtype=np.int64)
    other = np.array([9], dtype=np.int64)
    args = (values, 2, 1)
    assert not all(map(operator.is_, args, call.arrays))  # unresolved: the placeholders match nothing
    assert call(*args) == 9
    assert all(map(operator.is_, args, call.arrays)) and call.entry is not _first_plus
    assert call.entry(*args) == 9
    assert not all(map(operator.is_, (other, 2, 1), call.arrays))


def test_a_direct_call_refuses_what_it_cannot_call_directly():
    with pytest.raises(TypeError, match="numba dispatcher"):
        DirectCall(_first_plus.py_func, 1)
    with pytest.raises(ValueError, match="at least one array"):
        DirectCall(_first_plus, 0)


def test_a_kernel_of_one_compiled_signature_is_resolved_to_it_without_typing_again():
    """Where the kernel holds one compiled signature after the dispatcher ran it, that is
    the one it ran (a new type compiles a second): the entry point is taken without typing
    the arguments in Python, and an array grown into a new object of the same type reads
    right through it."""

    @njit
    def scaled_sum(values, scale):
        return values.sum() * scale

    call = DirectCall(scaled_sum, 1)
    first = np.arange(4, dtype=np.int64)
    assert call(first, 2) == 12 and len(scaled_sum.overloads) == 1
    entry = call.entry
    grown = np.arange(8, dtype=np.int64)  # another object, as an owner's array grown
    assert call(grown, 1) == 28
    assert call.resolutions == 2 and call.arrays[0] is grown and call.entry is entry
    assert call.entry(grown, 3) == 84
    assert call(np.arange(3, dtype=np.float64), 2) == 6.0 and len(scaled_sum.overloads) == 2
    assert call.resolutions == 3 and call.entry is not entry
    assert call(grown, 1) == 28 and call.entry is entry  # resolved among two by the arguments' types
