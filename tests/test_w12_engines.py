"""W12 wired into engines: `quantization: w12` in the reference runtime (a served W12 engine gives the bf16 `ar`
engine's greedy tokens) and the SGLang overlay (shipped with the kernel, accepted by the engine's own SGLang,
and run on a real layer from the engine tree)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
from pathlib import Path

import httpx
import pytest
import torch
from reference_runtime_helpers import STORY_PROMPTS, engine_config, free_port, write_engine
from sglang_builds import sglang_settings
from w12_overlay_helpers import EXPECTED, EXPECTED_KEPT_BF16, run_method

from specpilot_build.assemble.builder import build_engine
from specpilot_build.assemble.launch_check import check_launch_args
from specpilot_build.locations import KERNELS_DIR
from specpilot_build.serve.process import serve, stop
from specpilot_build.store.engines import Engine
from specpilot_runtime.config import RuntimeConfigError, parse_engine_config
from specpilot_runtime.model import LeanLlama, load_hf_model
from specpilot_runtime.runtime import load_runtime

KERNEL = KERNELS_DIR / "w12"
OVERLAY_MODULE = "python/sglang/srt/layers/quantization/w12.py"
W12_SGLANG_SETTINGS = {
    "h100_c1_qwen38-27b_dflash2",
    "h100_c1_qwen38-27b_dspark",
    "rtx-pro-6000_c1_muse-glimmer-30b_dflash2",
    "h100_c1_qwen3-8b_dflash",
    "h100_c1_qwen3-8b_eagle3",
    "h200_c1_qwen3-8b_dflash",
    "h200_c1_stories260k-padded-bf16_ngram",
    "h100_c1_stories260k-padded-bf16_ngram",
}
CPU_SETTING = "cpu_c1_stories260k-bf16_ngram"


# --- reference runtime ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_bf16(stories_dir):
    return load_hf_model(stories_dir, "bfloat16", "cpu")


def test_the_w12_lean_forward_equals_the_bf16_forward_bit_for_bit_on_cpu(hf_bf16, golden):
    import w12

    ids = golden["sequence_ids"]
    plain = LeanLlama(hf_bf16, num_slots=3, max_tokens_per_step=4, device="cpu")
    packed = LeanLlama(hf_bf16, num_slots=3, max_tokens_per_step=4, device="cpu", w12=True)
    assert all(isinstance(w, w12.W12Tensor) for weights in packed.layers for w in weights)
    assert isinstance(packed.lm_head, w12.W12Tensor)
    for model in (plain, packed):
        model.runs = [
            model.forward(torch.tensor([ids[:length]]), [slot], [0]) for slot, length in enumerate((40, 7, 90))
        ]
        model.runs.append(model.forward(torch.tensor([ids[40:44], ids[7:11], ids[90:94]]), [0, 1, 2], [40, 7, 90]))
        model.runs += [model.forward(torch.tensor([ids[p : p + 1]]), [1], [p]) for p in range(11, 20)]
    for want, got in zip(plain.runs, packed.runs, strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
def test_on_cuda_the_w12_forward_runs_the_fused_gemm_and_is_as_close_to_float32_as_bf16(
    monkeypatch, stories_dir, golden
):
    import w12.gemm

    fused_rows = []
    real_fused = w12.gemm.fused_gemm
    monkeypatch.setattr(
        w12.gemm, "fused_gemm", lambda x, p, c=None: fused_rows.append(x.shape[0]) or real_fused(x, p, c)
    )
    ids = golden["sequence_ids"][:201]
    exact = LeanLlama(load_hf_model(stories_dir, "float32", "cpu"), 1, 4, "cpu")
    hf_cuda = load_hf_model(stories_dir, "bfloat16", "cuda")
    plain = LeanLlama(hf_cuda, 1, 4, "cuda")
    packed = LeanLlama(hf_cuda, 1, 4, "cuda", w12=True)
    logits = {}
    for name, model in (("exact", exact), ("plain", plain), ("packed", packed)):
        runs = [model.forward(torch.tensor([ids[:150]], device=model.device), [0], [0])]
        runs += [
            model.forward(torch.tensor([ids[p : p + 3]], device=model.device), [0], [p]) for p in range(150, 198, 3)
        ]
        logits[name] = torch.cat(runs, dim=1).cpu()
    assert fused_rows and max(fused_rows) <= 32  # the 3-token steps ran the fused kernel (prefill: decode + mm)
    err = {name: (logits[name] - logits["exact"]).abs().max() for name in ("plain", "packed")}
    assert err["packed"] <= 1.25 * err["plain"], err
    agree = (logits["packed"].argmax(-1) == logits["exact"].argmax(-1)).float().mean()
    assert agree >= 0.98


def test_w12_needs_a_bf16_model():
    config = engine_config("final")
    config["model"]["quantization"] = "w12"
    with pytest.raises(
        RuntimeConfigError, match="model.quantization w12 stores bf16 weights; model.dtype is 'float32'"
    ):
        parse_engine_config(config)
    config["model"]["dtype"] = "bfloat16"
    assert parse_engine_config(config).quantization == "w12"


def test_w12_dense_fallback_is_a_bool_option_of_w12_engines_only():
    config = engine_config("final", dtype="bfloat16", runtime_options={"w12_dense_fallback": 1})
    config["model"]["quantization"] = "w12"
    with pytest.raises(RuntimeConfigError, match="runtime_options.w12_dense_fallback is 1; expected bool"):
        parse_engine_config(config)
    config["runtime_options"]["w12_dense_fallback"] = True
    assert parse_engine_config(config).runtime_options == {"w12_dense_fallback": True}
    config["model"]["quantization"] = None
    with pytest.raises(RuntimeConfigError, match="runtime_options.w12_dense_fallback needs model.quantization w12"):
        parse_engine_config(config)
    config["runtime_options"]["w12_dense_fallback"] = False
    assert parse_engine_config(config).runtime_options == {"w12_dense_fallback": False}


def test_a_w12_engine_with_the_dense_fallback_keeps_the_bf16_weights_and_decodes_the_same_tokens(
    monkeypatch, tmp_path, stories_dir, golden
):
    import w12

    decoded = []
    real_decode = w12.decode
    monkeypatch.setattr(w12, "decode", lambda packed: decoded.append(packed) or real_decode(packed))
    prompts = [golden["prompt_ids"]] + [_encode(stories_dir, p) for p in STORY_PROMPTS[1:3]]
    engines, outputs, decodes = {}, {}, {}
    for name, quantization, options in (
        ("bf16", None, {}),
        ("w12", "w12", {}),
        ("w12+dense", "w12", {"w12_dense_fallback": True}),
    ):
        config = engine_config("final", dtype="bfloat16", runtime_options=options)
        config["model"]["quantization"] = quantization
        runtime = load_runtime(str(write_engine(tmp_path / name, config)), name, str(stories_dir), None, None)
        decoded.clear()
        outputs[name] = [runtime.engine.generate(p, 60, timeout=60)["output_ids"] for p in prompts]
        engines[name], decodes[name] = runtime.engine.model, len(decoded)
    plain, packed, dense = engines["bf16"], engines["w12"], engines["w12+dense"]
    pairs = [(dense.lm_head, plain.lm_head)] + [
        pair for ours, theirs in zip(dense.layers, plain.layers, strict=True) for pair in zip(ours, theirs)
    ]
    for kept, weight in pairs:  # stories260K's shapes are unmeasured: every one falls back at some M, so keeps its copy
        assert kept.dense is not None and kept.dense_buckets
        assert torch.equal(kept.dense.view(torch.int16), weight.t().view(torch.int16))
    assert all(w.dense is None for w in [packed.lm_head, *(w for ws in packed.layers for w in ws)])
    assert decodes["w12"] > 0 and decodes["w12+dense"] == 0  # on CPU the kept copy is used, never a decode
    assert all(len(out) > 0 for out in outputs["bf16"])
    assert outputs["w12+dense"] == outputs["w12"] == outputs["bf16"]


def test_the_dense_fallback_on_a_host_without_w12s_gemm_is_refused_at_start_up(monkeypatch, tmp_path, stories_dir):
    config = engine_config("final", dtype="bfloat16", runtime_options={"w12_dense_fallback": True})
    config["model"]["quantization"] = "w12"
    monkeypatch.setitem(sys.modules, "w12.gemm", None)  # what a host without Triton gets from `import w12.gemm`
    with pytest.raises(RuntimeConfigError, match="runtime_options.w12_dense_fallback needs w12.gemm"):
        load_runtime(str(write_engine(tmp_path / "eng", config)), "x", str(stories_dir), None, None)


@pytest.mark.slow
def test_a_served_w12_engine_gives_the_bf16_ar_engines_greedy_tokens(session_data, stories_dir, golden):
    ar, final = build_engine(CPU_SETTING, "ar").engine, build_engine(CPU_SETTING, "final").engine
    assert (final.path / "kernels" / "w12" / "format.py").read_bytes() == (KERNEL / "format.py").read_bytes()
    assert not (ar.path / "kernels").exists()
    assert final.config["model"]["quantization"] == "w12" and ar.config["model"]["quantization"] is None
    prompts = [golden["prompt_ids"]] + [_encode(stories_dir, p) for p in STORY_PROMPTS[1:4]]
    outputs, infos = {}, {}
    for engine in (ar, final):
        port = free_port()
        serve(engine, port=port, quiet=True, timeout=120)
        try:
            url = f"http://127.0.0.1:{port}"
            outputs[engine.id] = [
                httpx.post(
                    url + "/generate",
                    timeout=120,
                    json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 100, "temperature": 0}},
                ).json()["output_ids"]
                for prompt in prompts
            ]
            infos[engine.id] = httpx.get(url + "/server_info", timeout=10).json()
        finally:
            stop(port)
    assert (infos[ar.id]["quantization"], infos[final.id]["quantization"]) == (None, "w12")
    assert infos[final.id]["dtype"] == infos[ar.id]["dtype"] == "bfloat16"
    assert infos[final.id]["spec_accept_token_num"] > 0
    assert all(len(out) > 0 for out in outputs[ar.id])
    assert outputs[final.id] == outputs[ar.id]


def _encode(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"]


# --- SGLang ---------------------------------------------------------------------------------------------------


def test_w12_is_in_the_final_arm_of_the_bf16_c1_sglang_settings_only(builds):
    with_w12 = {s for s in sglang_settings() if (builds.engines[s, "final"].path / "kernels" / "w12").is_dir()}
    assert with_w12 == W12_SGLANG_SETTINGS
    assert not any((builds.engines[s, "stock"].path / "kernels").exists() for s in sglang_settings())


@pytest.mark.parametrize("setting", sorted(W12_SGLANG_SETTINGS))
def test_a_w12_sglang_engine_ships_the_kernel_the_overlay_and_its_arguments(builds, setting):
    engine = builds.engines[setting, "final"]
    for name in ("__init__.py", "format.py", "gemm.py", "tuned_h200.json", "fallback_h200.json"):
        assert (engine.path / "kernels" / "w12" / name).read_bytes() == (KERNEL / name).read_bytes()
    # the W12 method's cut for the engine's SGLang: 0.5.17 keeps its quantization choices in server_args.py
    runtime = engine.manifest["config"]["runtime"]["name"]
    cut, choices = {
        "sglang": ("w12", "python/sglang/srt/arg_groups/choices.py"),
        "sglang-0.5.17": ("w12-0.5.17", "python/sglang/srt/server_args.py"),
    }[runtime]
    [record] = [r for r in engine.manifest["base"]["overlays"] if r["name"] == cut]
    assert sorted((f["path"], f["before"] is None) for f in record["files"]) == sorted(
        [(choices, False), ("python/sglang/srt/layers/quantization/__init__.py", False), (OVERLAY_MODULE, True)]
    )
    spec = json.loads((engine.path / "launch.json").read_bytes())
    argv = spec["argv"]
    assert argv[argv.index("--quantization") + 1] == "w12"
    assert argv[argv.index("--speculative-draft-model-quantization") + 1] == "unquant"
    assert "{engine}/kernels" in spec["env"]["PYTHONPATH"].split(":")
    registry = (engine.path / "python/sglang/srt/layers/quantization/__init__.py").read_text()
    assert '"w12": W12Config' in registry
    assert any(rule.startswith("W12 ") for rule in engine.manifest["base"]["rules"])
    missing = [m for m in _sglang_imports(engine.path / OVERLAY_MODULE) if not _module_in_tree(engine.path, m)]
    assert missing == [], f"pruned away but imported by the w12 overlay: {missing}"


def test_sglang_accepts_quantization_w12_only_with_the_overlay(builds, tmp_path):
    final = builds.engines["h100_c1_qwen38-27b_dflash2", "final"]
    stock = builds.engines["h100_c1_qwen38-27b_dflash2", "stock"]
    unpatched = tmp_path / "unpatched"
    unpatched.mkdir()
    os.symlink(stock.path / "python", unpatched / "python")
    (unpatched / "launch.json").write_bytes((final.path / "launch.json").read_bytes())
    results = check_launch_args([final, Engine("0" * 64, unpatched)], tmp_path)
    assert results[final.id] is None
    assert "w12" in results["0" * 64] and "invalid choice" in results["0" * 64]


@pytest.mark.parametrize("plan_file", ["the engine's", "none"])
def test_the_overlay_method_encodes_a_real_layer_at_load_and_computes_it_exactly(
    builds, stories_dir, plan_file, tmp_path
):
    """With the engine's kernels (its plan.json: H100 tables, no stories260K shape in them) the layers stay bf16;
    with the same kernels and no plan, they are encoded. Either way the product is exact."""
    engine = builds.engines["h100_c1_qwen38-27b_dflash2", "final"]
    plan = json.loads((engine.path / "kernels" / "w12" / "plan.json").read_text())
    assert (plan["gpu"], plan["tables"], plan["unlisted"]) == ("h100", "fallback_h100.json", "bf16")
    kernels = engine.path / "kernels"
    if plan_file == "none":
        shutil.copytree(kernels, tmp_path / "kernels")
        (tmp_path / "kernels" / "w12" / "plan.json").unlink()
        kernels = tmp_path / "kernels"
    result = run_method([f"{engine.path}/python", str(kernels)], stories_dir / "model.safetensors", engine.path)
    assert result.pop("from") == [
        f"{engine.path}/{OVERLAY_MODULE}",
        f"{engine.path}/python/sglang/srt/layers/quantization/base_config.py",
    ]
    assert result == (EXPECTED if plan_file == "none" else EXPECTED_KEPT_BF16)


def _sglang_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.split(".")[0] == "sglang"}


def _module_in_tree(root: Path, module: str) -> bool:
    base = root / "python" / Path(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
