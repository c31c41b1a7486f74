"""output_text as each runtime reports it: SGLang decodes the output behind the last prompt ids (a leading space
stays), the reference runtime decodes the output alone; verify recomputes the one its runtime gives."""

from __future__ import annotations

import pytest

from specpilot_build.measure.verify import detokenizer_context, output_text

STORY = "Once upon a time, there was a little girl named Lily."


@pytest.mark.parametrize("runtime,context", [("sglang", 5), ("sglang-0.5.17", 5), ("reference", 0)])
def test_each_runtime_has_its_detokenizer_context(runtime, context):
    assert detokenizer_context(runtime) == context


def test_sglang_text_keeps_the_leading_space_of_the_first_output_token(tokenizer):
    ids = tokenizer.encode(STORY)
    prompt, output = ids[:6], ids[6:]
    whole, head = (tokenizer.decode(part, skip_special_tokens=True) for part in (ids, prompt))
    assert whole.startswith(head)
    in_context = output_text(tokenizer, prompt, output, detokenizer_context("sglang-0.5.17"))
    assert in_context == whole[len(head) :]
    assert in_context.startswith(" ")
    alone = output_text(tokenizer, prompt, output, detokenizer_context("reference"))
    assert alone == in_context[1:]


def test_a_prompt_shorter_than_the_context_is_decoded_whole(tokenizer):
    ids = tokenizer.encode(STORY)
    prompt, output = ids[:2], ids[2:]
    whole, head = (tokenizer.decode(part, skip_special_tokens=True) for part in (ids, prompt))
    assert output_text(tokenizer, prompt, output, 5) == whole[len(head) :]


@pytest.mark.sglang
@pytest.mark.parametrize("runtime", ["sglang", "sglang-0.5.17"])
def test_the_sglang_context_is_the_pinned_wheels_own(runtime, session_data):
    """The 5 is SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET, read from each pinned wheel: a release that changes
    it fails here rather than in verify on a GPU host."""
    import re
    import zipfile

    from specpilot_build.locations import REPO_ROOT
    from specpilot_build.pins.lockfile import load_lock
    from specpilot_build.pins.wheels import wheel_file

    pin = load_lock(REPO_ROOT / "lockfiles").runtimes[runtime]
    with zipfile.ZipFile(wheel_file(pin)) as zf:
        source = zf.read("sglang/srt/managers/schedule_batch.py").decode()
    [value] = re.findall(r"^INIT_INCREMENTAL_DETOKENIZATION_OFFSET = (\d+)$", source, re.MULTILINE)
    assert int(value) == detokenizer_context(runtime)
