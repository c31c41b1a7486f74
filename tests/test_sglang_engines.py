"""SGLang engines: every SGLang setting builds `stock` and `final` from the pinned wheel, pruned, with its
overlays; the tree's own SGLang accepts the engine's launch arguments; every .py file compiles."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import zipfile
from types import SimpleNamespace

import pytest
from sglang_builds import ARMS, sglang_settings

from specpilot_build.assemble.builder import build_engine
from specpilot_build.assemble.launch_check import check_launch_args, compile_engines
from specpilot_build.locations import data_dir
from specpilot_build.store.engines import Engine, disk_usage
from specpilot_build.store.manifest import digest_file

CASES = [(s, a) for s in sglang_settings() for a in ARMS]
HTTP_SERVER = "python/sglang/srt/entrypoints/http_server.py"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A model folder with only a small Llama config.json: SGLang 0.5.17's prepare_server_args reads the model
    type (0.5.23's does not look)."""
    folder = tmp_path_factory.mktemp("dummy-model")
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "intermediate_size": 176,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 16,
                "num_hidden_layers": 2,
                "vocab_size": 512,
                "max_position_embeddings": 512,
                "torch_dtype": "bfloat16",
            }
        )
    )
    return folder


BAD_FLAG_ID = "f" * 64


@pytest.fixture(scope="session")
def launch_results(builds, model_dir, tmp_path_factory):
    """One check run for every engine, plus a copy of one engine whose argv misspells a flag."""
    real = builds.engines["h100_c1_qwen3-8b_dflash", "final"]
    spec = json.loads((real.path / "launch.json").read_bytes())
    spec["argv"] = [
        a.replace("--speculative-dflash-block-size", "--speculative-dflash-block-sise") for a in spec["argv"]
    ]
    fake = tmp_path_factory.mktemp("bad-flag-engine")
    os.symlink(real.path / "python", fake / "python")
    (fake / "launch.json").write_text(json.dumps(spec))
    return check_launch_args([*builds.engines.values(), Engine(BAD_FLAG_ID, fake)], model_dir)


@pytest.fixture(scope="session")
def wheel_members(builds):
    """{wheel file name: {member: size}} for every SGLang wheel the engines were built from."""
    members = {}
    for wheel in {e.manifest["base"]["wheel"] for e in builds.engines.values()}:
        with zipfile.ZipFile(data_dir() / "wheels" / wheel) as zf:
            members[wheel] = {i.filename: i.file_size for i in zf.infolist() if not i.is_dir()}
    return members


# the engine-id patch has one cut per SGLang release it applies to
ENGINE_ID_OVERLAY = {"sglang": "engine-id", "sglang-0.5.17": "engine-id-0.5.17"}
# kept share of the wheel's bytes: 0.5.17's wheel has no Rust radix-tree core or *.plans.json tables to drop
MAX_KEPT = {"sglang": 0.60, "sglang-0.5.17": 0.70}


def test_the_sglang_settings_include_the_seeds_six_and_the_real_pinned_ones():
    settings = set(sglang_settings())
    assert {
        "h100_c1_qwen38-27b_dflash2",
        "h100_c1_qwen38-27b_dspark",
        "h100_c16_qwen38-27b-fp8_dflash2",
        "h100_c16_qwen38-27b-fp8_dspark",
        "rtx-pro-6000_c1_muse-glimmer-30b_dflash2",
        "rtx-pro-6000_c16_qwen38-27b-fp8_dflash2",
        "h100_c1_qwen3-8b_dflash",
    } <= settings


@pytest.mark.parametrize("setting,arm", CASES)
def test_the_engines_sglang_accepts_its_launch_arguments(builds, launch_results, setting, arm):
    engine = builds.engines[setting, arm]
    assert launch_results[engine.id] is None, f"{setting}/{arm}: {launch_results[engine.id]}"


def test_every_python_file_of_every_engine_compiles(builds):
    assert compile_engines(list(builds.engines.values())) == {}


def test_a_flag_sglang_does_not_know_is_rejected_by_the_check(launch_results):
    result = launch_results[BAD_FLAG_ID]
    assert result is not None and "--speculative-dflash-block-sise" in result


@pytest.mark.parametrize("setting", sglang_settings())
def test_every_arm_carries_the_engine_id_overlay_and_final_adds_tuned_arguments(builds, setting):
    stock, final = builds.engines[setting, "stock"], builds.engines[setting, "final"]
    for engine in (stock, final):  # the engine-id overlay is part of the SGLang base, applied first
        server = (engine.path / HTTP_SERVER).read_text()
        assert server.count('"engine_id": os.environ.get("SPECPILOT_ENGINE_ID")') == 2
        cut = ENGINE_ID_OVERLAY[engine.manifest["config"]["runtime"]["name"]]
        [record] = [r for r in engine.manifest["base"]["overlays"] if r["name"] == cut]
        assert engine.manifest["base"]["overlays"][0] == record  # applied first
        assert [f["path"] for f in record["files"]] == [HTTP_SERVER]
        assert record["files"][0]["before"] != record["files"][0]["after"]
    assert stock.manifest["base"]["overlays"][0]["files"][0]["after"] == digest_file(stock.path / HTTP_SERVER)
    stock_argv = json.loads((stock.path / "launch.json").read_bytes())["argv"]
    final_argv = json.loads((final.path / "launch.json").read_bytes())["argv"]
    assert "--cuda-graph-max-bs-decode" in final_argv and "--cuda-graph-max-bs-decode" not in stock_argv
    assert ("--max-running-requests" in final_argv) == ("_c16_" in setting)
    assert "--max-running-requests" not in stock_argv


