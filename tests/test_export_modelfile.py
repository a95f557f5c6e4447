"""The Ollama Modelfile: its Go TEMPLATE renders conversations exactly as the tokenizer's Jinja chat template.

The TEMPLATE is rendered with ``gotemplate`` (a port of the subset of Go's text/template it uses) and, where the
``go`` toolchain is installed (Debian: ``apt-get install golang-go``), with Go's own text/template as well.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from gotemplate import render
from hang import HANG_S
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
SAME_ROLES = [  # consecutive messages of one role: two turns, as the chat template renders them
    [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a document"},
        {"role": "user", "content": "a question about it"},
        {"role": "assistant", "content": "part one"},
        {"role": "assistant", "content": "part two"},
        {"role": "user", "content": "thanks"},
    ],
]
TEMPLATES = [CHATML, DEFAULT_SYSTEM, HEADERS, PHI3, MERGED_SYSTEM]


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


@pytest.mark.parametrize("template", TEMPLATES)
def test_go_template_renders_like_the_chat_template(tokenizer, template: str) -> None:
    tokenizer.chat_template = template
    fmt = chat_format(tokenizer)
    assert fmt is not None
    go = go_template(fmt)
    for messages in CONVERSATIONS + SAME_ROLES:
        assert render(go, messages) == expected(tokenizer, fmt, messages)


def test_two_user_messages_are_two_turns(tokenizer) -> None:
    tokenizer.chat_template = CHATML
    fmt = chat_format(tokenizer)
    assert fmt is not None
    text = render(go_template(fmt), SAME_ROLES[0])
    assert text == "<|im_start|>user\nfirst<|im_end|>\n<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n"


ALTERNATING_ONLY = (  # Mistral-style: system text first, then user and assistant must alternate
    "{% set ns = namespace(turn=0) %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ m['content'] + '\\n\\n' }}{% else %}{% if (m['role'] == 'user') != (ns.turn % 2 == 0) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}{% set ns.turn = ns.turn + 1 %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + '</s>' }}"
    "{% endif %}{% endif %}{% endfor %}"
)


def test_a_template_that_refuses_same_role_turns_keeps_the_alternating_ones(tokenizer) -> None:
    tokenizer.chat_template = ALTERNATING_ONLY
    with pytest.raises(Exception, match="roles must alternate"):
        tokenizer.apply_chat_template(SAME_ROLES[0], tokenize=False)
    fmt = chat_format(tokenizer)
    assert fmt is not None and ("user", "user") not in fmt.transitions
    for messages in CONVERSATIONS:
        assert render(go_template(fmt), messages) == expected(tokenizer, fmt, messages)


GO_RENDER = """package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

type Message struct{ Role, Content string }

func main() {
	source, err := os.ReadFile(os.Args[1])
	if err != nil {
		panic(err)
	}
	var conversations [][]Message
	if err := json.NewDecoder(os.Stdin).Decode(&conversations); err != nil {
		panic(err)
	}
	tmpl := template.Must(template.New("modelfile").Parse(string(source)))
	var out []string
	for _, messages := range conversations {
		var text strings.Builder
		if err := tmpl.Execute(&text, struct{ Messages []Message }{messages}); err != nil {
			panic(err)
		}
		out = append(out, text.String())
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
"""


@pytest.fixture(scope="module")
def go_render(tmp_path_factory: pytest.TempPathFactory) -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed (Debian: apt-get install golang-go); the Python port renders instead")
    folder = tmp_path_factory.mktemp("go-render")
    (folder / "main.go").write_text(GO_RENDER)
    (folder / "go.mod").write_text("module render\n\ngo 1.19\n")
    subprocess.run([go, "build", "-o", "render", "."], cwd=folder, check=True, timeout=HANG_S)
    return folder / "render"


@pytest.mark.parametrize("template", TEMPLATES)
def test_go_itself_renders_the_modelfile_template_like_the_chat_template(
    tokenizer, go_render: Path, tmp_path: Path, template: str
) -> None:
    tokenizer.chat_template = template
    fmt = chat_format(tokenizer)
    assert fmt is not None
    source = modelfile("m.gguf", fmt, []).split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    (tmp_path / "template").write_text(source)
    conversations = CONVERSATIONS + SAME_ROLES
    items = [[{key.capitalize(): value for key, value in m.items()} for m in messages] for messages in conversations]
    result = subprocess.run(
        [str(go_render), str(tmp_path / "template")],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stderr
    for messages, text in zip(conversations, json.loads(result.stdout), strict=True):
        assert text == expected(tokenizer, fmt, messages)


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
