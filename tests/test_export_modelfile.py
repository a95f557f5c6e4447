"""The Ollama Modelfile: its Go TEMPLATE renders conversations exactly as the tokenizer's Jinja chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from gotemplate import render
from helpers import build_tokenizer

from engine.config import demo_model_dir
from engine.export.modelfile import chat_format, go_template, modelfile, stop_tokens

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_SYSTEM = (  # Qwen2.5-style: a default system turn when the conversation has none
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n"
    "{% endif %}" + CHATML
)
HEADERS = (  # Llama-3-style role headers, BOS written by the template
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
    " + m['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
MERGED_SYSTEM = (  # Gemma-style: no system turn, the system text opens the first user turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{% if loop.first %}{{ first }}{% endif %}{{ m['content'] + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
REWRITES_CONTENT = CHATML.replace("message['content']", "message['content'] | upper")

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is {{ 2 + 2 }}?"}],
    [
        {"role": "system", "content": "You answer in French.\nAlways."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "bonjour\n"},
        {"role": "user", "content": "and goodbye?"},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": 'quote " and backslash \\ end'},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def expected(tokenizer, fmt, messages: list[dict[str, str]]) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(fmt.bos)
    return text[len(fmt.bos) :]  # llama.cpp adds BOS itself when the template wrote one


@pytest.mark.parametrize("template", [CHATML, DEFAULT_SYSTEM, HEADERS, PHI3, MERGED_SYSTEM])
def test_go_template_renders_like_the_chat_template(tokenizer, template: str) -> None:
    tokenizer.chat_template = template
    fmt = chat_format(tokenizer)
    assert fmt is not None
    go = go_template(fmt)
    for messages in CONVERSATIONS:
        assert render(go, messages) == expected(tokenizer, fmt, messages)


def test_leading_bos_is_left_to_llama_cpp(tokenizer) -> None:
    tokenizer.chat_template = HEADERS
    tokenizer.bos_token = "<|endoftext|>"
    tokenizer.add_bos_token = True
    try:
        fmt = chat_format(tokenizer)
        assert fmt is not None and fmt.bos == "<|endoftext|>"
        text = render(go_template(fmt), CONVERSATIONS[1])
        assert text.startswith("<|start_header_id|>system") and "<|endoftext|>" not in text
    finally:
        tokenizer.bos_token = None
        tokenizer.add_bos_token = False


def test_a_template_that_rewrites_content_gets_no_go_template(tokenizer) -> None:
    tokenizer.chat_template = REWRITES_CONTENT
    assert chat_format(tokenizer) is None
    text = modelfile("m.gguf", None, ["<|im_end|>"])
    assert "TEMPLATE" not in text and text.startswith("FROM ./m.gguf\n")


def test_demo_modelfile_template_and_stops() -> None:
    from transformers import AutoTokenizer

    demo = AutoTokenizer.from_pretrained(demo_model_dir())
    fmt = chat_format(demo)
    assert fmt is not None
    stops = stop_tokens(demo, fmt, [2])
    assert stops == ["<|im_end|>"]
    text = modelfile("demo.gguf", fmt, stops)
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    for messages in CONVERSATIONS:
        assert render(template, messages) == demo.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert 'PARAMETER stop "<|im_end|>"' in text


def test_phi3_stops_include_the_turn_end(tokenizer) -> None:
    tokenizer.chat_template = PHI3
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    fmt = chat_format(tokenizer)
    stops = stop_tokens(tokenizer, fmt, [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    assert stops == ["<|im_end|>", "<|end|>"]


def test_renderer_is_strict(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        render("{{ if eq .Role }}x", [])
    with pytest.raises(KeyError):
        render("{{ range .Messages }}{{ .Missing }}{{ end }}", [{"role": "user"}])
