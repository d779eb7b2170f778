"""The step kernel's arrays that outlive a step, handed over as one object.

Between two forwards the processor's caches are cold, and a numba call pays for
every Python object it types and unboxes. :func:`~vllm_fafo.propose_kernel.propose_step`
takes about 60 arrays and scalars; a trivial kernel taking them in tuples, as the
owners built them, cost 61-83 us cold (2-core CPU), one taking the same tuples in
one numba structref 32-40, and one taking the owners' tuples in a structref and the
controller's three beside it as much as the tuples (docs/results/host-time.md).
The request table's, the metrics', the draft index's, its outputs', the judge's
and the controller's arrays (its three cost curves, the step's picked by number)
change only where one of them grows (reallocates), so :class:`StepArrays` holds
them and the proposer makes a new one only where an owner may have grown
(:func:`same_or_new` tells whether one did); what changes every step (the batch,
the controller's counts and which curves price the step) is passed beside it as
arrays and scalars.
"""

from __future__ import annotations

from numba import njit, types
from numba.experimental import structref

FIELDS = ("table", "counts", "index", "outputs", "judge", "learning", "curves", "choice")
""":class:`StepArrays`' fields: :meth:`RequestTable.kernel_arguments`' two tuples,
:meth:`DraftIndex.kernel_arguments`' two, :meth:`DraftJudge.kernel_arguments`', and the
controller's three (:meth:`GoodputController.kernel_arguments`)."""


@structref.register
class StepArraysType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(kind)) for name, kind in fields)


class StepArrays(structref.StructRefProxy):
    """The step kernel's tuples of arrays (:data:`FIELDS`), read by numba as one object.
    It holds references: the arrays' contents change under it, their identity must not."""

    def __new__(cls, table: tuple, counts: tuple, index: tuple, outputs: tuple, judge: tuple, learning: tuple,
                curves: tuple, choice: tuple) -> StepArrays:
        return _new_step_arrays(table, counts, index, outputs, judge, learning, curves, choice)


structref.define_proxy(StepArrays, StepArraysType, list(FIELDS))


@njit(cache=True)
def _new_step_arrays(table, counts, index, outputs, judge, learning, curves, choice):
    """numba's constructor, cached (``define_proxy``'s own compiles in every process: about 1 s)."""
    return StepArrays(table, counts, index, outputs, judge, learning, curves, choice)


_SCALARS = (int, bool, float)


def same_or_new(held: tuple | None, parts: tuple) -> tuple:
    """``held`` where its items are the very objects of ``parts`` (nothing was
    reallocated; scalars equal), else ``parts``: a tuple of arrays whose identity stands
    for its contents' place in memory."""
    if held is None:
        return parts
    for old, new in zip(held, parts):
        if old is not new and not (type(old) in _SCALARS and old == new):
            return parts
    return held
