"""Online ELDR scoring: a request's prefill counts -> similarity to every decoder's centroid (the seed's §4.3).

The τ-band and the least-loaded pick are the ELDR profile of `solver.routing.profiles` (its fused kernel:
`solver.routing.eldr_kernel`), shared by the router service and the simulator; this module only turns signatures
into similarities.

Everything that depends only on the routing artifact is prepared once in a `SignatureScorer` (mask as an index
array, per-cell weights flattened, centroids contiguous float32), so a decision is a gather, a multiply,
one [K, D] × [D] product. The router service and the simulator both call it.

Similarity is cosine: sims = C · (w ⊙ c) / |w ⊙ c| with C the unit centroids, c the masked counts (or
their indicator, for the binary representation) and w the artifact's per-cell weights (IDF or ones).
A request with no masked activity has similarity 0 to every centroid, so its band is every decoder and
the least-loaded one wins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from switchyard.shared.schemas import RoutingArtifact
from switchyard.solver.representations import ONLINE_REPRESENTATIONS
from switchyard.solver.routing.defaults import DEFAULT_TAU

__all__ = ["ScoringError", "SignatureScorer"]


class ScoringError(ValueError):
    """A signature, load vector or availability mask that does not fit the artifact."""


def _check_counts(counts: np.ndarray) -> None:
    if counts.dtype.kind not in "iu":
        raise ScoringError(f"signature counts must be integers, got dtype {counts.dtype}")
    if counts.dtype.kind == "i" and counts.size and counts.min() < 0:
        raise ScoringError("signature counts must be non-negative")


class SignatureScorer:
    """The per-artifact state of online scoring; immutable after construction, safe to share."""

    def __init__(
        self,
        layer_mask: Sequence[int],
        weights: np.ndarray,
        centroids: np.ndarray,
        *,
        num_layers: int,
        tau: float = DEFAULT_TAU,
        representation: str = "count_idf",
    ) -> None:
        if representation not in ONLINE_REPRESENTATIONS:
            raise ScoringError(
                f"representation {representation!r} cannot be scored from counts {ONLINE_REPRESENTATIONS}"
            )
        mask = np.asarray(layer_mask, dtype=np.intp)
        if mask.ndim != 1 or mask.size == 0 or mask.min() < 0 or mask.max() >= num_layers:
            raise ScoringError(f"layer mask must name layers in [0, {num_layers})")
        weights = np.asarray(weights, dtype=np.float32)
        if weights.ndim != 2 or weights.shape[0] != mask.size:
            raise ScoringError(f"weights must be [{mask.size}, E], got {list(weights.shape)}")
        centroids = np.asarray(centroids, dtype=np.float32)
        if centroids.ndim != 2 or centroids.shape[1] != weights.size:
            raise ScoringError(f"centroids must be [K, {weights.size}], got {list(centroids.shape)}")
        if not 0.0 <= tau <= 2.0:
            raise ScoringError(f"tau must lie in [0, 2], got {tau}")
        self.num_layers = num_layers
        self.num_experts = int(weights.shape[1])
        self.num_decoders = int(centroids.shape[0])
        self.tau = float(tau)
        self.representation = representation
        self.layer_mask = mask
        self._mask_list = mask.tolist()
        # Flat positions of the masked cells in a full [num_layers, E] signature: one take() selects them.
        experts = int(weights.shape[1])
        self._full_cells = (mask[:, None] * experts + np.arange(experts)).ravel()
        self._binary = representation == "binary"
        self._weights = None if np.all(weights == 1.0) else np.ascontiguousarray(weights.ravel())
        norms = np.linalg.norm(centroids, axis=1, keepdims=True)
        self._centroids = np.ascontiguousarray(
            np.divide(centroids, norms, out=np.zeros_like(centroids), where=norms > 0)
        )

    @classmethod
    def from_artifact(cls, artifact: RoutingArtifact) -> SignatureScorer:
        return cls(
            artifact.layer_mask,
            artifact.idf,
            artifact.centroids,
            num_layers=artifact.model.num_layers,
            tau=artifact.tau,
            representation=artifact.representation,
        )

    # ----- signature -> vector -----

    def _row_index(self, rows: int, layers: Sequence[int] | None) -> np.ndarray | None:
        """Which rows of a signature whose rows are `layers` (None: all model layers) are the masked layers;
        None when the signature already is exactly the masked layers in order."""
        if layers is None:
            if rows != self.num_layers:
                raise ScoringError(f"signature has {rows} rows; without `layers` it needs {self.num_layers}")
            return self.layer_mask
        if list(layers) == self._mask_list:
            return None
        if len(layers) != rows:
            raise ScoringError(f"{len(layers)} layers listed for a signature of {rows} rows")
        listed = np.asarray(layers, dtype=np.intp)
        if listed.size and (listed.min() < 0 or listed.max() >= self.num_layers):
            raise ScoringError(f"signature layers must lie in [0, {self.num_layers})")
        position = np.full(self.num_layers, -1, dtype=np.intp)
        position[listed] = np.arange(listed.size)
        index = position[self.layer_mask]
        if (index < 0).any():
            raise ScoringError(f"signature lacks the artifact's masked layers {self.layer_mask[index < 0].tolist()}")
        return index

    def _weighted(self, rows: np.ndarray) -> np.ndarray:
        """[..., N, E] masked counts -> [..., N·E] float32 representation vectors (unnormalised)."""
        flat = rows.reshape(*rows.shape[:-2], -1) if rows.ndim > 2 else rows.reshape(-1)
        vectors = (flat > 0).astype(np.float32) if self._binary else flat.astype(np.float32)
        if self._weights is not None:
            vectors *= self._weights
        return vectors

    def vector(self, counts: np.ndarray, layers: Sequence[int] | None = None) -> np.ndarray:
        """The weighted, unnormalised signature vector [N·E] float32 of one request's prefill counts."""
        counts = np.asarray(counts)
        if counts.ndim != 2 or counts.shape[1] != self.num_experts:
            raise ScoringError(f"signature must be [layers, {self.num_experts}], got {list(counts.shape)}")
        if counts.dtype.kind != "u":  # unsigned counts need no further check
            _check_counts(counts)
        if layers is None and counts.shape[0] == self.num_layers:  # the full signature: the common case
            cells = counts.take(self._full_cells)
            vector = (cells > 0).astype(np.float32) if self._binary else cells.astype(np.float32)
            if self._weights is not None:
                vector *= self._weights
            return vector
        index = self._row_index(counts.shape[0], layers)
        return self._weighted(counts if index is None else counts.take(index, axis=0))

    # ----- similarities, band, pick -----

    def similarities(self, counts: np.ndarray, layers: Sequence[int] | None = None) -> np.ndarray:
        """Cosine similarity of a request's signature to every centroid, [K] float32."""
        vector = self.vector(counts, layers)
        # ndarray.dot goes straight to BLAS; `@` and np.dot take longer routes to the same call.
        raw = self._centroids.dot(vector)
        norm = math.sqrt(vector.dot(vector))
        if norm > 0:
            raw /= norm
        return raw

    def similarities_batch(self, counts: np.ndarray, layers: Sequence[int] | None = None) -> np.ndarray:
        """Similarities of many signatures [B, layers, E] at once -> [B, K] (for the simulator)."""
        counts = np.asarray(counts)
        if counts.ndim != 3 or counts.shape[2] != self.num_experts:
            raise ScoringError(f"batch must be [B, layers, {self.num_experts}], got {list(counts.shape)}")
        _check_counts(counts)
        index = self._row_index(counts.shape[1], layers)
        vectors = self._weighted(counts if index is None else counts[:, index])
        norms = np.sqrt(np.einsum("bd,bd->b", vectors, vectors))[:, None]
        out = np.zeros((counts.shape[0], self.num_decoders), dtype=np.float32)
        return np.divide(vectors @ self._centroids.T, norms, out=out, where=norms > 0)
