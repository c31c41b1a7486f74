"""The engine's GPU environment, pinned and hashed (#19): host profiles, the environment lock resolved with pip's
resolver against a host profile (what the host has at a satisfying version does not travel), the lock's own and
its profile's digests checked on load, native prune rules, and install_environment refusing a wheel that is not
what the lock pins."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from specpilot_build.assemble.inputs import resolve_inputs
from specpilot_build.config.compose import compose_setting
from specpilot_build.config.effective import effective_config
from specpilot_build.errors import ConfigError, PinError
from specpilot_build.hosts.install import (
    install_environment,
    native_rules,
    select_distributions,
)
from specpilot_build.hosts.profiles import digest_of, load_env_lock, load_host_profile, lock_body
from specpilot_build.hosts.resolve import resolve_env_lock, to_toml, write_env_lock, write_host_profile
from specpilot_build.locations import REPO_ROOT
from specpilot_build.pins.lockfile import WheelPin, load_lock

LOCKS = REPO_ROOT / "lockfiles"
PADDED = "h200_c1_stories260k-padded_ngram"
OLD = ["runtime=sglang-0.5.17"]
KERNEL_FILES = [
    "sgl_kernel/__init__.py",
    "sgl_kernel/flash_ops.abi3.so",
    "sgl_kernel/sm90/common_ops.abi3.so",
    "sgl_kernel/sm100/common_ops.abi3.so",
    "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so",
    "sgl_kernel/infllm_v2/__init__.py",
    "sgl_kernel/infllm_v2/attention.py",
    "sgl_kernel/flashmla_ops.abi3.so",
    "sglang_kernel-0.4.5.dist-info/METADATA",
]
DROPPED_BY_RULES = {
    "sgl_kernel/flash_ops.abi3.so",
    "sgl_kernel/sm100/common_ops.abi3.so",
    "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so",
    "sgl_kernel/flashmla_ops.abi3.so",
}


def _profile(directory: Path, packages: dict[str, str]) -> None:
    freeze = directory / "freeze.txt"
    freeze.write_text("".join(f"{k}=={v}\n" for k, v in packages.items()))
    write_host_profile("testhost", freeze, "3.12.3", "2.35", 13, directory)


def _padded_cfg() -> dict:
    return effective_config(compose_setting(PADDED, "final", OLD).config)


# --- resolution against a host profile (real pip, real PyPI, a small package) ---------------------------------


@pytest.mark.slow
def test_what_the_host_has_does_not_travel_and_a_too_old_copy_does(tmp_path):
    pin = WheelPin(name="rich", version="13.9.4", filename="rich-13.9.4-py3-none-any.whl", sha256="0" * 64)
    # rich 13.9.4 needs pygments>=2.13,<3 and markdown-it-py>=2.2 (which needs mdurl)
    _profile(tmp_path, {"Pygments": "2.19.1", "torch": "2.11.0+cu130"})
    body = resolve_env_lock("rich", pin, load_host_profile("testhost", tmp_path), extra=[])
    write_env_lock(body, tmp_path)
    lock = load_env_lock("rich", "testhost", tmp_path)
    assert lock.staying == {"pygments": "2.19.1"}
    assert {w.name for w in lock.wheels} == {"rich", "markdown-it-py", "mdurl"}
    assert [w.version for w in lock.wheels if w.name == "rich"] == ["13.9.4"]
    for wheel in lock.wheels:
        assert wheel.url.startswith("https://") and wheel.filename.endswith(".whl") and wheel.size > 1000
    assert dict((w.name, w.requires) for w in lock.wheels)["rich"] == ("markdown-it-py",)
    # the same host with a pygments too old for rich's requirement: it travels
    _profile(tmp_path, {"Pygments": "2.10.0"})
    old = resolve_env_lock("rich", pin, load_host_profile("testhost", tmp_path), extra=[])
    assert old["staying"] == {}
    assert {w["name"] for w in old["wheel"]} == {"rich", "markdown-it-py", "mdurl", "pygments"}


# --- loading: shape, own digest, profile digest ---------------------------------------------------------------


@pytest.fixture
def lock_copy(tmp_path) -> Path:
    shutil.copytree(LOCKS / "hosts", tmp_path / "hosts")
    shutil.copytree(LOCKS / "envs", tmp_path / "envs")
    return tmp_path


def test_the_committed_lock_loads_and_matches_its_host_profile(lock_copy):
    lock = load_env_lock("sglang-0.5.17", "h200", lock_copy)
    profile = load_host_profile("h200", lock_copy)
    assert lock.profile_digest == profile.digest and lock.python == profile.python == "3.12.3"
    names = {w.name: w for w in lock.wheels}
    assert names["sglang"].filename == "sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl"
    assert names["sglang"].sha256 == "fb4cba478a5dca5ee146550b39f33add1c4e475d21ee11810b86ed1c58068093"
    assert names["transformers"].version == "5.12.1"  # the host's 5.17 does not satisfy sglang 0.5.17's pin
    assert lock.staying["torch"] == "2.11.0" and "torch" not in names  # the host freeze
    assert "blake3" in names  # SpecPilot's own serve-side dependency the host lacks


def test_a_tampered_entry_is_refused(lock_copy):
    path = lock_copy / "envs" / "sglang-0.5.17@h200.toml"
    text = path.read_text()
    sha = "fb4cba478a5dca5ee146550b39f33add1c4e475d21ee11810b86ed1c58068093"
    path.write_text(text.replace(sha, "0" * 64))
    with pytest.raises(
        PinError,
        match=r"sglang-0.5.17@h200.toml: its entries do not hash to its digest .*"
        r"`make env-lock RUNTIME=sglang-0.5.17 HOST=h200`",
    ):
        load_env_lock("sglang-0.5.17", "h200", lock_copy)
    path.write_text(text.replace("size = ", "size = -", 1))
    with pytest.raises(PinError, match="size must be a positive integer"):
        load_env_lock("sglang-0.5.17", "h200", lock_copy)


def test_a_lock_resolved_against_another_profile_is_stale(lock_copy):
    profile = lock_copy / "hosts" / "h200.toml"
    profile.write_text(profile.read_text().replace('"numpy" = "2.5.2"', '"numpy" = "2.3.5"'))
    with pytest.raises(
        PinError,
        match=r"was resolved against host profile blake3:.*\(stale lock\); run "
        r"`make env-lock RUNTIME=sglang-0.5.17 HOST=h200`",
    ):
        load_env_lock("sglang-0.5.17", "h200", lock_copy)
    # comments do not move a profile's digest
    profile = lock_copy / "hosts" / "h200.toml"
    shutil.copyfile(LOCKS / "hosts" / "h200.toml", profile)
    profile.write_text("# a comment\n" + profile.read_text())
    load_env_lock("sglang-0.5.17", "h200", lock_copy)


def test_the_manifest_records_the_environment_and_cpu_engines_have_none():
    inputs = resolve_inputs(compose_setting(PADDED, "final", OLD), load_lock(LOCKS))
    env = inputs.record()["environment"]
    lock = load_env_lock("sglang-0.5.17", "h200", LOCKS)
    assert (env["host"], env["lock"], env["digest"], env["profile_digest"]) == (
        "h200",
        "envs/sglang-0.5.17@h200.toml",
        lock.digest,
        lock.profile_digest,
    )
    assert (
        "FlashAttention-3 kernels (sgl_kernel/flash_ops, 1.1 GB), loaded only by the fa3 attention backend"
        in env["native_prune"]
    )
    assert "host" not in inputs.config["hardware"]
    cpu = resolve_inputs(compose_setting("cpu_c1_stories260k_ngram", "final"), load_lock(LOCKS))
    assert "environment" not in cpu.record() and "host" not in cpu.config["hardware"]


# --- native prune rules ----------------------------------------------------------------------------------------


def test_distribution_rules_drop_the_lazy_packages_and_what_only_they_need():
    lock = load_env_lock("sglang-0.5.17", "h200", LOCKS)
    cfg = _padded_cfg()
    kept, dropped = select_distributions(lock, native_rules(cfg), cfg)
    names = {w.name for w in kept}
    assert {"sglang", "sglang-kernel", "flashinfer-python", "xgrammar", "transformers", "blake3"} <= names
    assert dropped["flash-attn-4"].startswith("kernel DSLs")
    assert dropped["nvidia-cutlass-dsl-libs-cu12"] == "needed only by dropped distributions"
    assert not names & {"nvidia-cutlass-dsl", "tilelang", "datasets", "pyarrow"}
    # with FA3 attention the rule does not apply: the lazy packages are kept
    fa3 = dict(
        cfg, runtime=dict(cfg["runtime"], launch_args={**cfg["runtime"]["launch_args"], "attention-backend": "fa3"})
    )
    kept_fa3, _ = select_distributions(lock, native_rules(fa3), fa3)
    assert "flash-attn-4" in {w.name for w in kept_fa3}


def test_a_distribution_rule_naming_what_the_lock_lacks_is_an_error():
    lock = load_env_lock("sglang-0.5.17", "h200", LOCKS)
    cfg = _padded_cfg()
    with pytest.raises(ConfigError, match="distribution no-such-dist is not in sglang-0.5.17@h200.toml"):
        select_distributions(lock, [{"why": "stale", "distributions": ["no-such-dist"]}], cfg)


def _kernel_lock(tmp_path: Path, data_dir: Path, tamper: bool = False):
    """A one-wheel lock whose wheel (built here with zipfile, named like sglang-kernel's) lies in <data>/wheels."""
    filename = "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl"
    wheel = data_dir / "wheels" / filename
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in KERNEL_FILES:
            zf.writestr(name, f"contents of {name}\n" * 10)
    data = wheel.read_bytes()
    entry = {
        "name": "sglang-kernel",
        "version": "0.4.5",
        "filename": filename,
        "requires": [],
        "url": f"https://example.invalid/{filename}",
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }
    if tamper:  # the cached wheel differs from what the lock pins (one byte)
        wheel.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    _profile(tmp_path, {"torch": "2.11.0+cu130"})
    profile = load_host_profile("testhost", tmp_path)
    body = lock_body(
        "sglang-0.5.17",
        "testhost",
        profile.digest,
        profile.python,
        profile.platforms,
        13,
        ["sglang-kernel==0.4.5"],
        {},
        [entry],
    )
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "sglang-0.5.17@testhost.toml").write_text(to_toml(dict(body, digest=digest_of(body))))
    return load_env_lock("sglang-0.5.17", "testhost", tmp_path)


