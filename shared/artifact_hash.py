"""The content hash of a routing artifact: sha256 of what routing depends on, in its wire encoding.

It is part of the artifact's contract, not of the fit: the fit stamps it (`solver.eldr_fit`), routers and
the API recompute it to verify an artifact read from disk, the database or the bus (`services.artifacts`).
Version, creation time and the fit's figures (ρ) are left out: equal hashes route identically.
"""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np

from switchyard.shared.codec import array_to_wire
from switchyard.shared.schemas import ModelShape, RoutingArtifact


def content_hash(
    model: ModelShape,
    representation: str,
    layer_mask: list[int],
    idf: np.ndarray,
    centroids: np.ndarray,
    tau: float,
    decoder_ids: list[str] | None,
) -> str:
    """sha256 hex of the routing content: `idf[L', E]` and `centroids[K, L'·E]` as little-endian float32."""
    content = {
        "model": model.model_dump(),
        "representation": representation,
        "layer_mask": list(layer_mask),
        "idf": array_to_wire(np.asarray(idf, dtype="<f4")),
        "centroids": array_to_wire(np.asarray(centroids, dtype="<f4")),
        "tau": float(tau),
        "decoder_ids": decoder_ids,
    }
    return hashlib.sha256(msgpack.packb(content, use_bin_type=True)).hexdigest()


def artifact_content_hash(artifact: RoutingArtifact) -> str:
    """Recompute an artifact's hash from its content (to verify one read from disk or the bus)."""
    return content_hash(
        artifact.model,
        artifact.representation,
        artifact.layer_mask,
        artifact.idf,
        artifact.centroids,
        artifact.tau,
        artifact.decoder_ids,
    )
