"""Signature representations: how raw per-(layer, expert) counts become the vector ELDR compares.

Candidates (the seed's §4.2, Fig. 7), each scored by ρ before one is chosen:

- ``count``: the prefill top-k counts `c(l, e)`;
- ``count_idf``: `c(l, e) · w(l, e)`, `w = log((|C| + 1) / (df(l, e) + 1))`, df = calibration requests that
  used expert e at layer l — generalists that fire for everyone are shrunk, specialists amplified;
- ``binary``: `1[c(l, e) > 0]`;
- ``gate_prob``: summed gate probabilities of the selected experts (only when the trace recorded them).

Whichever is chosen, the vector is the chosen layers' rows concatenated and L2-normalised, so similarity
reflects the shape of expert usage, not the prompt length. Only the first three can be computed from the
integer counts a prefill engine sends at handoff, so only they can be served (`ONLINE_REPRESENTATIONS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

__all__ = [
    "ONLINE_REPRESENTATIONS",
    "REPRESENTATIONS",
    "Representation",
    "cell_weights",
    "features",
    "idf_weights",
    "l2_normalise",
    "signature_vectors",
]

Representation = Literal["count", "count_idf", "binary", "gate_prob"]
REPRESENTATIONS: tuple[Representation, ...] = ("count", "count_idf", "binary", "gate_prob")
ONLINE_REPRESENTATIONS: tuple[Representation, ...] = ("count", "count_idf", "binary")


def idf_weights(counts: np.ndarray) -> np.ndarray:
    """IDF per (layer, expert) over a calibration set of counts [R, L, E] -> [L, E] float64."""
    if counts.ndim != 3 or counts.shape[0] == 0:
        raise ValueError(f"counts must be [requests, layers, experts] with at least one request, got {counts.shape}")
    df = np.count_nonzero(counts, axis=0)
    return np.log((counts.shape[0] + 1.0) / (df + 1.0))


def cell_weights(representation: Representation, idf: np.ndarray) -> np.ndarray:
    """The per-cell multiplier a representation applies after its transform: the IDF, or ones."""
    return idf if representation == "count_idf" else np.ones_like(idf)


def features(
    representation: Representation,
    prefill: np.ndarray,
    idf: np.ndarray | None = None,
    gate: np.ndarray | None = None,
) -> np.ndarray:
    """Unnormalised representation of counts [..., L, E] (float32, same shape)."""
    if representation == "count":
        return prefill.astype(np.float32)
    if representation == "count_idf":
        if idf is None:
            raise ValueError("count_idf needs IDF weights")
        return (prefill * idf).astype(np.float32)
    if representation == "binary":
        return (prefill > 0).astype(np.float32)
    if representation == "gate_prob":
        if gate is None:
            raise ValueError("gate_prob needs gate probabilities, which this trace did not record")
        return gate.astype(np.float32)
    raise ValueError(f"unknown representation {representation!r}; expected one of {REPRESENTATIONS}")


def l2_normalise(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm; an all-zero row stays zero (similarity 0 to everything)."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)


def signature_vectors(feature: np.ndarray, layer_mask: Sequence[int] | np.ndarray) -> np.ndarray:
    """Masked rows of [R, L, E] features, concatenated and L2-normalised -> [R, N·E] float32."""
    masked = feature[:, np.asarray(layer_mask, dtype=np.intp), :]
    return l2_normalise(masked.reshape(feature.shape[0], -1).astype(np.float32, copy=False))
