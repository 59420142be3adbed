"""A columnar view of the decode fleet that routing policies read.

Built once per change (telemetry, engine up/down, a routing decision's in-flight compensation), never per
request: a policy reads a few numpy arrays of length D and returns an index into them. Engines are kept in
sorted id order, which is also the order the ELDR centroid mapping uses when an artifact names no decoders.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from switchyard.shared.signals import need

__all__ = ["FleetSnapshot"]

#: The signals (`shared.signals`) the snapshot holds as attributes; any other is one of its `columns`.
_BASE = ("load", "kv_usage", "alive")
need(*_BASE)


@dataclass
class FleetSnapshot:
    """Decode engines as parallel arrays (index i ↔ `engine_ids[i]`, ids sorted).

    - `load`: running + waiting + in-flight compensation (requests routed to the engine that its telemetry
      does not show yet). Float so a router may add fractional compensation; the simulator keeps it exact.
    - `kv_usage`: fraction of KV blocks in use.
    - `alive`: the engine may receive requests (fresh telemetry, not draining).
    - `columns`: any further engine signal a routing part reads by name (e.g. Gimbal's ``remaining_prefill``;
      the names are the registry's, `shared.signals`), filled by the owner with only the columns its profile
      needs (`Profile.columns`).

    The arrays are owned by the snapshot and may be updated in place by its owner (the simulator bumps
    `load[i]` on each decision); policies only read them.
    """

    engine_ids: tuple[str, ...]
    load: np.ndarray
    kv_usage: np.ndarray
    alive: np.ndarray
    version: int = 0
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        d = len(self.engine_ids)
        if list(self.engine_ids) != sorted(self.engine_ids) or len(set(self.engine_ids)) != d:
            raise ValueError("engine_ids must be unique and sorted")
        for name in ("load", "kv_usage", "alive"):
            if getattr(self, name).shape != (d,):
                raise ValueError(f"{name} must have shape ({d},)")
        self._index = {e: i for i, e in enumerate(self.engine_ids)}

    @classmethod
    def build(
        cls,
        engine_ids: Iterable[str],
        load: Mapping[str, float] | None = None,
        kv_usage: Mapping[str, float] | None = None,
        alive: Mapping[str, bool] | None = None,
        version: int = 0,
    ) -> FleetSnapshot:
        """From per-engine mappings (missing entries: load 0, kv 0, alive)."""
        ids = tuple(sorted(engine_ids))
        load = load or {}
        kv_usage = kv_usage or {}
        alive = alive or {}
        return cls(
            engine_ids=ids,
            load=np.array([float(load.get(e, 0.0)) for e in ids], dtype=np.float64),
            kv_usage=np.array([float(kv_usage.get(e, 0.0)) for e in ids], dtype=np.float64),
            alive=np.array([bool(alive.get(e, True)) for e in ids], dtype=bool),
            version=version,
        )

    @classmethod
    def from_columns(
        cls,
        engine_ids: Sequence[str],
        load: np.ndarray,
        kv_usage: np.ndarray,
        alive: np.ndarray,
        version: int = 0,
    ) -> FleetSnapshot:
        """From columns in any row order (e.g. the router's registration-ordered fleet view, decode rows
        selected): one argsort, copies sorted by id. Decisions name engines by `engine_ids[i]`."""
        order = np.argsort(np.asarray(engine_ids, dtype=object), kind="stable")
        ids = tuple(engine_ids[i] for i in order)
        return cls(
            engine_ids=ids,
            load=np.asarray(load, dtype=np.float64)[order],
            kv_usage=np.asarray(kv_usage, dtype=np.float64)[order],
            alive=np.asarray(alive, dtype=bool)[order],
            version=version,
        )

    @property
    def size(self) -> int:
        return len(self.engine_ids)

    def index(self, engine_id: str) -> int:
        return self._index[engine_id]

    def column(self, name: str) -> np.ndarray:
        """An engine column by name: `load`, `kv_usage`, `alive`, or one of `columns`."""
        if name in _BASE:
            return getattr(self, name)
        try:
            return self.columns[name]
        except KeyError:
            raise KeyError(f"the snapshot has no column {name!r} (has: {', '.join([*_BASE, *self.columns])})") from None
