"""Recipe (d), the corpus drafter, on the stories260K target: made and pinned like every drafter (same id and bytes on
a second make), seeding the reference runtime's shared n-gram cache before the first request (the proposals come from
the corpus at once, the clearing at capacity keeps them), lossless against ar, and the one-line refusals (a recipe key
that does nothing, an id outside the vocabulary, a flipped byte, the corpus without the shared cache)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

SETTING = "cpu_c1_stories260k_ngram"
SMALL = ["data.limit=2", "data.max_new_tokens=16"]  # 10 prompts, 16 new tokens: seconds
CORPUS_MECHANISM = "+mechanism@final.mechanisms.ngram-corpus=ngram-corpus"
HANDWRITTEN = "cpu_c1_stories260k_handwritten"  # a final without the corpus, for the mechanism to add it to


@pytest.fixture(autouse=True)
def scratch_lock(drafter_scratch):
    """A scratch lock (drafters.toml is written) and a data dir per test (the store, the sets)."""
    return drafter_scratch


def make_small():
    from specpilot_build.draft.corpus import make_corpus
    from specpilot_build.draft.recipe import load_recipe

    return make_corpus(SETTING, load_recipe("corpus", SMALL))


def write_corpus_dir(directory: Path, rows: list[list[int]]) -> Path:
    """A corpus drafter directory by hand: the target's tokenizer files and corpus.safetensors of `rows`."""
    from specpilot_build.draft.corpus import CORPUS, write_corpus
    from specpilot_build.draft.target import setting_target, tokenizer_files

    target = setting_target(SETTING).directory
    directory.mkdir(parents=True)
    for name in tokenizer_files(target):
        shutil.copyfile(target / name, directory / name)
    write_corpus([{"prompt": row, "output": []} for row in rows], directory / CORPUS)
    return directory


def _hashes(directory: Path) -> dict[str, str]:
    from specpilot_build.models.proof import sha256_of

    return {p.name: sha256_of(p) for p in sorted(directory.iterdir())}


def load(tmp_path, config, stories_dir, corpus_dir):
    from reference_runtime_helpers import write_engine

    from specpilot_runtime.runtime import load_runtime

    engine = write_engine(tmp_path / f"eng-{config['arm']['name']}", config)
    return load_runtime(str(engine), "id", str(stories_dir), str(corpus_dir) if corpus_dir else None, None)


# --- the recipe, the store and the lock --------------------------------------------------------------------------


def test_the_corpus_is_the_targets_greedy_set_pinned_with_the_same_id_and_bytes_on_a_second_make(
    scratch_lock, tmp_path, monkeypatch
):
    import torch
    from safetensors.torch import load_file

    from specpilot_build.draft import data as data_step
    from specpilot_build.draft.store import load_drafter_pins

    made = make_small()
    pin = load_drafter_pins()["stories260k-corpus"]
    assert (pin.id, pin.recipe, pin.target) == (made.id, "corpus", "karpathy/tinyllamas")
    assert {f.path: f.sha256 for f in pin.files} == _hashes(made.directory)
    assert sorted(_hashes(made.directory)) == [
        "corpus.safetensors",
        "drafter.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    record = json.loads((made.directory / "drafter.json").read_text())
    assert record["id"] == made.id and "seed" not in record["recipe"] and "num_layers" not in record["recipe"]
    # the rows are the cached self-distillation set's, prompt then output, in its order
    (set_file,) = (tmp_path / "data" / "draft-data").glob("*/data.json")
    rows = json.loads(set_file.read_text())["rows"]
    assert len(rows) == 10 and record["data"] == data_step.rows_digest(rows)
    corpus = load_file(made.directory / "corpus.safetensors")
    assert corpus["tokens"].dtype == torch.int32 and corpus["offsets"].dtype == torch.int64
    bounds = corpus["offsets"].tolist()
    assert [corpus["tokens"][a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])] == [
        r["prompt"] + r["output"] for r in rows
    ]
    # a second make from nothing (a fresh store and set): the same id and the same bytes
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data2"))
    again = make_small()
    assert again.built and again.id == made.id and _hashes(again.directory) == _hashes(made.directory)


