"""FafoConfig: every user-facing knob of ``{"method": "fafo", ...}``.

vLLM's ``SpeculativeConfig`` only knows its own methods, so the plugin reads
the user's dict first (in the front process, see
``vllm_fafo.patches.engine_args``), validates it here with messages that name
the key, the value and what is allowed, and hands vLLM a ``custom_class``
config pointing at :class:`vllm_fafo.proposer.FafoProposer`. The validated
settings travel to the workers inside ``VllmConfig.additional_config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllm_fafo.control.goodput import CONTROLLERS
from vllm_fafo.drafting.deep_match import MATCH_DEPTH
from vllm_fafo.drafting.pool import RANKINGS
from vllm_fafo.drafting.prior_table import check_setting as check_prior_table
from vllm_fafo.errors import FafoConfigError, check_bool, check_int, unknown_key
from vllm_fafo.lanes.compression import POLICIES, CompressionPolicy
from vllm_fafo.lanes.compression.base import settings_keys

METHOD = "fafo"
ADDITIONAL_CONFIG_KEY = "fafo"
PROPOSER_CLASS_PATH = "vllm_fafo.proposer.FafoProposer"


def fafo_settings(vllm_config: Any) -> dict[str, Any] | None:
    """The validated FAFO settings the plugin stored in a vLLM config; None for other engines."""
    return (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)


def user_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """A user's speculative_config keys as field names: vLLM's CLI spells them with dashes."""
    return {k.replace("-", "_"): v for k, v in raw.items()}


@dataclass(frozen=True)
class FafoConfig:
    """Validated FAFO settings (FAFO Sec. 4.2-4.3, App. F)."""

    num_speculative_tokens: int = 16
    """Longest draft proposed per step (the candidate n-gram length k). Long because
    the goodput controller cuts each draft where its tokens stop paying, and a found
    continuation is often right for many tokens (code, quoted text; docs/results/goodput-controller.md "Draft length")."""
    max_key_len: int = 3
    """K: the longest suffix of the decoded text used as a pool key. 3: 4 had the same
    tau (within 0.2 % on three replayed sets) and files and looks up a quarter more keys
    per token (docs/results/draft-sources.md "Pool key length and candidates per key")."""
    pool_capacity: int = 16
    """Candidates kept per key of a pool (a tenant's, where ``share_pool``, else a request's);
    the least recently used one is evicted. 16: a tenant's pool holds what a request's own
    pool and its tenant's shared one held with 8 each (docs/results/host-time.md)."""
    seed_from_prompt: bool = True
    """Seed the pool with the prompt's n-grams at prefill."""
    num_lanes: int = 0
    """Fumble lanes per request (0: pool only). Lanes guess future n-grams
    on the compressed KV in the verification forward pass (FAFO Sec. 4.2).
    Off unless asked for, on every platform: lanes change each step's token count, so an
    engine with lanes runs eager (on an H100 an eager step with lanes cost more than lanes
    earned: 15.9 ms against 4.6 ms pool-only at batch 1, docs/results/gpu.md "GPU
    figures"); on the 2-core CPU measured the goodput controller kept 16 lanes parked at
    batch 1, 8 and 32 (their tokens did not pay at its price per token), and parked they
    still cost: the proposer's host time per step 1.20x-1.25x pool-only's, the lane
    attention wrapper in every layer, a region of KV cache per request; without them the
    engine made 1.05x-1.06x the tokens/s at the same tau (docs/results/host-time.md)."""
    lane_len: int = 6
    """Tokens per lane; the n-grams lanes file have this length."""
    compression: str = "streaming"
    """Which KV entries lanes see: a name in ``vllm_fafo.lanes.compression.POLICIES``
    (``streaming``, ``quest``, ``snapkv``, or ``none``: the full KV cache)."""
    sink_tokens: int = 4
    """StreamingLLM attention sinks kept in the compressed region."""
    kv_budget: int = 256
    """Tokens in each request's compressed region (sinks + recent window)."""
    max_lane_requests: int = 8
    """Requests that get a compressed region (and so lanes) at once; later
    ones run pool-only until a region frees up at their next prefill."""
    controller: str = "goodput"
    """``goodput``: each step, lanes per request and draft length are chosen to
    maximise accepted tokens per second on this machine (vllm_fafo.control.goodput),
    down to none; ``fixed``: always ``num_lanes`` (as the free token slots
    allow) and ``num_speculative_tokens``."""
    num_candidates: int = 1
    """Candidates verified per request per step: the draft (the spine) and up to
    ``num_candidates - 1`` alternative branches off its nodes, verified in the
    same forward (vllm_fafo.verification.draft_tree); 1: the spine only."""
    max_tree_tokens: int = 0
    """Draft tokens per request per step, spine and branches together; 0:
    ``num_candidates * num_speculative_tokens``."""
    share_pool: bool = True
    """File every request's n-grams into one pool per tenant (vLLM's ``cache_salt``;
    unsalted requests share one), each candidate tagged with the request that filed it,
    so that later and concurrent requests of the tenant draft from it, a request's own
    candidates weighing more (vllm_fafo.drafting.shared_pool); false: a pool per request."""
    shared_pool_mib: int = 32
    """MiB each tenant's pool holds besides its running requests' keys
    (vllm_fafo.drafting.shared_pool): every key is charged as if it held ``pool_capacity``
    candidates (``PoolArena.bytes_per_key``, 0.82 kB by default, so about 41,000 keys),
    and the tenant's first filed key is evicted past the bound. At most
    ``shared_pool_tenants`` tenants are kept."""
    shared_pool_tenants: int = 16
    """Tenants with a shared pool at once; the least recently used one is dropped."""
    tenant_answers_mib: int = 16
    """MiB of earlier requests' answers (outputs) kept per tenant for deep matches
    (vllm_fafo.drafting.deep_match; the earliest finished is dropped): an answer is charged
    its text's tokens (16 bytes each: the token and its chains' links) and 64 bytes per answer
    token for its chain cell (``TenantTexts.answer_charge``); 16 MiB holds ~776 answers of 250
    tokens after 100-token prompts. At most ``shared_pool_tenants`` tenants are kept. 0, or
    ``share_pool`` false: each request matches in its own text only."""
    pad_drafts: bool = False
    """Give every decoding request of a step the same number of draft tokens, its found
    draft filled up with filler tokens (the draft's last token repeated, the text's where
    nothing was found; verification stops at the first token the target does not
    produce, so filler is lossless): the uniform batch that vLLM's V1 runner replays as
    one whole CUDA graph (a step with drafts of different lengths runs piecewise,
    attention launched layer by layer). Under the ``fixed`` controller every step drafts
    ``num_speculative_tokens``; under ``goodput`` the controller picks one length per
    step for the whole batch from 0, 4, 8, 16 up to ``num_speculative_tokens``
    (vllm_fafo.control.goodput.DRAFT_TIERS). Needs ``num_candidates`` 1
    (docs/results/step-cost.md, docs/results/gpu.md)."""
    prior_table: str = "auto"
    """Where the text has no candidate, draft the target's own continuation of the text's
    last token from a table built once per model (vllm_fafo.drafting.prior_table): ``auto`` the
    table ``vllm-fafo-prior-table`` built for this model into the plugin's cache, if
    there is one (the start-up log says which); a path to such a table; ``off``."""
    compression_settings: dict[str, Any] = field(default_factory=dict)
    """The policy's own keys (``<policy>_<key>`` in the user's dict), by field name."""

    # Set by the ancestor modes (vllm_fafo.modes), not user keys of "fafo". ------
    method: str = METHOD
    """Which method the user asked for (``fafo``, ``lookahead``, ``cacheback``)."""
    min_key_len: int = 1
    """Shortest key a candidate is filed under (Cacheback: exactly LL)."""
    max_keys: int = 0
    """LRU cap on keys per request (Cacheback's LC); 0: none."""
    touch_on_lookup: bool = True
    """A lookup refreshes the candidate it returns (FAFO); Cacheback and
    Lookahead refresh candidates on insertion only."""
    seed_from_output: bool = True
    """File the n-grams of generated text (Lookahead's pool takes lanes' only)."""
    stagger_lanes: bool = False
    """Lane i starts i positions later (Lookahead's 2D window); else all
    lanes guess the text right after the current token (FAFO)."""
    frozen_table: str | None = None
    """Path of a Cacheback frozen table, consulted when the pool misses."""
    text_ngram_len: int = 4
    """Length of the candidates filed from the prompt and the output; 0:
    ``num_speculative_tokens``. Shorter pieces are chained into a draft, each next one
    found (and voted on) under the draft's own last tokens, so the continuation is
    chosen again every few tokens; Cacheback's followers are 3 long. For ``fafo``
    4: whole drafts (0) lost 1.9-4.0 % of tau on every replayed set (2026-12-02)."""
    rank_candidates: str = "votes"
    """Which of a key's candidates a lookup drafts: ``votes`` (FAFO), the one whose
    first token most of them begin with (the prior table's next token voting too), or
    ``recency`` (the modes' papers), the most recently used one
    (vllm_fafo.drafting.pool.match_in). For ``fafo``, recency gained at most 0.9 % on one
    replayed set and lost 2.3 % on another (2026-12-02)."""
    deep_match: bool = True
    """Draft deep matches of the text's end first (vllm_fafo.drafting.deep_match); the modes
    draft from their pools alone."""

    @classmethod
    def from_user_dict(cls, raw: dict[str, Any]) -> FafoConfig:
        """Validate a user's ``speculative_config`` dict (``method`` included)."""
        if not isinstance(raw, dict):
            raise FafoConfigError(
                f"speculative_config must be a dict, got {type(raw).__name__}"
            )
        settings = user_settings(raw)
        method = settings.pop("method", None)
        if method != METHOD:
            raise FafoConfigError(
                f"speculative_config['method'] must be {METHOD!r}, got {method!r}"
            )
        compression = settings.get("compression", cls.compression)
        chosen = POLICIES.get(compression) if isinstance(compression, str) else None
        own_keys = settings_keys(chosen) if chosen is not None else {}
        allowed = list(USER_KEYS)
        policy_settings = {}
        for key in list(settings):
            if key in allowed:
                continue
            if key in own_keys:
                policy_settings[own_keys[key]] = settings.pop(key)
                continue
            if key in REMOVED_KEYS:
                raise FafoConfigError(f"speculative_config[{key!r}] was removed: {REMOVED_KEYS[key]}")
            owner = next((name for name, p in POLICIES.items() if key in settings_keys(p)), None)
            if owner is not None:
                raise FafoConfigError(
                    f"speculative_config[{key!r}] belongs to compression {owner!r}, "
                    f"but compression is {compression!r}"
                )
            raise unknown_key(key, METHOD, allowed + list(own_keys))
        config = cls(**settings, compression_settings=policy_settings)
        config.validate()
        return config

    def validate(self) -> None:
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1, 64)
        check_int("max_key_len", self.max_key_len, 1, 32)
        check_int("pool_capacity", self.pool_capacity, 1, 4096)
        check_bool("seed_from_prompt", self.seed_from_prompt)
        check_int("num_lanes", self.num_lanes, 0, 256)
        check_int("lane_len", self.lane_len, 2, 32)
        if self.compression not in POLICIES:
            raise FafoConfigError(
                f"speculative_config['compression']={self.compression!r} is not a known "
                f"policy; allowed: {', '.join(repr(p) for p in POLICIES)}"
            )
        check_int("kv_budget", self.kv_budget, 8, 1 << 16)
        check_int("sink_tokens", self.sink_tokens, 0, self.kv_budget - 1)
        check_int("max_lane_requests", self.max_lane_requests, 1, 1024)
        if self.controller not in CONTROLLERS:
            raise FafoConfigError(
                f"speculative_config['controller']={self.controller!r} is not a controller; "
                f"allowed: {', '.join(repr(c) for c in CONTROLLERS)}"
            )
        window = self.kv_budget - self.sink_tokens
        if window <= self.num_speculative_tokens + 1:
            raise FafoConfigError(
                f"speculative_config['kv_budget']={self.kv_budget} leaves a recent window of "
                f"{window} tokens after {self.sink_tokens} sink tokens; it must exceed "
                f"num_speculative_tokens + 1 = {self.num_speculative_tokens + 1}"
            )
        self.policy_settings().validate(self.sink_tokens, self.kv_budget, self.num_speculative_tokens)
        check_int("num_candidates", self.num_candidates, 1, 64)
        check_int("max_tree_tokens", self.max_tree_tokens, 0, 1024)
        if self.max_tree_tokens and self.max_tree_tokens < self.num_speculative_tokens:
            raise FafoConfigError(
                f"speculative_config['max_tree_tokens']={self.max_tree_tokens} must be 0 (auto) or "
                f"at least num_speculative_tokens={self.num_speculative_tokens} (the spine's tokens)"
            )
        check_int("min_key_len", self.min_key_len, 1, self.max_key_len)
        check_bool("share_pool", self.share_pool)
        check_int("shared_pool_mib", self.shared_pool_mib, 1, 1 << 20)
        check_int("shared_pool_tenants", self.shared_pool_tenants, 1, 1 << 16)
        check_int("max_keys", self.max_keys, 0, 1 << 30)
        check_bool("touch_on_lookup", self.touch_on_lookup)
        if self.rank_candidates not in RANKINGS:
            raise ValueError(f"rank_candidates={self.rank_candidates!r}: one of {RANKINGS}")
        check_bool("seed_from_output", self.seed_from_output)
        check_int("text_ngram_len", self.text_ngram_len, 0, 64)  # set by the modes
        check_bool("stagger_lanes", self.stagger_lanes)
        check_int("tenant_answers_mib", self.tenant_answers_mib, 0, 1 << 20)
        check_bool("pad_drafts", self.pad_drafts)
        check_prior_table(self.prior_table)
        if self.pad_drafts and self.num_candidates != 1:
            raise FafoConfigError(
                f"speculative_config['pad_drafts']=True needs num_candidates 1 (got {self.num_candidates}): "
                "draft-tree branches change each step's token count"
            )
        if self.deep_match and self.max_key_len >= MATCH_DEPTH:
            raise FafoConfigError(
                f"speculative_config['max_key_len']={self.max_key_len}: deep matches are up to {MATCH_DEPTH} "
                f"tokens and drafted where deeper than the pool's keys; allowed: 1 to {MATCH_DEPTH - 1}"
            )

    def policy_settings(self) -> Any:
        """The chosen policy's Settings, built from ``compression_settings``."""
        return POLICIES[self.compression].Settings(**self.compression_settings)

    def make_policy(self) -> CompressionPolicy:
        return POLICIES[self.compression](self.sink_tokens, self.kv_budget, self.policy_settings())

    @property
    def tree_tokens(self) -> int:
        """Draft tokens per request per step, spine included."""
        return self.max_tree_tokens or self.num_candidates * self.num_speculative_tokens

    @property
    def ngram_len(self) -> int:
        """Length of the candidates filed from the prompt and the output."""
        return self.text_ngram_len or self.num_speculative_tokens

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FafoConfig:
        """Rebuild from :meth:`to_dict` output (worker side)."""
        config = cls(**data)
        config.validate()
        return config



