"""The CUDA lane path, checked on the CPU: everything but the CUDA kernels.

FafoFlashAttentionImpl is vLLM's FlashAttentionImpl with the lane mixin in
front. Here its base forward (the FlashAttention kernel, real tokens only) is
replaced by a no-op, and the simulated engine of test_region drives the
wrapper's own forward over a FlashAttention-shaped paged cache in each of
vLLM's KV cache layouts: the region, the policies' reads of the cache and
the lane outputs must match the same dense references as the CPU path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_layout import KVCacheLayout

from tests.test_compression import assert_reader_returns
from tests.test_region import HK, HQ, SCALE, D, Request, off_and_on, run_simulation
from vllm_fafo.attention.cuda import FafoFlashAttentionBackend, FafoFlashAttentionImpl
from vllm_fafo.attention.lane_impl import LaneAttentionMixin
from vllm_fafo.attention.paged_kv import LogicalPagedKV, PagedKVLayoutError
from vllm_fafo.config import FafoConfigError, RegionSpec
from vllm_fafo.lanes.compression import FullCachePolicy, QuestPolicy, SnapKVPolicy, StreamingPolicy
from vllm_fafo.lanes.compression.quest import QuestSettings
from vllm_fafo.lanes.compression.snapkv import SnapKVSettings
from vllm_fafo.lanes.step_plan import attach_plan

BLOCK_SIZE = 16
MAX_POSITIONS = 600  # test_region's requests hold this many true positions


def flash_cache(num_blocks: int, layout: KVCacheLayout, dtype=torch.float32) -> torch.Tensor:
    """A per-layer cache as vLLM hands it to FlashAttention: a logical
    [blocks, Hk, block_size, 2D] view over memory in ``layout``'s order."""
    logical = (num_blocks, HK, BLOCK_SIZE, 2 * D)
    order = layout.layer_view_order
    physical = torch.zeros([logical[i] for i in order], dtype=dtype)
    return physical.permute(*[order.index(i) for i in range(4)])


def write_like_flash(kv_cache, block_table, row, positions, key, value) -> None:
    """reshape_and_cache_flash's effect, through FlashAttentionImpl's own view of the cache."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)  # (B, N, H, D)
    blocks = block_table[row, positions // BLOCK_SIZE].long()
    offsets = positions % BLOCK_SIZE
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


class FlashWrapperLayer:
    """One attention layer run through FafoFlashAttentionImpl.forward."""

    def __init__(self, requests, layout: KVCacheLayout, seed: int, dtype=torch.float32):
        per_request = MAX_POSITIONS // BLOCK_SIZE + 1
        num_blocks = per_request * len(requests) + 3
        gen = torch.Generator().manual_seed(seed)
        self.block_table = torch.randperm(num_blocks, generator=gen)[: per_request * len(requests)]
        self.block_table = self.block_table.view(len(requests), per_request).to(torch.int32)
        self.kv_cache = flash_cache(num_blocks, layout, dtype)
        self.impl = FafoFlashAttentionImpl(HQ, D, SCALE, HK, None, None, "auto")

    @property
    def region(self):
        return self.impl.region

    def allocate(self, policy, rows, staged_slots, dtype):
        spec = RegionSpec(rows=rows, staged_slots=staged_slots, max_model_len=4096, policy=policy)
        self.impl.allocate_region(spec, dtype, torch.device("cpu"))

    def step(self, plan, query, key, value, output, final, writes):
        for row, start, first, count in writes:  # real tokens only: the tail has slot -1
            positions = torch.arange(first, first + count)
            write_like_flash(self.kv_cache, self.block_table, row, positions,
                             key[start : start + count], value[start : start + count])
        metadata = SimpleNamespace(block_table=self.block_table)
        if plan is not None:  # as the runner patch does: no plan, nothing attached
            attach_plan({"model.layers.0.self_attn.attn": metadata}, plan)
        self.impl.forward(None, query, key, value, self.kv_cache, metadata, output)


@pytest.fixture
def no_flash_kernel(monkeypatch):
    """FlashAttention's kernel computes the real tokens; lanes never depend on it."""
    monkeypatch.setattr(FlashAttentionImpl, "forward", lambda self, layer, q, k, v, cache, md, out, *a: out)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC])