@pytest.mark.parametrize("override", ["seed=1", "num_layers=2", "train.steps=3", "draft_vocab=16"])
def test_a_recipe_key_that_does_nothing_for_a_corpus_is_one_line(override):
    from specpilot_build.draft.recipe import load_recipe
    from specpilot_build.errors import ConfigError

    key = override.split("=")[0].split(".")[0]
    with pytest.raises(ConfigError) as exc:
        load_recipe("corpus", [override])
    assert f"key '{key}' does nothing for kind corpus" in str(exc.value) and "\n" not in str(exc.value)


def test_a_flipped_byte_in_a_stored_corpus_is_refused_naming_the_file(scratch_lock):
    from specpilot_build.draft.store import locked_drafter
    from specpilot_build.errors import IntegrityError

    made = make_small()
    path = made.directory / "corpus.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="corpus.safetensors: differs from the pinned drafter stories260k-corpus"):
        locked_drafter("stories260k-corpus", SETTING, "corpus")
    with pytest.raises(IntegrityError, match="corpus.safetensors: differs from the pinned drafter"):
        make_small()  # found in the store: re-hashed, not trusted


def test_a_corpus_with_an_id_outside_the_vocabulary_is_refused_at_make_and_at_load(stories_dir, tmp_path):
    from reference_runtime_helpers import engine_config

    from specpilot_build.draft.store import check_against_target
    from specpilot_build.draft.target import setting_target
    from specpilot_build.errors import SpecPilotError
    from specpilot_runtime.config import RuntimeConfigError

    bad = write_corpus_dir(tmp_path / "bad", [[1, 2, 3], [4, 512, 6]])  # stories260K: 512 tokens
    with pytest.raises(SpecPilotError) as exc:
        check_against_target(bad, setting_target(SETTING).directory)
    assert "token id 512 is outside the target's vocabulary of 512" in str(exc.value)
    with pytest.raises(RuntimeConfigError) as exc:
        load(tmp_path, engine_config("final"), stories_dir, bad)
    assert "corpus.safetensors: token id 512 is outside the target's vocabulary of 512" in str(exc.value)
    assert "\n" not in str(exc.value)


# --- the runtime: the shared cache seeded before the first request -------------------------------------------------


def test_the_first_request_drafts_a_continuation_seen_only_in_the_corpus(stories_dir, golden, tmp_path):
    """The corpus holds llama2.c's golden sequence: the seeded engine proposes its continuation from the first step
    of the first request, and generates it with far fewer target forwards than the same engine unseeded."""
    from reference_runtime_helpers import engine_config

    corpus = write_corpus_dir(tmp_path / "corpus", [golden["sequence_ids"]])
    prompt, sequence = golden["prompt_ids"], golden["sequence_ids"]
    steps = {}
    for seeded in (True, False):
        runtime = load(tmp_path / str(seeded), engine_config("final", k=8), stories_dir, corpus if seeded else None)

        class Seq:
            tokens = list(prompt)

        if seeded:
            assert runtime.engine.drafter.propose(Seq, 8) == sequence[len(prompt) : len(prompt) + 8]
            assert runtime.server_info()["ngram_seed_tokens"] == len(sequence)
        result = runtime.engine.generate(prompt, len(sequence) - len(prompt), timeout=60)
        assert prompt + result["output_ids"] == sequence  # lossless either way
        steps[seeded] = runtime.engine.verify_steps
    assert steps[True] * 3 < steps[False]


def test_the_capacity_clearing_keeps_the_seed():
    from specpilot_runtime.drafters import NgramIndex

    index = NgramIndex(1, 3, capacity=4)
    index.seed([[7, 8, 9, 10, 11]])
    served = [1, 2, 3, 4, 5, 6]
    index.add(served, 0)
    assert index.lookup([0, 1, 2], 2) == [3, 4]  # served n-grams are found
    index.add([20, 21], 0)  # over capacity: the served index starts afresh
    assert index.lookup([0, 1, 2], 2) == []
    assert index.lookup([5, 8, 9], 2) == [10, 11]  # the seed stays, served n-grams win where both have one
    index.add([8, 9, 30], 0)
    assert index.lookup([8, 9], 2) == [30]


