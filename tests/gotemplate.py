"""A small renderer for the subset of Helm's Go-template language that infra/helm/switchyard uses.

No helm binary can be installed here, so tests/test_deploy_material.py renders the chart with this. It is strict
where Helm is lenient: printing a value that is missing raises (Helm would print an empty string), so a typo in a
template or in values.yaml fails the test instead of rendering an empty field. Supported: `{{- ... -}}` trim
markers, comments, `.`, `$`, `$var.a.b`, `.Values.a.b`, string/number/bool literals, `(...)` sub-pipelines, `|`
pipes, `if`/`else`/`end`, `range $v := ...` and `range $k, $v := ...` (map keys sorted, as Go does),
`define`/`include`, and the functions `toYaml`, `nindent`, `indent`, `quote`, `default`, `not`, `eq`, `ne`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_ACTION = re.compile(r"\{\{(- )?(.*?)( -)?\}\}", re.DOTALL)


class TemplateError(ValueError):
    """A template the renderer cannot parse or evaluate (or one that prints a missing value)."""


@dataclass
class _Node:
    kind: str  # text, action, if, range, define
    text: str = ""
    body: list[_Node] = field(default_factory=list)
    orelse: list[_Node] = field(default_factory=list)


def _lex(source: str) -> list[tuple[str, str]]:
    """Text and action tokens, with the trim markers applied to the neighbouring text."""
    tokens: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(source):
        text = source[pos : m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        tokens.append(("text", text))
        tokens.append(("action", m.group(2).strip()))
        trim_next, pos = bool(m.group(3)), m.end()
    tail = source[pos:]
    tokens.append(("text", tail.lstrip() if trim_next else tail))
    return tokens


def _parse(tokens: list[tuple[str, str]]) -> tuple[list[_Node], dict[str, list[_Node]]]:
    defines: dict[str, list[_Node]] = {}
    root: list[_Node] = []
    stack: list[tuple[_Node | None, list[_Node]]] = [(None, root)]
    for kind, text in tokens:
        body = stack[-1][1]
        if kind == "text":
            if text:
                body.append(_Node("text", text))
            continue
        if text.startswith("/*"):
            continue
        word = text.split(None, 1)[0] if text else ""
        rest = text[len(word) :].strip()
        if word in ("if", "range", "define"):
            node = _Node(word, rest)
            body.append(node)
            stack.append((node, node.body))
        elif word == "else":
            node = stack[-1][0]
            if node is None or node.kind != "if":
                raise TemplateError("else outside if")
            stack[-1] = (node, node.orelse)
        elif word == "end":
            node, _ = stack.pop()
            if node is None:
                raise TemplateError("end without a block")
            if node.kind == "define":
                body_of_parent = stack[-1][1]
                body_of_parent.remove(node)
                defines[shlex.split(node.text)[0]] = node.body
        else:
            body.append(_Node("action", text))
    if len(stack) != 1:
        raise TemplateError(f"unclosed {stack[-1][0].kind if stack[-1][0] else 'block'}")
    return root, defines


def _split(text: str, sep: str) -> list[str]:
    """Split on `sep` outside quotes and parentheses."""
    parts, depth, quote, cur = [], 0, False, ""
    for ch in text:
        if ch == '"':
            quote = not quote
        elif not quote and ch == "(":
            depth += 1
        elif not quote and ch == ")":
            depth -= 1
        if ch == sep and depth == 0 and not quote:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()] if sep == " " else [p.strip() for p in parts]


def _truthy(value: Any) -> bool:
    return value not in (None, False, 0, "") and not (isinstance(value, (list, dict)) and not value)


def _to_text(value: Any) -> str:
    if value is None:
        raise TemplateError("a missing value is printed")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Renderer:
    """Renders templates that share one set of `define`s."""

    def __init__(self, defines: dict[str, list[_Node]]) -> None:
        self.defines = defines

    def _lookup(self, value: Any, path: str) -> Any:
        for key in [k for k in path.split(".") if k]:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def _term(self, term: str, dot: Any, scope: dict[str, Any]) -> Any:
        if term.startswith("(") and term.endswith(")"):
            return self._pipeline(term[1:-1], dot, scope)
        if term.startswith('"'):
            return term[1:-1].replace('\\"', '"')
        if term in ("true", "false"):
            return term == "true"
        if re.fullmatch(r"-?\d+", term):
            return int(term)
        if term.startswith("$"):
            name, _, path = term.partition(".")
            if name not in scope:
                raise TemplateError(f"undefined variable {name}")
            return self._lookup(scope[name], path)
        if term.startswith("."):
            return self._lookup(dot, term)
        raise TemplateError(f"cannot evaluate {term!r}")

    def _call(self, name: str, args: list[Any]) -> Any:
        if name == "include":
            return self._render(self.defines[args[0]], args[1], {"$": args[1]})
        if name == "toYaml":
            return yaml.safe_dump(args[0], default_flow_style=False, sort_keys=True).rstrip("\n")
        if name in ("nindent", "indent"):
            pad = " " * args[0]
            text = "\n".join(pad + line if line else line for line in _to_text(args[1]).split("\n"))
            return "\n" + text if name == "nindent" else text
        if name == "quote":
            return '"' + _to_text(args[0]).replace("\\", "\\\\").replace('"', '\\"') + '"'
        if name == "default":
            return args[1] if _truthy(args[1]) else args[0]
        if name == "not":
            return not _truthy(args[0])
        if name in ("eq", "ne"):
            return (args[0] == args[1]) == (name == "eq")
        raise TemplateError(f"unknown function {name}")

    def _pipeline(self, text: str, dot: Any, scope: dict[str, Any]) -> Any:
        value: Any = None
        for i, command in enumerate(_split(text, "|")):
            words = _split(command, " ")
            if re.fullmatch(r"[A-Za-z]\w*", words[0]) and words[0] not in ("true", "false"):
                args = [self._term(w, dot, scope) for w in words[1:]]
                value = self._call(words[0], [*args, value] if i else args)
            elif len(words) == 1 and i == 0:
                value = self._term(words[0], dot, scope)
            else:
                raise TemplateError(f"cannot evaluate {command!r}")
        return value

    def _render(self, nodes: list[_Node], dot: Any, scope: dict[str, Any]) -> str:
        out: list[str] = []
        for node in nodes:
            if node.kind == "text":
                out.append(node.text)
            elif node.kind == "action":
                out.append(_to_text(self._pipeline(node.text, dot, scope)))
            elif node.kind == "if":
                branch = node.body if _truthy(self._pipeline(node.text, dot, scope)) else node.orelse
                out.append(self._render(branch, dot, scope))
            elif node.kind == "range":
                out.append(self._range(node, dot, scope))
        return "".join(out)

    def _range(self, node: _Node, dot: Any, scope: dict[str, Any]) -> str:
        names, _, source = node.text.rpartition(":=")
        variables = [v.strip() for v in names.split(",") if v.strip()]
        items = self._pipeline(source if names else node.text, dot, scope)
        if items is None:
            return ""
        pairs = sorted(items.items()) if isinstance(items, dict) else list(enumerate(items))
        out = []
        for key, value in pairs:
            inner = dict(scope)
            if len(variables) == 2:
                inner[variables[0]], inner[variables[1]] = key, value
            elif variables:
                inner[variables[0]] = value
            out.append(self._render(node.body, value, inner))
        return "".join(out)

    def render(self, nodes: list[_Node], context: dict[str, Any]) -> str:
        return self._render(nodes, context, {"$": context})


def render_chart(chart_dir: Path, values: dict[str, Any], release: str = "switchyard") -> list[dict[str, Any]]:
    """Every object the chart's templates make with `values`, as parsed YAML documents."""
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    context = {
        "Values": values,
        "Release": {"Name": release, "Namespace": "default", "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart.get("appVersion")},
    }
    parsed, defines = {}, {}
    for path in sorted((chart_dir / "templates").iterdir()):
        parsed[path.name], found = _parse(_lex(path.read_text()))
        defines.update(found)
    renderer = Renderer(defines)
    objects = []
    for name, nodes in parsed.items():
        if name.startswith("_"):
            continue
        for document in re.split(r"^---\s*$", renderer.render(nodes, context), flags=re.MULTILINE):
            if document.strip():
                objects.append(yaml.safe_load(document))
    return objects