def test_logical_reader_reads_what_flash_attention_wrote(layout):
    gen = torch.Generator().manual_seed(1)
    kv_cache = flash_cache(12, layout)
    block_table = torch.tensor([[4, 9, 0, 7], [11, 2, 5, 3]], dtype=torch.int32)
    n = 50
    key, value = torch.randn(n, HK, D, generator=gen), torch.randn(n, HK, D, generator=gen)
    positions = torch.arange(n)
    write_like_flash(kv_cache, block_table, 1, positions, key, value)
    reader = LogicalPagedKV(kv_cache, block_table)
    assert_reader_returns(reader, 1, key, value, torch.tensor([[3, 49, 17], [0, 16, 33]]))
    with pytest.raises(PagedKVLayoutError, match="LogicalPagedKV"):
        reader.check(0, positions[:5], key[:5], value[:5])


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.BLHNC])
@pytest.mark.parametrize(
    "policy",
    [
        StreamingPolicy(2, 16, StreamingPolicy.Settings()),
        QuestPolicy(2, 26, QuestSettings(page_size=4, refresh_steps=2, recent_tokens=8)),
        SnapKVPolicy(2, 24, SnapKVSettings(window=4, kernel=3, recent_tokens=8)),
        FullCachePolicy(4, 256, FullCachePolicy.Settings()),
    ],
    ids=lambda p: p.name,
)
def test_flash_wrapper_matches_dense_reference(policy, layout, no_flash_kernel):
    requests = [Request(f"r{i}", n, seed=30 + i) for i, n in enumerate([9, 45, 23])]
    layer = FlashWrapperLayer(requests, layout, seed=5)
    checked, selected = run_simulation(policy, requests, chunk=16, num_lanes=3, lane_len=2,
                                       max_drafts=4, steps=20, seed=6, layer=layer)
    assert checked > 0
    assert policy.name in ("streaming", "none") or any(chosen for chosen in selected.values())
    assert layer.impl._layout_checked == policy.reads_paged_kv


def test_flash_wrapper_catches_its_region_up_from_the_flash_cache(no_flash_kernel):
    """Steps without lanes skip the region; the next lane step reads the missed
    positions back through the wrapper's own reader (streaming reads for nothing else)."""
    policy = StreamingPolicy(2, 16, StreamingPolicy.Settings())
    requests = [Request(f"r{i}", n, seed=60 + i) for i, n in enumerate([9, 45, 23])]
    layer = FlashWrapperLayer(requests, KVCacheLayout.LBNHC, seed=10)
    checked, _ = run_simulation(policy, requests, chunk=16, num_lanes=3, lane_len=2, max_drafts=4,
                                steps=40, seed=13, layer=layer, lanes_for=off_and_on(3))
    assert checked > 0 and layer.impl._layout_checked


@pytest.mark.parametrize(
    "policy",
    [
        StreamingPolicy(2, 16, StreamingPolicy.Settings()),
        QuestPolicy(2, 26, QuestSettings(page_size=4, refresh_steps=2, recent_tokens=8)),
        SnapKVPolicy(2, 24, SnapKVSettings(window=4, kernel=3, recent_tokens=8)),
    ],
    ids=lambda p: p.name,
)
def test_flash_wrapper_in_bfloat16(policy, no_flash_kernel):
    """FlashAttention runs 16-bit: the region, cache reads and policies in bf16."""
    requests = [Request(f"r{i}", n, seed=40 + i) for i, n in enumerate([9, 45, 23])]
    layer = FlashWrapperLayer(requests, KVCacheLayout.LBNHC, seed=8, dtype=torch.bfloat16)
    checked, _ = run_simulation(policy, requests, chunk=16, num_lanes=3, lane_len=2,
                                max_drafts=4, steps=20, seed=9, layer=layer, dtype=torch.bfloat16)
    assert checked > 0 and layer.region.key.dtype == torch.bfloat16


