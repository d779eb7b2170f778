"""FafoConfig validation: every bad key, type and range fails with its name."""

import pytest

from vllm_fafo.config import FafoConfig, FafoConfigError


def test_defaults():
    config = FafoConfig.from_user_dict({"method": "fafo"})
    assert config == FafoConfig()
    assert FafoConfig.from_dict(config.to_dict()) == config


def test_keys_accept_dashes_like_vllm_cli():
    config = FafoConfig.from_user_dict({"method": "fafo", "max-key-len": 2})
    assert config.max_key_len == 2


def test_text_ngram_len_sets_the_text_candidates_length():
    assert FafoConfig().ngram_len == 4  # fafo's
    assert FafoConfig(text_ngram_len=0, num_speculative_tokens=12).ngram_len == 12  # 0: as long as a draft


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_speculative_tokens", 0, "['num_speculative_tokens']=0 is out of range"),
        ("num_speculative_tokens", 65, "integers in [1, 64]"),
        ("num_speculative_tokens", "4", "must be an integer"),
        ("num_speculative_tokens", 2.0, "must be an integer"),
        ("max_key_len", 0, "['max_key_len']=0 is out of range"),
        ("max_key_len", True, "must be an integer"),
        ("pool_capacity", 0, "['pool_capacity']=0 is out of range"),
        ("pool_capacity", None, "must be an integer"),
        ("seed_from_prompt", 1, "['seed_from_prompt']=1 must be true or false"),
        ("seed_from_prompt", "yes", "must be true or false"),
        ("num_lanes", -1, "['num_lanes']=-1 is out of range"),
        ("num_lanes", 257, "integers in [0, 256]"),
        ("lane_len", 1, "['lane_len']=1 is out of range"),
        ("compression", "h2o", "['compression']='h2o' is not a known policy"),
        ("kv_budget", 4, "['kv_budget']=4 is out of range"),
        ("kv_budget", 8, "leaves a recent window of 4 tokens"),
        ("sink_tokens", 256, "['sink_tokens']=256 is out of range"),
        ("max_lane_requests", 0, "['max_lane_requests']=0 is out of range"),
        ("prompt_lookup_max", 4, "unknown key 'prompt_lookup_max'"),
        ("share_pool", "no", "['share_pool']='no' must be true or false"),
        ("shared_pool_mib", 0, "['shared_pool_mib']=0 is out of range"),
        ("shared_pool_tenants", 0, "['shared_pool_tenants']=0 is out of range"),
        ("shared_pool_tenants", 1.5, "must be an integer"),
        ("tenant_answers_mib", -1, "['tenant_answers_mib']=-1 is out of range"),
        ("pad_drafts", 1, "['pad_drafts']=1 must be true or false"),
        ("rank_candidates", "votes", "['rank_candidates'] was removed: candidates are ranked by votes"),
    ],
)
def test_bad_values_name_key_value_and_allowed(key, value, message):
    with pytest.raises(FafoConfigError) as info:
        FafoConfig.from_user_dict({"method": "fafo", key: value})
    assert message in str(info.value)


def test_padded_drafts_take_either_controller_and_no_tree():
    for controller in ("fixed", "goodput"):
        spec = {"method": "fafo", "pad_drafts": True, "controller": controller}
        assert FafoConfig.from_user_dict(spec).pad_drafts
        with pytest.raises(FafoConfigError, match=r"pad_drafts'\]=True needs num_candidates 1 \(got 4\)"):
            FafoConfig.from_user_dict({**spec, "num_candidates": 4})


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(FafoConfigError, match="allowed keys: .*max_key_len.*pool_capacity"):
        FafoConfig.from_user_dict({"method": "fafo", "bogus": 1})


def test_wrong_method_and_wrong_type():
    with pytest.raises(FafoConfigError, match="must be 'fafo'"):
        FafoConfig.from_user_dict({"method": "ngram"})
    with pytest.raises(FafoConfigError, match="must be a dict"):
        FafoConfig.from_user_dict(["fafo"])


