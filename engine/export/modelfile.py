"""The Ollama Modelfile for a GGUF export: the model file, its chat template in Go-template form, stop tokens.

Ollama renders prompts with Go templates, models carry Jinja chat templates. Instead of translating Jinja
(a language Go templates cannot express in general), the tokenizer's own template is *measured*: conversations
whose messages are unique marker strings are rendered, and the text between consecutive messages is read off
as a transition that depends on the previous and the next role (including the start of the prompt and the
generation prompt). The Go template replays those transitions. The measured transitions are checked against
further renders before use; a template they cannot reproduce (one that rewrites message content, say) gets no
TEMPLATE line, and Ollama falls back to the chat template stored in the GGUF file.

Two messages of the same role in a row (two user messages, as a client that sends a document and then a
question does) are measured too, so the TEMPLATE renders them as the model's template does (two turns, not
"firstsecond"); a template that refuses such conversations leaves those transitions out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, GENERATE = "", "generate"
ROLES = ("system", "user", "assistant")


def _marker(index: int) -> str:
    return f"Msg{index}qzX"  # mixed case: a template that changes case is caught


@dataclass(frozen=True)
class ChatFormat:
    """Text between messages, keyed by (previous role or START, next role or GENERATE)."""

    transitions: dict[tuple[str, str], str]
    bos: str = ""  # a leading BOS token the template writes and llama.cpp adds by itself

    def render(self, messages: list[dict[str, str]]) -> str:
        out, prev = [], START
        for message in messages:
            out.append(self.transitions.get((prev, message["role"]), ""))
            out.append(message["content"])
            prev = message["role"]
        if prev != START:
            out.append(self.transitions.get((prev, GENERATE), ""))
        return "".join(out)


def _render(tokenizer: Any, roles: list[str]) -> str:
    messages = [{"role": role, "content": _marker(i)} for i, role in enumerate(roles)]
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


def _measure(tokenizer: Any, roles: list[str], found: dict[tuple[str, str], str]) -> bool:
    text = _render(tokenizer, roles)
    position, prev = 0, START
    for index, role in enumerate([*roles, GENERATE]):
        end = text.find(_marker(index), position) if role != GENERATE else len(text)
        if end < 0:
            return False
        piece = text[position:end]
        if found.setdefault((prev, role), piece) != piece:
            return False
        position, prev = end + len(_marker(index)), role
    return True


SHAPES = [
    ["system", "user", "assistant", "user", "assistant", "user"],
    ["user", "assistant", "user"],
]
CHECKS = [["system", "user"], ["user"], ["user", "assistant", "user", "assistant", "user"]]
SAME_ROLE_SHAPES = [  # measured where the template accepts them: many refuse roles that do not alternate
    ["user", "user", "assistant", "assistant", "user"],
    ["system", "system", "user"],
]


def _measure_same_roles(tokenizer: Any, found: dict[tuple[str, str], str]) -> list[list[str]]:
    """Add the transitions between same-role messages to ``found``; returns the shapes that were measured."""
    measured = []
    for shape in SAME_ROLE_SHAPES:
        trial = dict(found)
        try:
            consistent = _measure(tokenizer, shape, trial)
        except Exception:  # the template raises on this conversation: Ollama gets no rule for it either
            continue
        if consistent:
            found.update(trial)
            measured.append(shape)
    return measured


def chat_format(tokenizer: Any) -> ChatFormat | None:
    """The tokenizer's chat template as role transitions, or None when it cannot be reproduced that way."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    found: dict[tuple[str, str], str] = {}
    try:
        if not all(_measure(tokenizer, shape, found) for shape in SHAPES):
            return None
        same_roles = _measure_same_roles(tokenizer, found)
        checks = [(shape, _render(tokenizer, shape)) for shape in CHECKS + same_roles]
    except Exception:  # a template that rejects these conversations (e.g. no system role) cannot be measured
        return None
    bos = getattr(tokenizer, "bos_token", None) or ""
    adds_bos = bool(bos) and bool(getattr(tokenizer, "add_bos_token", False))
    fmt = ChatFormat(found)
    for shape, expected in checks:
        messages = [{"role": role, "content": _marker(i)} for i, role in enumerate(shape)]
        if fmt.render(messages) != expected:
            return None
    if adds_bos:
        starts = {key: text for key, text in found.items() if key[0] == START}
        if starts and all(text.startswith(bos) for text in starts.values()):
            found.update({key: text[len(bos) :] for key, text in starts.items()})
            return ChatFormat(found, bos=bos)
    return fmt


def _literal(text: str) -> str:
    """Go-template text for a literal: as is, except for the template's own delimiters."""
    return text.replace("{{", '{{ "{{" }}')


def go_template(fmt: ChatFormat) -> str:
    """An Ollama TEMPLATE that renders ``.Messages`` exactly as ``fmt`` does."""
    branches = []
    for (prev, role), text in sorted(fmt.transitions.items()):
        if role == GENERATE or not text:
            continue
        branches.append((f'and (eq $prev "{prev}") (eq .Role "{role}")', _literal(text)))
    body = "".join(f"{{{{ {'if' if i == 0 else 'else if'} {cond} }}}}{text}" for i, (cond, text) in enumerate(branches))
    if branches:
        body += "{{ end }}"
    ends = [(prev, _literal(text)) for (prev, role), text in sorted(fmt.transitions.items()) if role == GENERATE]
    tail = "".join(
        f'{{{{ {"if" if i == 0 else "else if"} eq $prev "{prev}" }}}}{text}' for i, (prev, text) in enumerate(ends)
    )
    if ends:
        tail += "{{ end }}"
    loop = f"{{{{ range .Messages }}}}{body}{{{{ .Content }}}}{{{{ $prev = .Role }}}}{{{{ end }}}}"
    return f'{{{{ $prev := "" }}}}{loop}{tail}'


def stop_tokens(tokenizer: Any, fmt: ChatFormat | None, eos_ids: list[int]) -> list[str]:
    """Strings that end the assistant's turn: the EOS tokens and the special token closing an assistant turn."""
    stops: list[str] = []
    for index in eos_ids:
        text = tokenizer.convert_ids_to_tokens(index)
        if isinstance(text, str) and text not in stops:
            stops.append(text)
    if fmt is not None:
        closing = fmt.transitions.get(("assistant", "user"), "")
        specials = [token for token in tokenizer.all_special_tokens + list(_added_special(tokenizer)) if token]
        for token in specials:
            if closing.strip().startswith(token) and token not in stops:
                stops.append(token)
    return stops


def _added_special(tokenizer: Any) -> list[str]:
    return [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def modelfile(gguf_name: str, fmt: ChatFormat | None, stops: list[str]) -> str:
    lines = [f"FROM ./{gguf_name}", ""]
    template = go_template(fmt) if fmt is not None else ""
    if template and '"""' not in template:  # a template that would end the Modelfile's quoting is left out
        lines += [f'TEMPLATE """{template}"""', ""]
    lines += [f"PARAMETER stop {_quote(stop)}" for stop in stops]
    return "\n".join(lines) + "\n"
