"""Small builders shared by the ELDR tests (no fixtures: plain functions)."""

from __future__ import annotations

import numpy as np

from tests.conftest import SHIPPED_DATA

ESFT_DIR = SHIPPED_DATA / "routing" / "esft_deepseek_v2_lite"


def random_experts(rng: np.random.Generator, tokens: int, layers: int, experts: int, top_k: int) -> np.ndarray:
    """[tokens, layers, top_k] distinct expert ids per row (argsort of noise gives a random permutation)."""
    return np.argsort(rng.random((tokens, layers, experts)), axis=2)[:, :, :top_k].astype(np.int16)