def test_lane_settings_accepted():
    config = FafoConfig.from_user_dict(
        {"method": "fafo", "num_lanes": 16, "lane_len": 6, "kv_budget": 128, "sink_tokens": 0}
    )
    assert (config.num_lanes, config.lane_len, config.kv_budget) == (16, 6, 128)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_draft_trees_refused_below_float32_on_cpu_with_key_value_and_fix(model_dir, dtype):
    """On CPU, branch attention matches a verification of the same tokens only to float32 rounding."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model_dir, dtype=dtype,
                      speculative_config={"method": "fafo", "num_lanes": 0, "num_candidates": 4})
    with pytest.raises(FafoConfigError, match=r"num_candidates=4 .*float32.*Set num_candidates to 1"):
        args.create_engine_config()


def test_draft_trees_run_in_the_model_s_dtype_on_cuda(monkeypatch):
    """FlashAttention computes a branch row as the spine's verification computes it."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from vllm_fafo.patches import engine_args

    settings = dataclasses.asdict(FafoConfig(num_lanes=0, num_candidates=4))
    config = SimpleNamespace(additional_config={"fafo": settings}, model_config=SimpleNamespace(dtype=torch.bfloat16))
    with pytest.raises(FafoConfigError, match="num_candidates=4 verifies draft-tree branches on CPU"):
        engine_args.refuse_inexact_branches(config)
    monkeypatch.setattr(engine_args, "current_platform", SimpleNamespace(is_cpu=lambda: False))
    engine_args.refuse_inexact_branches(config)


def test_draft_trees_accepted_in_float32_and_spine_only_in_any_dtype(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    tree = {"method": "fafo", "num_lanes": 0, "num_candidates": 4}
    assert EngineArgs(model=model_dir, dtype="float32", speculative_config=tree).create_engine_config()
    spine = {"method": "fafo", "num_lanes": 0}
    assert EngineArgs(model=model_dir, dtype="bfloat16", speculative_config=spine).create_engine_config()


def test_every_user_key_is_documented_once():
    """Each key of ``{"method": "fafo"}`` has one row: in the README's table or in
    docs/configuration.md's; Lookahead's and Cacheback's in docs/configuration.md; a
    removed key in neither."""
    import dataclasses
    import re
    from pathlib import Path

    from vllm_fafo.config import REMOVED_KEYS, USER_KEYS
    from vllm_fafo.modes import MODES

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    doc = (root / "docs" / "configuration.md").read_text()
    fafo_doc = doc.split('## `{"method": "fafo"}`', 1)[1].split("\n## ", 1)[0]

    def rows(text: str) -> list[str]:
        return re.findall(r"^\| `(\w+)` \|", text, re.M)

    documented = rows(readme) + rows(fafo_doc)
    assert sorted(documented) == sorted(USER_KEYS)
    assert not set(REMOVED_KEYS) & set(rows(readme) + rows(doc))
    for name, mode in MODES.items():
        section = doc.split(f'### `{{"method": "{name}"}}`', 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
        assert sorted(rows(section)) == sorted(f.name for f in dataclasses.fields(mode)), name


def test_removed_keys_say_why_they_went():
    for key, value, why in (("text_source", "suffix_tree", "deep matches of the text are always drafted first"),
                            ("suffix_tree_cached_requests", 10, "tenant_answers_mib bounds the answers kept"),
                            ("cached_answers", 10000, "bounded in bytes per tenant: tenant_answers_mib"),
                            ("shared_pool_keys", 65536, "bounded in bytes per tenant: shared_pool_mib"),
                            ("runner_up_tokens", 4, "added no tau"),
                            ("rank_candidates", "recency", "ranked by votes"),
                            ("text_ngram_len", 0, "4 tokens")):
        with pytest.raises(FafoConfigError, match=rf"\['{key}'\] was removed: .*{why}"):
            FafoConfig.from_user_dict({"method": "fafo", key: value})
    with pytest.raises(FafoConfigError, match=r"tenant_answers_mib.*=-1 is out of range"):
        FafoConfig.from_user_dict({"method": "fafo", "tenant_answers_mib": -1})
