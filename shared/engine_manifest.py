"""The engine manifest: what the operator says each engine is, which no hello can overrule.

Bus permissions prove an engine's *id* (`engine-<id>` may publish only under `<p>.engine.<id>.`), nothing else
a hello claims. So with one engine's password one could announce `role: "dp"` and a `base_url` of one's own and
take every client request of a disaggregated fleet. The manifest binds each listed engine's role, model, base
URL, EP group and DP rank (each optional: an absent field is not bound); the gateway, the router, placement,
migration and the API believe a hello only when it matches what its engine's entry lists, and a hello from an
engine the manifest does not list is refused. In strict mode (`SWITCHYARD_ENGINE_STRICT`, on by default with
per-role credentials) a process without a manifest holds an empty one: every engine is unlisted, so refused.

The file is JSON, `{engine_id: {"role", "model", "base_url", "ep_group", "dp_rank"}}`, as `switchyard
nats-config --engines` writes it (`SWITCHYARD_ENGINE_MANIFEST`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from switchyard.shared.schemas import Hello
from switchyard.shared.subjects import check_token

log = logging.getLogger(__name__)

#: Engine ids whose refusal is logged at most once each per manifest (ids are the senders' word: bounded).
MAX_LOGGED_IDS = 4096

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
        self._logged: set[str] = set()

    def refusal(self, hello: Hello) -> str | None:
        """Why `hello` is not believed (None: believed); the first refusal of each engine id is logged once."""
        entry = self.entries.get(hello.engine_id)
        reason = "unlisted" if entry is None else entry.refusal(hello)
        if reason is not None and hello.engine_id not in self._logged:
            self._note(hello.engine_id, reason)
        return reason

    def _note(self, engine_id: str, reason: str) -> None:
        """One warning per refused engine (later refusals are only counted by the caller)."""
        if len(self._logged) >= MAX_LOGGED_IDS:
            self._logged.clear()
        self._logged.add(engine_id)
        listed = "not listed" if reason == "unlisted" else f"claims another {reason} than listed"
        log.warning("engine %s refused: %s in the engine manifest (SWITCHYARD_ENGINE_MANIFEST)", engine_id, listed)

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

    Returns the engine ids and, when any engine is given, the manifest listing every one (an engine given as a
    bare `ID` is listed with nothing bound: a manifest, or strict mode, refuses engines it does not list)."""
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
    return ids, EngineManifest(entries) if entries else None


def partial_bindings(manifest: EngineManifest) -> list[str]:
    """Engines whose entry binds no role or no URL: a hello from them may still name any role or base URL
    (where clients' prompts go), so `nats-config` warns about each."""
    return [engine for engine, entry in manifest.entries.items() if entry.role is None or entry.base_url is None]


def write_listing(path: Path, engine_ids: list[str]) -> Path:
    """A manifest listing `engine_ids` with nothing bound: what `switchyard up` knows of the engines it starts or
    is told of, so that strict mode takes exactly those (on its embedded bus only they have credentials anyway)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(EngineManifest(dict.fromkeys(engine_ids, EngineEntry())).to_json() + "\n")
    return path