@dataclass(frozen=True)
class RegionSpec:
    """Engine constants of the lanes' compressed regions, fixed at start-up.

    The proposer's planner and every attention layer build this from the same
    ``vllm_config``: the layers when vLLM builds them (so the regions are
    allocated before vLLM sizes the KV cache and its profiling sees them), the
    planner when the proposer is made.
    """

    rows: int
    """Requests with a region at once: ``min(max_lane_requests, max_num_seqs)``."""
    staged_slots: int
    """Drafts staged per row until vLLM accepts them: ``num_speculative_tokens``."""
    max_model_len: int
    policy: CompressionPolicy

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> RegionSpec | None:
        """None when the engine runs no lanes (or is not a FAFO engine)."""
        settings = fafo_settings(vllm_config)
        if settings is None:
            return None
        config = FafoConfig.from_dict(settings)
        if config.num_lanes == 0:
            return None
        return cls(
            rows=min(config.max_lane_requests, vllm_config.scheduler_config.max_num_seqs),
            staged_slots=config.num_speculative_tokens,
            max_model_len=vllm_config.model_config.max_model_len,
            policy=config.make_policy(),
        )


PLATFORM_KEYS = ("controller", "num_speculative_tokens", "pad_drafts")
"""Keys whose default depends on the platform (docs/configuration.md "Platform defaults")."""