def test_the_sgl_kernel_rules_drop_exactly_those_files(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("SPECPILOT_MIRROR", "")
    lock = _kernel_lock(tmp_path, tmp_path / "data")
    cfg = _padded_cfg()
    rules = [r for r in native_rules(cfg) if any(g.startswith("sgl_kernel/") for g in r.get("files") or ())]
    record = install_environment(lock, rules, cfg, tmp_path / "prefix")
    assert {f["path"] for f in record["dropped"]} == DROPPED_BY_RULES
    assert {f["path"] for f in record["kept"]} == set(KERNEL_FILES) - DROPPED_BY_RULES
    assert (tmp_path / "prefix" / "sgl_kernel" / "infllm_v2" / "attention.py").is_file()
    assert not (tmp_path / "prefix" / "sgl_kernel" / "flash_ops.abi3.so").exists()
    assert record["lock"]["digest"] == lock.digest
    # a rule whose glob matches nothing is an error, naming the rule and the glob
    stale = rules + [{"why": "gone", "files": ["sgl_kernel/no_such_ops*.so"]}]
    with pytest.raises(ConfigError, match=r"rule 'gone': sgl_kernel/no_such_ops\*.so matches no file"):
        install_environment(lock, stale, cfg, tmp_path / "prefix2")


def test_install_refuses_a_wheel_whose_sha256_differs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("SPECPILOT_MIRROR", "")
    lock = _kernel_lock(tmp_path, tmp_path / "data", tamper=True)
    cfg = _padded_cfg()
    with pytest.raises(
        PinError,
        match=r"wheel sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl: sha256 "
        r"[0-9a-f]{16}… \(\d+ bytes\) does not match the lock's [0-9a-f]{16}…",
    ):
        install_environment(lock, [], cfg, tmp_path / "prefix")
    assert not (tmp_path / "prefix").exists()


def test_keep_rules_hold_what_the_runtime_imports_without_declaring_it():
    """dill reaches the 0.5.17 lock only through `datasets` (left out for such engines), but SGLang imports it at
    start (custom_logit_processor.py): the `keep` rule holds it and what it needs; without the rule it would go, and
    a keep rule naming a distribution the lock does not know is an error."""
    cfg = _padded_cfg()
    lock = load_env_lock("sglang-0.5.17", "h200")
    rules = native_rules(cfg)
    kept = {w.name for w in select_distributions(lock, rules, cfg)[0]}
    assert {"dill", "jsonschema", "referencing", "rpds-py"} <= kept
    without = [r for r in rules if not r.get("keep")]
    assert "dill" not in {w.name for w in select_distributions(lock, without, cfg)[0]}
    with pytest.raises(ConfigError, match=r"rule 'x': distribution no-such-dist is not in sglang-0.5.17@h200.toml"):
        select_distributions(lock, rules + [{"why": "x", "keep": ["no-such-dist"]}], cfg)
