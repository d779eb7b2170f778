"""What a call from Python costs between two forwards, when the caches are cold.

A CPU forward reads the model's weights (hundreds of MiB) and leaves nothing of
the proposer's code or objects in the processor's caches; a numba call then
pays for every Python object it unboxes. This times calls back to back
(warm) and each after touching ``--evict-mib`` MiB (cold, as after a
forward): a Python function, a numpy call, numba kernels taking 1 to 64
arrays or one structref holding 64 (numba reads it as one object: what handing
the step's arrays over in one object would cost), and FAFO's step kernel (:func:`vllm_fafo.propose_kernel.propose_step`)
as :mod:`proposer_step_cost` drives the proposer at batch 1 and 32 (cold only;
a trivial kernel taking the same arguments beside it, the arguments' share,
called as the proposer calls the step's kernel, past numba's dispatcher
(:class:`vllm_fafo.direct_call.DirectCall`), and through the dispatcher).
Median us per call.

    python benchmarks/cold_calls.py
"""

from __future__ import annotations

import argparse
import inspect
import operator
import statistics
import time

import numpy as np
from numba import njit, types
from numba.experimental import structref


def timer(evict_mib: int):
    """``time_call(call)``: the call's seconds, after evicting the caches where asked."""
    junk = np.ones((evict_mib << 20) // 8)

    def time_call(call, cold: bool) -> float:
        if cold:
            junk[::8] += 1.0  # a write to every cache line
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    return time_call


def kernel_taking(count: int):
    """A numba kernel of ``count`` array arguments that reads one element."""
    names = ", ".join(f"a{i}" for i in range(count))
    namespace: dict = {}
    exec(f"def kernel({names}):\n    return a0[0]\n", namespace)  # noqa: S102 - a fixed template
    return njit(namespace["kernel"])


@structref.register
class _HeldType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(kind)) for name, kind in fields)


class _Held(structref.StructRefProxy):
    """64 arrays in one numba structref."""


HELD_FIELDS = 64
structref.define_proxy(_Held, _HeldType, [f"a{i}" for i in range(HELD_FIELDS)])


@njit
def _read_held(held):
    return held.a0[0]


def call_rows(evict_mib: int, calls: int) -> list[str]:
    time_call = timer(evict_mib)
    small = np.zeros(8, dtype=np.int64)
    cases = {"Python function": (lambda: None), "numpy call (np.minimum of two 8-element arrays)":
             (lambda: np.minimum(small, small))}
    for count in (1, 8, 32, 64):
        arrays = [np.zeros(8 + i, dtype=np.int64) for i in range(count)]
        kernel = kernel_taking(count)
        kernel(*arrays)  # compile
        cases[f"numba kernel taking {count} array{'s' if count > 1 else ''}"] = lambda kernel=kernel, arrays=arrays: kernel(*arrays)
    held = _Held(*(np.zeros(8 + i, dtype=np.int64) for i in range(HELD_FIELDS)))
    _read_held(held)  # compile
    cases[f"numba kernel taking a structref of {HELD_FIELDS} arrays"] = lambda: _read_held(held)
    rows = []
    for name, call in cases.items():
        warm = statistics.median(time_call(call, False) for _ in range(calls))
        cold = statistics.median(time_call(call, True) for _ in range(calls))
        rows.append(f"| {name} | {1e6 * warm:.1f} | {1e6 * cold:.1f} |")
    return rows


def step_kernel_rows(evict_mib: int, steps: int) -> list[str]:
    """FAFO's step kernel, cold, in proposer_step_cost.py's steps, called as the proposer
    calls it (:class:`~vllm_fafo.direct_call.DirectCall`'s entry point, where its arrays
    stand), beside a trivial kernel taking the same arguments, called so and through
    numba's dispatcher (the arguments' share)."""
    import proposer_step_cost

    from vllm_fafo import propose_kernel
    from vllm_fafo import proposer as proposer_module
    from vllm_fafo.direct_call import DirectCall

    time_call = timer(evict_mib)

    names = ", ".join(inspect.signature(propose_kernel.propose_step.py_func).parameters)
    namespace: dict = {}
    exec(f"def same_arguments({names}):\n    return batch[0, 0] if count else 0\n", namespace)  # noqa: S102
    same_arguments = njit(namespace["same_arguments"])
    direct_same_arguments = DirectCall(same_arguments, 5)

    seconds: dict[str, list[float]] = {"step": [], "direct": [], "dispatcher": []}

    class TimedStepCall(DirectCall):
        """The proposer's step call, each call of its entry point timed, with the trivial
        kernel's two calls beside it."""

        @property
        def entry(self):
            real = self._entry

            def timed(*args):
                trivial = direct_same_arguments  # called in the proposer's hot-path form
                seconds["direct"].append(time_call(
                    lambda: trivial.entry(*args) if all(map(operator.is_, args, trivial.arrays)) else trivial(*args),
                    True))
                seconds["dispatcher"].append(time_call(lambda: same_arguments(*args), True))
                result = []
                seconds["step"].append(time_call(lambda: result.append(real(*args)), True))
                return result[0]

            return timed

        @entry.setter
        def entry(self, value):
            self._entry = value

    rows = []
    proposer_module.DirectCall = TimedStepCall  # the proposers measure() makes
    try:
        for batch in (1, 32):
            for series in seconds.values():
                series.clear()
            proposer_step_cost.measure(batch, 128, steps, "goodput")
            first = min(10, len(seconds["step"]) // 2)  # the first steps grow the arrays
            median = {name: 1e6 * statistics.median(series[first:]) for name, series in seconds.items()}
            rows.append(f"| step kernel, batch {batch} | - | {median['step']:.1f} |")
            rows.append(f"| a trivial kernel taking its arguments, batch {batch} | - | {median['direct']:.1f} |")
            rows.append(f"| the same through numba's dispatcher, batch {batch} | - | {median['dispatcher']:.1f} |")
    finally:
        proposer_module.DirectCall = DirectCall
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--evict-mib", type=int, default=96, help="MiB touched before a cold call (above the L3)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--steps", type=int, default=200, help="proposer_step_cost.py steps per batch size")
    args = parser.parse_args()
    print("| call | warm us | cold us |")
    print("|---|---|---|")
    for row in call_rows(args.evict_mib, args.calls) + step_kernel_rows(args.evict_mib, args.steps):
        print(row)


if __name__ == "__main__":
    main()
