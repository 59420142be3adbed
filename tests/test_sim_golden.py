"""Refactors of the simulator and the routing code must not move its figures: a fixed seed gives the recorded
numbers (`tests/golden/sim_fixed_seed.json`, written by `python -m tests.sim_fingerprint`)."""

from __future__ import annotations

import json

from tests.sim_fingerprint import GOLDEN, fingerprint


def _diff(want: object, got: object, path: str = "") -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}/{k}: missing" for k in want.keys() - got.keys()]
        out += [f"{path}/{k}: unexpected" for k in got.keys() - want.keys()]
        for k in want.keys() & got.keys():
            out += _diff(want[k], got[k], f"{path}/{k}")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (w, g) in enumerate(zip(want, got, strict=True)) for d in _diff(w, g, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: recorded {want!r}, now {got!r}"]


def test_fixed_seed_figures_are_unchanged() -> None:
    recorded = json.loads(GOLDEN.read_text())
    now = json.loads(json.dumps(fingerprint()))  # the same JSON round trip as the recording
    differences = _diff(recorded, now)
    assert not differences, f"{len(differences)} figures moved:\n" + "\n".join(sorted(differences)[:40])