@pytest.mark.parametrize("setting,arm", CASES)
def test_pruned_engines_keep_at_most_60_percent_of_the_wheel_and_say_what_they_dropped(
    builds, wheel_members, setting, arm
):
    engine = builds.engines[setting, arm]
    base = engine.manifest["base"]
    runtime = engine.manifest["config"]["runtime"]["name"]
    wheel_members = wheel_members[base["wheel"]]
    version = base["wheel"].split("-")[1]
    assert (base["total_files"], base["total_bytes"]) == (len(wheel_members), sum(wheel_members.values()))
    added_by_overlays = {f["path"] for r in base["overlays"] for f in r["files"] if f["before"] is None}
    shipped = {
        f["path"][len("python/") :]
        for f in engine.manifest["files"]
        if f["path"].startswith("python/") and f["path"] not in added_by_overlays
    }
    assert shipped <= set(wheel_members)
    assert base["kept_files"] == len(shipped)
    assert base["kept_bytes"] == sum(wheel_members[p] for p in shipped)
    assert base["dropped_files"] == len(wheel_members) - len(shipped)
    assert base["kept_bytes"] <= MAX_KEPT[runtime] * base["total_bytes"]
    assert f"sglang-{version}.dist-info/licenses/LICENSE" in shipped
    assert not any(p.startswith("sglang/multimodal_gen/") for p in shipped)


def test_engines_keep_what_their_setting_loads_dynamically_and_not_other_settings_parts(builds):
    def shipped(setting):
        return {f["path"] for f in builds.engines[setting, "stock"].manifest["files"]}

    dflash, dspark = shipped("h100_c1_qwen38-27b_dflash2"), shipped("h100_c1_qwen38-27b_dspark")
    rtx = shipped("rtx-pro-6000_c1_muse-glimmer-30b_dflash2")
    model = "python/sglang/srt/models/"
    assert {model + "qwen3.py", model + "dflash.py"} <= dflash and model + "dspark.py" not in dflash
    assert model + "dspark.py" in dspark
    assert model + "bailing_moe.py" not in dflash and model + "dspark_minimax.py" not in dspark
    assert any("device_name=NVIDIA_H100_80GB_HBM3" in p for p in dflash)
    assert not any("device_name=NVIDIA_H100_80GB_HBM3" in p for p in rtx)
    assert any(p.startswith("python/sglang/kernels/jit/csrc/") for p in rtx)
    assert not any("gfx9" in p for p in dflash if p.startswith("python/sglang/kernels/jit/"))


def test_all_sglang_engines_of_one_wheel_together_take_at_most_1_3_times_one_engine_on_disk_usage(builds):
    by_wheel: dict[str, list] = {}
    for engine in builds.engines.values():
        by_wheel.setdefault(engine.manifest["base"]["wheel"], []).append(engine.path)
    assert len(by_wheel) == 2  # 0.5.23 and 0.5.17: their files share no objects, each group shares its own
    for paths in by_wheel.values():
        one = max(disk_usage([p]) for p in paths)
        assert disk_usage(paths) <= 1.3 * one


def _endpoint(engine: Engine, name: str):
    """The engine's own `async def <name>()` from its http_server.py, run against stand-ins for SGLang's
    global state (the module itself cannot be imported without a GPU stack)."""
    path = engine.path / HTTP_SERVER
    fn = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.AsyncFunctionDef) and n.name == name)
    fn.decorator_list = []

    class TokenizerManager:
        server_args, startup_time, model_path, served_model_name, is_generation = "args", 0.0, "/m", "m", True
        model_config = SimpleNamespace(
            is_image_understandable_model=False,
            is_audio_understandable_model=False,
            hf_config=SimpleNamespace(model_type="qwen3", architectures=["Qwen3"]),
            embedding_model_spec=None,
        )

        async def get_internal_state(self):
            return [{}]

        def config_value(self, key):
            return None

    namespace = {
        "os": os,
        "List": list,
        "Dict": dict,
        "Any": object,
        "__version__": "0.5.23",
        "_global_state": SimpleNamespace(tokenizer_manager=TokenizerManager(), scheduler_info={}),
        "build_server_info": lambda args, info: {"model_path": "/m"},
        "msgspec_to_builtins": lambda x: x,
        "redact_watermark_secrets": lambda x: x,
        "get_serving": lambda: SimpleNamespace(tokenizer_path=None, preferred_sampling_params=None),
    }
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("endpoint", ["server_info", "model_info"])
def test_every_arm_reports_the_engine_id_it_was_served_as(builds, monkeypatch, endpoint):
    """The engine-id overlay belongs to the SGLang base: ar, stock and final all report their id (and so
    can be served and used as verify's oracle)."""
    with builds.env():
        ar = build_engine("h100_c1_qwen3-8b_dflash", "ar").engine
    for engine in (
        ar,
        builds.engines["h100_c1_qwen3-8b_dflash", "stock"],
        builds.engines["h100_c1_qwen3-8b_dflash", "final"],
    ):
        monkeypatch.setenv("SPECPILOT_ENGINE_ID", engine.id)
        assert asyncio.run(_endpoint(engine, endpoint)())["engine_id"] == engine.id
