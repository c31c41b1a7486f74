"""`make demo` on a fresh data dir is one command: the embedded default's final drafts with the corpus drafter, and
the demo makes it (the very id lockfiles/drafters.toml pins) before the final serves, then benches, verifies."""

from __future__ import annotations

import tomllib

import pytest
from reference_runtime_helpers import three_free_ports

from specpilot_build.locations import REPO_ROOT

SETTING = "cpu_c1_stories260k_ngram"


@pytest.mark.slow
def test_the_demo_makes_the_missing_corpus_drafter_and_its_final_verifies(drafter_scratch, tmp_path, monkeypatch):
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.cli.demo import demo, make_missing_drafter
    from specpilot_build.models.drafters import drafter_dir

    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    committed = tomllib.loads((REPO_ROOT / "lockfiles" / "drafters.toml").read_text())["stories260k-corpus"]["id"]
    assert not drafter_dir(committed).exists()  # a fresh data dir, and no pin in the scratch lock
    result = demo(SETTING, limit=1, max_new_tokens=16, port=three_free_ports(), datasets=["gsm8k", "mbpp"])
    made = tomllib.loads((drafter_scratch / "drafters.toml").read_text())["stories260k-corpus"]["id"]
    assert made == committed and drafter_dir(committed).is_dir()  # made here, the same id as the committed pin
    assert result["verify"]["verdict"] == "lossless"
    final = build_engine(SETTING, "final").engine
    assert final.id == result["engines"]["final"]  # the final that served pins the corpus it was seeded with
    assert final.manifest["inputs"]["checkpoints"]["drafter"]["revision"] == committed.removeprefix("blake3:")
    assert make_missing_drafter(SETTING) is None  # stored now: a second demo makes nothing
    assert make_missing_drafter("cpu_c1_stories260k_handwritten") is None  # no recipe drafter: nothing to make
