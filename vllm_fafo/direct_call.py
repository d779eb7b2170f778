"""A numba kernel called straight into the machine code compiled for its arguments.

A numba dispatcher types every argument of every call, then looks up the code
compiled for those types: between two forwards, with the processor's caches
cold, calling the step's kernel's compiled entry point instead saved 17-22 us a
step on the 2-core CPU at every batch size (docs/results/host-time.md; ``python
benchmarks/cold_calls.py`` times a trivial kernel both ways). The entry point unboxes arrays
without checking their types (numba 0.65.0), so :class:`DirectCall` calls it only
with the very array objects it was resolved for, and goes through the dispatcher
(resolving again) whenever one of them is another object.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from numba.core.dispatcher import Dispatcher

_UNRESOLVED = object()


class DirectCall:
    """``kernel(*args)``, where the first ``num_arrays`` arguments are arrays (or numba
    objects holding arrays) that stay the same objects call after call: their types are
    then the same, and the call may skip the dispatcher. The other arguments are scalars,
    converted to the types of the call it was resolved on (pass each the same Python
    type every call: a float passed where an int was resolved would be truncated).

    A hot path calls it without a Python frame of its own (a cold frame costs about as
    much as the dispatcher saves)::

        result = call.entry(*args) if all(map(operator.is_, args, call.arrays)) else call(*args)
    """

    def __init__(self, kernel: Dispatcher, num_arrays: int) -> None:
        if not isinstance(kernel, Dispatcher):
            raise TypeError(f"DirectCall needs a numba dispatcher (an @njit function), not {type(kernel).__name__}")
        if num_arrays < 1:
            raise ValueError(f"DirectCall needs at least one array argument to tell its types by, not {num_arrays}")
        self.kernel = kernel
        self.arrays: tuple = (_UNRESOLVED,) * num_arrays
        """The array objects :attr:`entry` was resolved for (placeholders before the first call)."""
        self.entry: Callable[..., Any] = kernel
        """The machine code's entry point for :attr:`arrays`' types (before the first call: the dispatcher)."""
        self.resolutions = 0
        """Calls that went through the dispatcher (the first, and each where an array was another object)."""

    def __call__(self, *args: Any) -> Any:
        if all(map(operator.is_, args, self.arrays)):
            return self.entry(*args)
        result = self.kernel(*args)  # typed, and compiled or loaded where new
        self._resolve(args)
        return result

    def _resolve(self, args: tuple) -> None:
        """The entry point of the code the dispatcher just ran for ``args``: the kernel's
        only one where it has one (the usual case; typing the step kernel's arguments in
        Python took 90-150 us a call, the dispatcher's own typing 11-20), else the one
        for their exact types."""
        overloads = self.kernel.overloads
        if len(overloads) == 1:
            compiled = next(iter(overloads.values()))
        else:
            types = tuple(map(self.kernel.typeof_pyval, args))
            compiled = overloads.get(types)
            if compiled is None:
                raise RuntimeError(
                    f"vllm-fafo: numba holds no code of {self.kernel.py_func.__qualname__} for the exact types "
                    f"{types} it was just called with (written against numba 0.65.0, whose dispatcher compiles "
                    "one for each new combination of types)"
                )
        self.arrays = args[: len(self.arrays)]
        self.entry = compiled.entry_point
        self.resolutions += 1
