"""Prompt rendering on the client: plain text for models without a chat template, the template otherwise."""

import json
import shutil

from specpilot_build.measure.prompts import PromptRenderer, prompt_digest


def test_plain_text_model_gets_bos_plus_text_like_llama2c(stories_dir, golden):
    renderer = PromptRenderer(stories_dir)
    assert not renderer.uses_chat_template
    assert renderer.render(golden["prompt"]) == golden["prompt_ids"]  # llama2.c's own encoding
    assert renderer.context_length == 512


def test_chat_template_is_applied_once_without_a_second_bos(tmp_path, stories_dir):
    model = tmp_path / "model"
    shutil.copytree(stories_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    renderer = PromptRenderer(model)
    assert renderer.uses_chat_template
    ids = renderer.render("Once upon a time")
    assert ids[0] == 1 and ids[1] != 1
    assert renderer.tokenizer.decode(ids[1:]) == "[user] Once upon a time\n[assistant] "
    plain = PromptRenderer(model, chat_template="none")
    assert plain.render("Once upon a time") == [1, 403, 407, 261, 378]


def test_digest_changes_with_any_id():
    assert prompt_digest([1, 403, 407]) != prompt_digest([1, 403, 408])
    assert prompt_digest([1, 403, 407]) == prompt_digest([1, 403, 407])
    assert prompt_digest([1, 40, 3]) != prompt_digest([1, 403])
