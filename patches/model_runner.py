"""Give the FAFO proposer the request ids vLLM's proposer contract lacks.

Wraps two methods of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``
(vLLM 0.32.0; ``CPUModelRunner`` inherits both):

- ``_update_states(scheduler_output)``: after it runs, the proposer frees the
  state of ``scheduler_output.finished_req_ids`` (finished or aborted).
  With lanes, the step is marked for ``vllm_fafo.patches.tail`` to plan,
  and any plan left from a step whose proposer did not run is dropped.
- ``propose_draft_token_ids(scheduler_output, sampled_token_ids,
  sampling_metadata, hidden_states, ...)``: before it runs, the proposer
  learns ``input_batch.req_ids``, the row order of the ``sampled_token_ids``
  it is about to receive, and the lanes read their logits from
  ``hidden_states``.

Other drafters pass through untouched.
"""

from __future__ import annotations

import functools

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_fafo.patches.guard import require_signature
from vllm_fafo.patches.tail import PENDING_STEP
from vllm_fafo.proposer import FafoProposer


def _fafo_drafter(runner: GPUModelRunner) -> FafoProposer | None:
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, FafoProposer) else None


def apply() -> None:
    original_update = require_signature(
        GPUModelRunner, "_update_states", ["self", "scheduler_output"]
    )
    original_propose = require_signature(
        GPUModelRunner,
        "propose_draft_token_ids",
        ["self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states"],
    )

    @functools.wraps(original_update)
    def _update_states(self, scheduler_output):
        result = original_update(self, scheduler_output)
        drafter = _fafo_drafter(self)
        if drafter is not None:
            drafter.remove_requests(scheduler_output.finished_req_ids)
            if drafter.lanes is not None:
                drafter.lanes.clear_step()
                setattr(self, PENDING_STEP, scheduler_output)
        return result

    @functools.wraps(original_propose)
    def propose_draft_token_ids(
        self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
        *args, **kwargs,
    ):
        drafter = _fafo_drafter(self)
        if drafter is not None:
            drafter.set_batch_order(list(self.input_batch.req_ids))
            if drafter.lanes is not None:
                drafter.consume_tail(hidden_states)
        return original_propose(
            self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            *args, **kwargs,
        )

    _update_states.vllm_fafo_patch = propose_draft_token_ids.vllm_fafo_patch = __name__
    GPUModelRunner._update_states = _update_states
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
