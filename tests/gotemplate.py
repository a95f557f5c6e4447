"""A small renderer for the subset of Go's text/template that Ollama Modelfile templates use.

Enough to check a TEMPLATE against the tokenizer's chat template: text, ``{{ .Field }}``, string literals,
``{{ $v := ... }}`` / ``{{ $v = ... }}``, ``range``, ``if`` / ``else if`` / ``else`` / ``end``, and the functions
``eq``, ``ne``, ``and``, ``or``, ``not``. Anything else is an error, so a template outside the subset fails loudly.
"""

from __future__ import annotations

import json
import re
from typing import Any

ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
TOKEN = re.compile(r'\(|\)|"(?:[^"\\]|\\.)*"|[^\s()]+')
FUNCS = {
    "eq": lambda a, *b: any(a == x for x in b),
    "ne": lambda a, b: a != b,
    "and": lambda *a: all(a),
    "or": lambda *a: any(a),
    "not": lambda a: not a,
}


def _parse(source: str) -> list[Any]:
    """Nodes: ("text", s) | ("out", expr) | ("set", var, expr) | ("range", expr, body) | ("if", [(c, body)], else)."""
    pieces: list[tuple[str, str]] = []
    position = 0
    for match in ACTION.finditer(source):
        if "{{-" in match.group(0) or "-}}" in match.group(0):
            raise ValueError("whitespace trimming is outside the subset")
        pieces.append(("text", source[position : match.start()]))
        pieces.append(("action", match.group(1)))
        position = match.end()
    pieces.append(("text", source[position:]))
    nodes, rest = _block(pieces, 0)
    if rest != len(pieces):
        raise ValueError("unbalanced {{ end }}")
    return nodes


def _block(pieces: list[tuple[str, str]], index: int) -> tuple[list[Any], int]:
    nodes: list[Any] = []
    while index < len(pieces):
        kind, text = pieces[index]
        if kind == "text":
            nodes.append(("text", text))
            index += 1
            continue
        if text == "end" or text == "else" or text.startswith("else if "):
            return nodes, index
        if text.startswith("range "):
            body, index = _block(pieces, index + 1)
            nodes.append(("range", text[6:], body))
            index = _expect_end(pieces, index)
        elif text.startswith("if "):
            node, index = _if(pieces, index)
            nodes.append(node)
        elif m := re.fullmatch(r"(\$\w+)\s*:?=\s*(.+)", text, re.S):
            nodes.append(("set", m.group(1), m.group(2)))
            index += 1
        else:
            nodes.append(("out", text))
            index += 1
    return nodes, index


def _if(pieces: list[tuple[str, str]], index: int) -> tuple[Any, int]:
    branches, otherwise = [], []
    condition = pieces[index][1][3:]
    while True:
        body, index = _block(pieces, index + 1)
        branches.append((condition, body))
        if index >= len(pieces):
            raise ValueError("missing {{ end }}")
        text = pieces[index][1]
        if text.startswith("else if "):
            condition = text[8:]
            continue
        if text == "else":
            otherwise, index = _block(pieces, index + 1)
        return ("if", branches, otherwise), _expect_end(pieces, index)


def _expect_end(pieces: list[tuple[str, str]], index: int) -> int:
    if index >= len(pieces) or pieces[index][1] != "end":
        raise ValueError("missing {{ end }}")
    return index + 1


def _eval(expr: str, dot: Any, scope: dict[str, Any]) -> Any:
    tokens = TOKEN.findall(expr)
    value, used = _call(tokens, 0, dot, scope)
    if used != len(tokens):
        raise ValueError(f"cannot evaluate {expr!r}")
    return value


def _term(tokens: list[str], i: int, dot: Any, scope: dict[str, Any]) -> tuple[Any, int]:
    token = tokens[i]
    if token == "(":
        value, i = _call(tokens, i + 1, dot, scope)
        if tokens[i] != ")":
            raise ValueError("missing )")
        return value, i + 1
    if token.startswith('"'):
        return json.loads(token), i + 1
    if token.startswith("$"):
        return scope[token], i + 1
    if token.startswith("."):
        return (dot if isinstance(dot, dict) else {})[token[1:]], i + 1
    raise ValueError(f"unknown term {token!r}")


def _call(tokens: list[str], i: int, dot: Any, scope: dict[str, Any]) -> tuple[Any, int]:
    if tokens[i] in FUNCS:
        name, args = tokens[i], []
        i += 1
        while i < len(tokens) and tokens[i] != ")":
            value, i = _term(tokens, i, dot, scope)
            args.append(value)
        return FUNCS[name](*args), i
    return _term(tokens, i, dot, scope)


def _run(nodes: list[Any], dot: Any, scope: dict[str, Any], out: list[str]) -> None:
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "out":
            out.append(str(_eval(node[1], dot, scope)))
        elif node[0] == "set":
            scope[node[1]] = _eval(node[2], dot, scope)
        elif node[0] == "range":
            for item in _eval(node[1], dot, scope):
                _run(node[2], item, scope, out)
        else:
            for condition, body in node[1]:
                if _eval(condition, dot, scope):
                    _run(body, dot, scope, out)
                    break
            else:
                _run(node[2], dot, scope, out)


def render(template: str, messages: list[dict[str, str]]) -> str:
    """Render ``template`` the way Ollama does for a chat: ``.Messages`` with ``.Role`` and ``.Content``."""
    out: list[str] = []
    items = [{key.capitalize(): value for key, value in message.items()} for message in messages]
    _run(_parse(template), {"Messages": items}, {}, out)
    return "".join(out)