CUDA_PADDED_DEFAULTS: dict[str, Any] = {"controller": "fixed", "num_speculative_tokens": 16, "pad_drafts": True}
"""Without lanes, a draft tree or the goodput controller asked for: drafts of varying length
make steps vLLM's V1 runner runs piecewise, padded ones the uniform batches it replays as
whole CUDA graphs (H200: 4.1 ms per step against 10.8 under the goodput controller); a
padded step of 16 drafts cost about what one of 4 did at batch 1, with 1.16x-1.22x vLLM
``suffix``'s tau against 0.90x-1.06x for 4 (docs/results/gpu.md "Padded draft length")."""

MAX_GRAPH_TOKENS_HOPPER = 512
"""The largest decode step vLLM 0.32 captures as a CUDA graph by default before Blackwell
(``VllmConfig._set_cudagraph_sizes``; 1,024 on Blackwell): larger steps run without graphs."""


def platform_defaults(asked: dict[str, Any], on_cuda: bool) -> dict[str, Any]:
    """The platform's defaults of :data:`PLATFORM_KEYS` that ``asked`` (the user's keys, as
    field names) does not set. CPU: the dataclass's (goodput controller, drafts up to 16).
    CUDA: padded drafts unless lanes or a draft tree are asked for (then none: the
    dataclass's, as on CPU): 16 tokens under the fixed controller,
    or, where the goodput controller is asked for, the tier it picks per step (0, 4, 8
    or 16 tokens for the whole batch). The goodput controller becomes the CUDA default
    once a GPU run shows its tiers level with the fixed 16 at batch 1 and ahead of it
    from batch 8 on (not measured yet)."""
    if not on_cuda:
        return {key: getattr(FafoConfig, key) for key in PLATFORM_KEYS if key not in asked}
    if asked.get("num_lanes", 0) != 0 or asked.get("num_candidates", 1) != 1:
        return {}
    defaults = dict(CUDA_PADDED_DEFAULTS)
    if asked.get("controller", "fixed") != "fixed":
        del defaults["controller"]
    return {key: value for key, value in defaults.items() if key not in asked}