def test_flash_wrapper_is_flash_attention_with_lanes():
    impl = FafoFlashAttentionBackend.get_impl_cls()
    assert issubclass(impl, FlashAttentionImpl) and issubclass(impl, LaneAttentionMixin)
    assert impl.__mro__.index(LaneAttentionMixin) < impl.__mro__.index(FlashAttentionImpl)
    # Attention layers map get_name() back to the enum member that resolves to this class.
    assert AttentionBackendEnum[FafoFlashAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    assert FafoFlashAttentionBackend.get_builder_cls() is FafoFlashAttentionBackend.__mro__[1].get_builder_cls()


def fake_platform(name: str):
    return SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: name == "cuda", device_name=name)


def test_custom_backend_registered_on_cuda(monkeypatch):
    from vllm_fafo.patches import attention_backend

    monkeypatch.setattr(attention_backend, "current_platform", fake_platform("cuda"))
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    try:
        attention_backend.apply()
        assert AttentionBackendEnum.CUSTOM.get_class() is FafoFlashAttentionBackend
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()


def lane_args(model_dir, **kwargs) -> EngineArgs:
    spec = {"method": "fafo", "num_lanes": 8, **kwargs.pop("spec", {})}
    return EngineArgs(model=model_dir, speculative_config=spec, **kwargs)


def test_lanes_on_cuda_select_the_custom_backend(model_dir, monkeypatch):
    from vllm_fafo.patches import engine_args

    monkeypatch.setattr(engine_args, "current_platform", fake_platform("cuda"))
    for chosen in ({}, {"attention_backend": "FLASH_ATTN"}, {"attention_config": {"backend": "FLASH_ATTN"}}):
        args = lane_args(model_dir, **chosen)
        engine_args.translate_speculative_config(args)
        assert args.attention_backend is AttentionBackendEnum.CUSTOM
        assert args.attention_config.backend is None
        assert args.enforce_eager and args.enable_prefix_caching is None  # lanes keep prefix caching
    pool_only = EngineArgs(model=model_dir, speculative_config={"method": "fafo", "num_lanes": 0})
    engine_args.translate_speculative_config(pool_only)
    assert pool_only.attention_backend is None


