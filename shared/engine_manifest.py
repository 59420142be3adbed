"""The engine manifest: what the operator says each engine is, which no hello can overrule.

Bus permissions prove an engine's *id* (`engine-<id>` may publish only under `<p>.engine.<id>.`), nothing else
a hello claims. So with one engine's password one could announce `role: "dp"` and a `base_url` of one's own and
take every client request of a disaggregated fleet. The manifest binds each listed engine's role, model, base
URL, EP group and DP rank (each optional: an absent field is not bound); the gateway, the router, placement,
migration and the API believe a hello only when it matches what its engine's entry lists, and a hello from an
engine the manifest does not list is refused.

The file is JSON, `{engine_id: {"role", "model", "base_url", "ep_group", "dp_rank"}}`, as `switchyard
nats-config --engines` writes it (`SWITCHYARD_ENGINE_MANIFEST`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from switchyard.shared.schemas import Hello
from switchyard.shared.subjects import check_token

#: Why a hello was refused, as counted (`reason` label): one value per bound field, and `unlisted`.
REFUSALS = ("unlisted", "role", "model", "base_url", "ep_group", "dp_rank")


def same_url(a: str, b: str) -> bool:
    """Base URLs compare without a trailing slash (`http://h:8000/` is `http://h:8000`)."""
    return a.rstrip("/") == b.rstrip("/")


class EngineEntry(BaseModel):
    """What one engine is. A field left out is the engine's own word."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["prefill", "decode", "dp"] | None = None
    model: str | None = None
    base_url: str | None = None
    ep_group: str | None = None
    dp_rank: int | None = None

    @model_validator(mode="after")
    def _rank_needs_group(self) -> EngineEntry:
        # A listed group binds rank 0 unless a rank is given (the manifest's first form had both or neither).
        if self.ep_group is not None and self.dp_rank is None:
            object.__setattr__(self, "dp_rank", 0)
        return self

    def refusal(self, hello: Hello) -> str | None:
        """The first field the hello claims otherwise than listed, or None when it matches."""
        if self.role is not None and hello.role != self.role:
            return "role"
        if self.model is not None and hello.model.name != self.model:
            return "model"
        if self.base_url is not None and (hello.base_url is None or not same_url(hello.base_url, self.base_url)):
            return "base_url"
        if self.ep_group is not None and hello.ep_group != self.ep_group:
            return "ep_group"
        if self.dp_rank is not None and hello.dp_rank != self.dp_rank:
            return "dp_rank"
        return None


class EngineManifest:
    """Engine id -> its entry; `refusal(hello)` says why a hello is not to be believed."""

    def __init__(self, entries: dict[str, EngineEntry]) -> None:
        self.entries = entries

    def refusal(self, hello: Hello) -> str | None:
        entry = self.entries.get(hello.engine_id)
        if entry is None:
            return "unlisted"
        return entry.refusal(hello)

    @classmethod
    def parse(cls, raw: object, source: str = "engine manifest") -> EngineManifest:
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: expected {{engine_id: {{role, model, base_url, ep_group, dp_rank}}}}")
        try:
            return cls({str(engine): EngineEntry.model_validate(entry) for engine, entry in raw.items()})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{source}: {where}: {first['msg']}") from None

    @classmethod
    def load(cls, path: Path) -> EngineManifest:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"SWITCHYARD_ENGINE_MANIFEST {path}: {exc}") from None
        return cls.parse(raw, f"SWITCHYARD_ENGINE_MANIFEST {path}")

    def to_json(self) -> str:
        return json.dumps({e: entry.model_dump(exclude_none=True) for e, entry in self.entries.items()}, indent=2)


_SPEC = re.compile(
    r"(?P<id>[^:]+)"
    r"(?::(?P<role>prefill|decode|dp):(?P<url>https?://.+?))?"
    r"(?::(?P<group>[^:/]+):(?P<rank>\d+))?"
)


def parse_engine_specs(text: str) -> tuple[list[str], EngineManifest | None]:
    """`nats-config --engines`: comma-separated `ID`, `ID:GROUP:RANK`, `ID:ROLE:URL` or `ID:ROLE:URL:GROUP:RANK`.

    Returns the engine ids and, when any spec binds something, the manifest listing every engine (an engine
    given as a bare `ID` is listed with nothing bound: a manifest refuses engines it does not list)."""
    ids: list[str] = []
    entries: dict[str, EngineEntry] = {}
    for spec in (s.strip() for s in text.split(",")):
        if not spec:
            continue
        match = _SPEC.fullmatch(spec)
        if match is None:
            raise ValueError(f"{spec!r}: expected ID, ID:EP_GROUP:DP_RANK, ID:ROLE:URL or ID:ROLE:URL:EP_GROUP:DP_RANK")
        engine = check_token(match["id"], "engine id")
        group = check_token(match["group"], "EP group") if match["group"] else None
        entry = EngineEntry(
            role=match["role"],  # type: ignore[arg-type]  # the pattern admits only the three roles
            base_url=match["url"],
            ep_group=group,
            dp_rank=int(match["rank"]) if match["rank"] else None,
        )
        if engine in entries:
            raise ValueError(f"{spec!r}: engine {engine} given twice")
        ids.append(engine)
        entries[engine] = entry
    bound = any(entry != EngineEntry() for entry in entries.values())
    return ids, EngineManifest(entries) if bound else None