def platform_defaults_line(applied: dict[str, Any], settings: dict[str, Any], on_cuda: bool) -> str:
    """The start-up line that says which platform defaults ``{"method": "fafo"}`` took
    (``settings``: the user's keys with them)."""
    keys = ", ".join(f"{key}={value!r}" for key, value in applied.items())
    if not on_cuda:
        return f"vllm-fafo: CPU defaults {keys}; set these keys to override"
    graphs = ""
    if applied.get("pad_drafts"):
        draft_len = settings.get("num_speculative_tokens", FafoConfig.num_speculative_tokens)
        graphs = (f"; vLLM captures decode steps of up to {MAX_GRAPH_TOKENS_HOPPER} tokens on Hopper: "
                  f"{MAX_GRAPH_TOKENS_HOPPER // (1 + draft_len)} requests with {draft_len}-token drafts, "
                  "more run without CUDA graphs, where fewer draft tokens cost less")
    return (f"vllm-fafo: CUDA defaults {keys} (lanes force eager mode; padded drafts keep decode steps "
            f"whole CUDA graphs{graphs}); set these keys to override")


USER_KEYS = (
    "num_speculative_tokens", "max_key_len", "pool_capacity", "seed_from_prompt", "num_lanes",
    "lane_len", "compression", "sink_tokens", "kv_budget", "max_lane_requests", "controller",
    "num_candidates", "max_tree_tokens", "share_pool", "shared_pool_mib", "shared_pool_tenants",
    "tenant_answers_mib", "pad_drafts", "prior_table",
)
"""Keys of ``{"method": "fafo", ...}`` (besides ``method`` and the policy's own)."""

REMOVED_KEYS = {
    "text_source": "deep matches of the text are always drafted first (their alternatives, the pool "
                   "alone and Arctic Inference's suffix trees, had less tau on every replayed set)",
    "suffix_tree_cached_requests": "the suffix trees are gone; tenant_answers_mib bounds the answers kept",
    "cached_answers": "the answers kept are bounded in bytes per tenant: tenant_answers_mib",
    "shared_pool_keys": "the shared pools are bounded in bytes per tenant: shared_pool_mib",
    "runner_up_tokens": "the target's runner-up tokens added no tau where the prior table drafts",
    "rank_candidates": "candidates are ranked by votes (recency had less tau on two of three sets)",
    "text_ngram_len": "text n-grams are 4 tokens (whole drafts had less tau on every replayed set)",
}
"""Keys of earlier releases, each with why it went (CHANGELOG.md)."""