def test_a_corpus_without_the_shared_cache_is_refused_in_one_line(stories_dir, golden, tmp_path):
    from reference_runtime_helpers import engine_config

    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config
    from specpilot_build.errors import ConfigError
    from specpilot_runtime.config import RuntimeConfigError

    # the stock arm (prompt lookup, no mechanisms) with the corpus: composed, refused
    with pytest.raises(ConfigError) as exc:
        effective_config(compose_setting(SETTING, "stock", ["drafter.recipe=corpus"]).config)
    assert "runtime_options.shared_ngram_cache true" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="a corpus seeds the n-gram chain drafter only"):
        effective_config(compose_setting(SETTING, "final", [CORPUS_MECHANISM, "drafter.tree_breadth=2"]).config)
    corpus = write_corpus_dir(tmp_path / "corpus", [golden["sequence_ids"]])
    with pytest.raises(RuntimeConfigError, match="runtime_options.shared_ngram_cache is off"):
        load(tmp_path, engine_config("final", runtime_options={}), stories_dir, corpus)


def test_the_corpus_mechanism_moves_only_the_final_engine_and_pins_the_corpus(scratch_lock, tmp_path, monkeypatch):
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config
    from specpilot_build.errors import PinError

    for arm in ("ar", "stock", "final"):  # without the mechanism nothing names a corpus
        assert "recipe" not in effective_config(compose_setting(HANDWRITTEN, arm).config)["drafter"]
    for arm in ("ar", "stock"):  # the mechanism applies to the final arm only
        plain = effective_config(compose_setting(HANDWRITTEN, arm).config)
        assert (
            effective_config(compose_setting(HANDWRITTEN, arm, [CORPUS_MECHANISM]).config)["drafter"]
            == plain["drafter"]
        )
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    with pytest.raises(PinError, match=rf"run `make draft SETTING={HANDWRITTEN} RECIPE=corpus`"):
        build_engine(HANDWRITTEN, "final", [CORPUS_MECHANISM])
    made = make_small()
    engine = build_engine(HANDWRITTEN, "final", [CORPUS_MECHANISM]).engine
    assert engine.manifest["inputs"]["checkpoints"]["drafter"]["revision"] == made.id.removeprefix("blake3:")
    assert engine.config["drafter"]["recipe"] == "corpus"
    assert engine.id != build_engine(HANDWRITTEN, "final").engine.id


@pytest.mark.slow
def test_a_served_corpus_seeded_final_verifies_lossless(scratch_lock, tmp_path, monkeypatch):
    from reference_runtime_helpers import free_port

    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.measure import verify as vf
    from specpilot_build.measure.bench import bench
    from specpilot_build.serve.process import serve, stop

    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    made = make_small()
    final = build_engine(SETTING, "final").engine  # the embedded default's final: the corpus-seeded shared cache
    assert final.manifest["inputs"]["checkpoints"]["drafter"]["revision"] == made.id.removeprefix("blake3:")
    ar = build_engine(SETTING, "ar").engine
    port, oracle_port = free_port(), free_port()
    serve(final, port, quiet=True)
    try:
        run = bench(
            final.id,
            "final",
            limit=2,
            max_new_tokens=48,
            port=port,
            datasets=["gsm8k", "humaneval"],
            progress=False,
            oracle_engine_id=ar.id,
        )
    finally:
        stop(port)
    requests = json.loads(run.read_text())["requests"]
    report = vf.verify(str(run), oracle=ar.id, port=oracle_port, progress=False)
    assert report["verdict"] == "lossless" and report["real_mismatches"] == 0
    assert report["verified"] == report["tokens"] == sum(r["completion_tokens"] for r in requests)


def test_the_ngram_corpus_space_composes_and_its_corpus_candidates_carry_the_shared_cache():
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.config.effective import effective_config
    from specpilot_build.tune.space import candidate_overrides, check_space, load_space

    make_small()  # a candidate with the corpus composes only once it is pinned
    space = load_space("ngram_corpus")
    assert space.grid()["drafter.recipe"] == [None, "corpus"] and max(space.grid()["drafter.num_draft_tokens"]) == 16
    mechanisms = check_space(space, SETTING)  # every value composes as the final arm's only mechanism
    overrides = candidate_overrides(
        mechanisms, {**space.context("drafter.recipe", "corpus"), "drafter.num_draft_tokens": 16}
    )
    cfg = effective_config(compose_setting(SETTING, "final", overrides).config)
    assert cfg["drafter"]["recipe"] == "corpus" and cfg["runtime_options"] == {"shared_ngram_cache": True}
    assert cfg["drafter"]["num_draft_tokens"] == 16