def test_cuda_defaults_are_pool_only_padded_drafts_unless_asked_otherwise(model_dir, monkeypatch):
    """Drafts of varying length make steps vLLM runs piecewise: on CUDA the default is pool
    only (as on CPU: lanes are asked for by name) with padded 16-token drafts under the fixed
    controller, keeping vLLM's execution (no eager mode, its attention backend); keys set by
    the user keep their values, and so do the others' CPU defaults where the user asks for
    lanes or a draft tree; the goodput controller asked for picks a padded tier per step."""
    from vllm_fafo.config import ADDITIONAL_CONFIG_KEY
    from vllm_fafo.patches import engine_args

    def translated(platform: str, spec: dict) -> tuple[EngineArgs, dict]:
        if platform != "cpu":  # this machine's own platform otherwise
            monkeypatch.setattr(engine_args, "current_platform", fake_platform(platform))
        args = EngineArgs(model=model_dir, speculative_config=dict(spec))
        engine_args.translate_speculative_config(args)
        return args, args.additional_config[ADDITIONAL_CONFIG_KEY]

    def knobs(fafo: dict) -> tuple:
        return fafo["num_lanes"], fafo["controller"], fafo["num_speculative_tokens"], fafo["pad_drafts"]

    cpu_args, cpu = translated("cpu", {"method": "fafo"})
    assert knobs(cpu) == (0, "goodput", 16, False)
    assert not cpu_args.enforce_eager and cpu_args.attention_backend is None
    args, fafo = translated("cuda", {"method": "fafo"})
    assert knobs(fafo) == (0, "fixed", 16, True)
    assert args.speculative_config["num_speculative_tokens"] == 16
    assert not args.enforce_eager and args.attention_backend is None
    assert knobs(translated("cuda", {"method": "fafo", "num_speculative_tokens": 8})[1]) == (0, "fixed", 8, True)
    assert knobs(translated("cuda", {"method": "fafo", "num_lanes": 0})[1]) == (0, "fixed", 16, True)
    assert knobs(translated("cuda", {"method": "fafo", "pad_drafts": False})[1]) == (0, "fixed", 16, False)
    assert knobs(translated("cuda", {"method": "fafo", "pad_drafts": True})[1]) == (0, "fixed", 16, True)
    assert knobs(translated("cuda", {"method": "fafo", "num_speculative_tokens": 4})[1]) == (0, "fixed", 4, True)
    # the goodput controller picks one padded draft length (tier) per step
    assert knobs(translated("cuda", {"method": "fafo", "controller": "goodput"})[1]) == (0, "goodput", 16, True)
    assert knobs(translated("cuda", {"method": "fafo", "controller": "goodput", "pad_drafts": False})[1]) == (
        0, "goodput", 16, False)
    with pytest.raises(FafoConfigError, match="pad_drafts.*needs num_candidates 1"):
        translated("cuda", {"method": "fafo", "pad_drafts": True, "num_candidates": 2})
    tree_args, tree = translated("cuda", {"method": "fafo", "num_candidates": 4})
    assert knobs(tree) == (0, "goodput", 16, False) and tree_args.enforce_eager
    for spec in ({"method": "fafo", "num_lanes": 16}, {"method": "fafo", "num-lanes": 16}):
        assert knobs(translated("cuda", spec)[1]) == (16, "goodput", 16, False)
    lookahead_args, lookahead = translated("cuda", {"method": "lookahead"})
    assert lookahead_args.enforce_eager and not lookahead["pad_drafts"]  # lanes are that mode


def test_cuda_defaults_say_where_padded_steps_leave_cuda_graphs(model_dir, monkeypatch):
    """vLLM captures decode steps of up to 512 tokens (Hopper): with 16-token drafts a step
    of more than 30 requests runs without CUDA graphs, which the start-up line says."""
    from vllm_fafo.patches import engine_args

    from .engine_utils import vllm_info_lines

    monkeypatch.setattr(engine_args, "current_platform", fake_platform("cuda"))
    with vllm_info_lines() as messages:
        for spec in ({"method": "fafo"}, {"method": "fafo", "num_speculative_tokens": 4},
                     {"method": "fafo", "num_lanes": 16, "num_speculative_tokens": 8}):
            engine_args.translate_speculative_config(EngineArgs(model=model_dir, speculative_config=spec))
    defaults = [m for m in messages if m.startswith("vllm-fafo: CUDA defaults")]
    assert len(defaults) == 2  # lanes asked for by name: no CUDA default applies, none logged
    assert "30 requests with 16-token drafts" in defaults[0]
    assert "102 requests with 4-token drafts" in defaults[1]


def test_cpu_defaults_are_logged_too(model_dir):
    """The start-up line names the platform defaults the engine took, on CPU as on CUDA."""
    from vllm_fafo.patches import engine_args

    from .engine_utils import vllm_info_lines

    with vllm_info_lines() as messages:
        for spec in ({"method": "fafo"}, {"method": "fafo", "num_lanes": 4, "controller": "fixed",
                                          "num_speculative_tokens": 4, "pad_drafts": False}):
            engine_args.translate_speculative_config(EngineArgs(model=model_dir, speculative_config=spec))
    assert [m for m in messages if m.startswith("vllm-fafo: CPU defaults")] == [
        "vllm-fafo: CPU defaults controller='goodput', num_speculative_tokens=16, "
        "pad_drafts=False; set these keys to override"]  # the second sets every platform key itself


