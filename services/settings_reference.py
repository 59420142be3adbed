"""The settings reference, read from the settings classes themselves, so the document cannot drift from the code.

Every `SWITCHYARD_*` variable is a field of a pydantic-settings class; its documentation is the `#:` comment
above the field (the house's convention) or, failing that, the field's `description`. `reference()` lists them
in a fixed order; `markdown()` renders them as `docs/settings.md`, which `switchyard settings --markdown` prints
and a test keeps equal to the file.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from pydantic import AliasChoices
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

__all__ = ["CLASSES", "Setting", "markdown", "reference"]

#: (module, class, what it configures), in the reference's order.
CLASSES: tuple[tuple[str, str, str], ...] = (
    ("switchyard.shared.settings", "SwitchyardSettings", "Every process: the bus, the database, the engine manifest"),
    ("switchyard.shared.liveness", "LivenessSettings", "When a silent engine counts as gone (every service)"),
    ("switchyard.services.lease", "LeaseSettings", "Leases of placement and migration replicas"),
    ("switchyard.services.gateway.settings", "GatewaySettings", "The gateway (`switchyard gateway`)"),
    (
        "switchyard.services.router.settings",
        "RouterSettings",
        "The router's core (`switchyard router`, and the gateway and endpoint picker deciding in-process)",
    ),
    ("switchyard.services.epp.settings", "EppSettings", "The endpoint picker (`switchyard epp`)"),
    ("switchyard.services.placement.settings", "PlacementSettings", "The placement service (`switchyard placement`)"),
    ("switchyard.services.migration.settings", "MigrationSettings", "The migration service (`switchyard migration`)"),
    ("switchyard.services.api.settings", "ApiSettings", "The history API (`switchyard api`)"),
    ("switchyard.engine_agents.vllm.config", "AgentSettings", "The vLLM agent, inside each vLLM engine"),
)


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name (and older names it still accepts), default and documentation."""

    env: str
    aliases: tuple[str, ...]
    type: str
    default: str
    doc: str


def _comments(cls: type) -> dict[str, str]:
    """Each field's `#:` comment block (the lines right above it), joined into one paragraph. A block documents the
    fields that follow it up to the next blank line or comment (`host` and `port` under one comment)."""
    fields = cls.model_fields  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    block: list[str] = []
    current = ""
    for line in inspect.getsource(cls).splitlines():
        text = line.strip()
        if text.startswith("#:"):
            block.append(text[2:].strip())
            continue
        if block:
            current, block = " ".join(block), []
        if not text or text.startswith("#"):
            current = ""
            continue
        name = text.split(":", 1)[0]
        if ":" in text and name.isidentifier() and name in fields and current:
            docs[name] = current
    return docs


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "").replace("pathlib.", "")
    return text.replace("NoneType", "None")


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if value != field.default_factory():  # a fresh one per process (an id)
            return "(generated at start)"
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple, dict)) and not value:
        return "empty"
    return str(value)


def _names(cls: type[BaseSettings], name: str, field: Any) -> tuple[str, tuple[str, ...]]:
    """The variable a field reads, and any older names it still accepts (an `AliasChoices`)."""
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):  # environment names only (a lowercase choice serves keyword arguments)
        names = [str(a).upper() for a in alias.choices if str(a).upper().startswith("SWITCHYARD_")]
        return names[0], tuple(names[1:])
    if isinstance(alias, str):
        return alias.upper(), ()
    return f"{cls.model_config.get('env_prefix', '')}{name}".upper(), ()


def reference() -> list[tuple[str, str, list[Setting]]]:
    """(class name, what it configures, its settings) for every settings class, fields in declaration order."""
    out = []
    for module, class_name, what in CLASSES:
        cls = getattr(importlib.import_module(module), class_name)
        comments = _comments(cls)
        settings = []
        for name, field in cls.model_fields.items():
            env, aliases = _names(cls, name, field)
            doc = comments.get(name) or field.description or ""
            settings.append(Setting(env, aliases, _type_name(field.annotation), _default(field), doc))
        out.append((class_name, what, settings))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """`docs/settings.md`: one table per settings class."""
    lines = [
        "# Settings reference",
        "",
        "Every setting is an environment variable (or a line of a `.env` file in the working folder). This page is",
        "generated from the settings classes (`switchyard settings --markdown > docs/settings.md`; a test keeps it",
        "equal to the code): each row's text is the comment above the field in the source.",
        "",
    ]
    for class_name, what, settings in reference():
        lines += [f"## {what}", "", f"`{class_name}`", "", "| variable | default | what it does |", "|---|---|---|"]
        first = None  # the first setting of a group documented by one comment
        for i, s in enumerate(settings):
            name = f"`{s.env}`" + "".join(f" (or `{a}`)" for a in s.aliases)
            grouped = i > 0 and s.doc and s.doc == settings[i - 1].doc
            first = first if grouped else s
            doc = f"with `{first.env}`, above" if grouped else _cell(s.doc) or "—"
            lines.append(f"| {name} | `{_cell(s.default)}` | {doc} |")
        lines.append("")
    return "\n".join(lines)
