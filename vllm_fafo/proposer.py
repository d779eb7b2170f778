"""FafoProposer: vLLM's custom-proposer contract around the n-gram pool.

vLLM calls :meth:`FafoProposer.propose` once per step after sampling, with
the accepted tokens of each request in batch order (see
``GPUModelRunner.propose_draft_token_ids``). The request ids of that order
and the finished requests come from the runner patches in
``vllm_fafo.patches.model_runner``, because the contract itself carries no
request ids.

Per step and request the work is bounded by the tokens accepted this step
times K: new n-grams are filed from a short window of the history row vLLM
already keeps, never from a scan of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm.config import VllmConfig
from vllm.logger import init_logger

from vllm_fafo.config import ADDITIONAL_CONFIG_KEY, FafoConfig
from vllm_fafo.frozen_table import load_table
from vllm_fafo.fumble import BatchView, FumbleLanes
from vllm_fafo.metrics import FafoMetrics
from vllm_fafo.pool import NgramPool, Origin

logger = init_logger(__name__)


@dataclass
class RequestState:
    """What the proposer keeps for one running request."""

    pool: NgramPool
    prompt_len: int
    next_anchor: int
    """First history position whose following n-gram is not filed yet."""
    last_draft_origins: list[Origin] = field(default_factory=list)
    """Where each token of the last draft came from."""


def file_ngrams(
    pool: NgramPool,
    history: Sequence[int],
    offset: int,
    anchors: range,
    ngram_len: int,
    prompt_len: int,
) -> None:
    """File, for each anchor a, ``history[a+1 : a+1+ngram_len]`` under the
    suffixes of ``history[: a+1]`` (FAFO Alg. 2 applied to decoded text).

    ``history`` holds the tokens from absolute position ``offset`` on.
    """
    for anchor in anchors:
        end = anchor + 1 - offset
        candidate = tuple(history[end : end + ngram_len])
        key_start = max(0, end - pool.max_key_len)
        origin = Origin.PROMPT if anchor + ngram_len < prompt_len else Origin.OUTPUT
        pool.add(history[key_start:end], candidate, origin)


class FafoProposer:
    """Proposes one draft chain per request per step (FAFO Alg. 3).

    Serves ``fafo``, ``lookahead`` and ``cacheback`` (see vllm_fafo.modes):
    they differ only in the configuration of the pool and the lanes.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        spec_config = vllm_config.speculative_config
        assert spec_config is not None
        settings = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if settings is None:
            raise RuntimeError(
                "FafoProposer needs additional_config['fafo']; enable FAFO with "
                "speculative_config={'method': 'fafo', ...} and the vllm-fafo plugin "
                "loaded, not by naming this class directly"
            )
        self.config = FafoConfig.from_dict(settings)
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.metrics = FafoMetrics()
        self._requests: dict[str, RequestState] = {}
        self._batch_req_ids: Sequence[str] | None = None
        self._model = None
        self.frozen: NgramPool | None = None
        if self.config.frozen_table is not None:
            self.frozen = load_table(self.config.frozen_table, self.config.max_key_len,
                                     self.config.ngram_len)
        self.lanes: FumbleLanes | None = None
        if self.config.num_lanes > 0:
            self.lanes = FumbleLanes(
                num_lanes=self.config.num_lanes,
                lane_len=self.config.lane_len,
                max_key_len=self.config.max_key_len,
                max_drafts=self.num_speculative_tokens,
                max_model_len=self.max_model_len,
                region_rows=min(self.config.max_lane_requests,
                                vllm_config.scheduler_config.max_num_seqs),
                policy=self.config.make_policy(),
                stagger_lanes=self.config.stagger_lanes,
                device=vllm_config.device_config.device,
            )

    # Called by the runner patches -------------------------------------------------
    def set_batch_order(self, req_ids: Sequence[str]) -> None:
        """Request ids of this step's rows, in the order ``propose`` sees them."""
        self._batch_req_ids = req_ids

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Free the state of finished or aborted requests."""
        req_ids = list(req_ids)
        for req_id in req_ids:
            if self._requests.pop(req_id, None) is not None:
                self.metrics.requests_freed += 1
        if self.lanes is not None:
            self.lanes.remove_requests(req_ids)

    def plan_tail(self, batch: BatchView):
        """Lane tail of this step (token ids, positions); see FumbleLanes."""
        assert self.lanes is not None
        ids, positions = self.lanes.plan_step(batch)
        self.metrics.tail_tokens += len(ids)
        return ids, positions

    def consume_tail(self, hidden_states) -> None:
        """Advance the lanes that ran this step and file their n-grams."""
        assert self.lanes is not None
        for req_id, ngrams in self.lanes.consume_tail(hidden_states, self._model.compute_logits):
            pool = self._requests[req_id].pool
            for context, ngram in ngrams:
                pool.add(context, ngram, Origin.LANE)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)

    # vLLM's custom proposer contract ----------------------------------------------
    def load_model(self, model, *args, **kwargs) -> None:
        """Nothing to load (FAFO is draftless); lanes read the target's logits."""
        self._model = model

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
    ) -> list[list[int]]:
        req_ids = self._batch_req_ids
        if req_ids is None or len(req_ids) < len(sampled_token_ids):
            raise RuntimeError(
                "FafoProposer.propose was called without the batch's request ids; "
                "the vllm_fafo runner patches are not applied in this process"
            )
        self._batch_req_ids = None
        self.metrics.propose_calls += 1
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a prefill chunk: nothing sampled, nothing to draft
                drafts.append([])
                continue
            num_tokens = int(num_tokens_no_spec[row])
            history = token_ids_cpu[row]
            state = self._state_for(req_ids[row], num_tokens - len(sampled), history)
            self.metrics.record_acceptance(state.last_draft_origins[: len(sampled) - 1])
            self._file_new_ngrams(state, history, num_tokens)
            drafts.append(self._draft(state, history, num_tokens))
        return drafts

    # Internals -----------------------------------------------------------------------
    def _state_for(self, req_id: str, prompt_len: int, history: np.ndarray) -> RequestState:
        state = self._requests.get(req_id)
        if state is None:
            if self.lanes is not None:
                self.lanes.start_lanes(req_id, history[:prompt_len].tolist())
            ngram_len = self.config.ngram_len
            first_anchor = 0 if self.config.seed_from_prompt else max(0, prompt_len - ngram_len)
            state = RequestState(
                pool=NgramPool(
                    self.config.max_key_len,
                    self.config.pool_capacity,
                    min_key_len=self.config.min_key_len,
                    max_keys=self.config.max_keys,
                    touch_on_lookup=self.config.touch_on_lookup,
                ),
                prompt_len=prompt_len,
                next_anchor=first_anchor,
            )
            self._requests[req_id] = state
            self.metrics.requests_started += 1
        return state

    def _file_new_ngrams(self, state: RequestState, history: np.ndarray, num_tokens: int) -> None:
        ngram_len = self.config.ngram_len
        stop_anchor = num_tokens - ngram_len  # anchors whose n-gram is complete
        if not self.config.seed_from_output:
            stop_anchor = min(stop_anchor, state.prompt_len - ngram_len)
        if stop_anchor <= state.next_anchor:
            return
        offset = max(0, state.next_anchor + 1 - self.config.max_key_len)
        window = history[offset:num_tokens].tolist()
        file_ngrams(
            state.pool,
            window,
            offset,
            range(state.next_anchor, stop_anchor),
            ngram_len,
            state.prompt_len,
        )
        state.next_anchor = stop_anchor

    def _draft(self, state: RequestState, history: np.ndarray, num_tokens: int) -> list[int]:
        """Chain candidates until the draft is full or no key matches: the
        request's pool first, then the frozen table (Cacheback Sec. 3.3)."""
        room = min(self.num_speculative_tokens, self.max_model_len - num_tokens)
        context = history[max(0, num_tokens - self.config.max_key_len) : num_tokens].tolist()
        draft: list[int] = []
        origins: list[Origin] = []
        while len(draft) < room:
            found = state.pool.lookup(context)
            if found is None and self.frozen is not None:
                found = self.frozen.lookup(context)
            if found is None:
                break
            candidate, origin = found
            piece = list(candidate[: room - len(draft)])
            draft += piece
            origins += [origin] * len(piece)
            context = (context + piece)[-self.config.max_key_len :]
        state.last_draft_origins = origins
        self.metrics.record_draft(origins)
        return draft