@pytest.mark.parametrize(
    "platform, kwargs, message",
    [
        ("cuda", {"attention_backend": "TRITON_ATTN"}, "attention_backend 'TRITON_ATTN'.*FLASH_ATTN"),
        ("cuda", {"kv_cache_dtype": "fp8", "spec": {"compression": "quest"}},
         "compression 'quest' reads vLLM's paged KV cache.*kv_cache_dtype 'auto', got 'fp8'"),
        ("rocm", {}, "on rocm set num_lanes to 0"),
    ],
)
def test_lane_configs_without_lane_attention_are_refused(model_dir, monkeypatch, platform, kwargs, message):
    from vllm_fafo.patches import engine_args

    monkeypatch.setattr(engine_args, "current_platform", fake_platform(platform))
    with pytest.raises(FafoConfigError, match=message):
        engine_args.translate_speculative_config(lane_args(model_dir, **kwargs))


def test_model_runner_v2_is_refused(model_dir, monkeypatch):
    """The patches wrap the V1 GPUModelRunner, which vLLM picks for custom proposers
    on CUDA unless VLLM_USE_V2_MODEL_RUNNER=1 forces V2."""
    import vllm.envs

    from vllm_fafo.patches import engine_args

    # An engine built earlier in this process freezes vllm.envs (enable_envs_cache),
    # after which a changed environment variable is not seen.
    was_cached = vllm.envs._is_envs_cache_enabled()
    vllm.envs.disable_envs_cache()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    try:
        with pytest.raises(FafoConfigError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
            engine_args.translate_speculative_config(lane_args(model_dir))
    finally:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
        if was_cached:
            vllm.envs.enable_envs_cache()


def test_draft_trees_select_the_wrapping_backend_and_eager_but_keep_prefix_caching(model_dir, monkeypatch):
    from vllm_fafo.patches import engine_args

    spec = {"method": "fafo", "num_lanes": 0, "num_candidates": 4}
    monkeypatch.setattr(engine_args, "current_platform", fake_platform("cuda"))
    args = EngineArgs(model=model_dir, speculative_config=dict(spec))
    engine_args.translate_speculative_config(args)
    assert args.attention_backend is AttentionBackendEnum.CUSTOM
    assert args.enforce_eager and args.enable_prefix_caching is None
    monkeypatch.setattr(engine_args, "current_platform", fake_platform("rocm"))
    with pytest.raises(FafoConfigError, match="on rocm set num_candidates to 1"):
        engine_args.translate_speculative_config(EngineArgs(model=model_dir, speculative_config=dict(spec)))


@pytest.mark.parametrize("attribute, value, refused", [
    ("dcp_world_size", 2, "decode context parallelism"),
    ("fa4_hd256", True, "FA4's head-size-256 kernel"),
    ("kv_cache_dtype", "fp8", "kv_cache_dtype 'fp8'"),
])
def test_draft_trees_refused_where_the_flash_branch_kernel_does_not_mirror_the_layer(
        monkeypatch, attribute, value, refused):
    """Sliding windows, soft-capping and ALiBi are FlashAttention's own settings, which the
    branch kernel passes on (tests/test_flash_branch_kernel.py); what it does not mirror is
    refused when the layer is built."""
    import dataclasses

    from vllm_fafo.attention import lane_impl
    from vllm_fafo.config import FafoConfig

    settings = dataclasses.asdict(FafoConfig(num_lanes=0, num_candidates=4))
    monkeypatch.setattr(lane_impl, "get_current_vllm_config_or_none",
                        lambda: SimpleNamespace(additional_config={"fafo": settings}))
    for kwargs in ({"sliding_window": 128}, {"logits_soft_cap": 30.0}, {"alibi_slopes": [0.5] * HQ}):
        FafoFlashAttentionImpl(HQ, D, SCALE, HK, **{"alibi_slopes": None, "sliding_window": None,
                                                    "kv_cache_dtype": "auto", **kwargs})
    impl = FafoFlashAttentionImpl(HQ, D, SCALE, HK, None, None, "auto")
    setattr(impl, attribute, value)
    with pytest.raises(FafoConfigError, match=f"num_candidates > 1: .* do not support {refused}"):
        impl.refuse_branches_here()
