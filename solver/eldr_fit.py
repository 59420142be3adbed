"""The ELDR offline fit: calibration requests -> routing artifact, plus a report of every figure it chose by.

Steps (the seed's §4.2-4.3; every choice is made by ρ, none by serving the system):

1. counts: per request prefill counts c[L, E] and decode pattern p[L, E]; requests lacking either are dropped;
2. split the requests into a search set and a held-out set (the held-out set only reports);
3. ρ of every representation with all layers (count, count·IDF, binary, gate-prob when recorded);
   pick the best one that can be computed online from integer counts;
4. greedy layer search for that representation; the mask is the peak of ρ(n);
5. balanced spherical K-means of all requests' signatures, one centroid per decoder;
6. the artifact: mask, per-cell weights (IDF or ones), centroids, τ, model shape, ρ, content hash.

Version and persistence are not decided here (see `services/artifacts.py`): the fit is a pure function.
The content hash is the artifact contract's (`shared.artifact_hash`), as is its wire encoding.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from switchyard.shared.artifact_hash import content_hash
from switchyard.shared.routing_trace import RoutingTrace
from switchyard.shared.schemas import ModelShape, RoutingArtifact
from switchyard.solver.representations import (
    ONLINE_REPRESENTATIONS,
    REPRESENTATIONS,
    Representation,
    cell_weights,
    features,
    idf_weights,
    signature_vectors,
)
from switchyard.solver.routing.defaults import DEFAULT_TAU  # re-exported: its one owner is solver.routing.defaults
from switchyard.solver.signatures import RequestCounts, request_counts

if TYPE_CHECKING:
    from switchyard.solver.rho import LayerSearch

__all__ = ["DEFAULT_TAU", "FitError", "FitOptions", "fit_routing_artifact"]


class FitError(ValueError):
    """The calibration set or the options cannot produce an artifact (too few requests, bad mask...)."""


@dataclass(frozen=True)
class FitOptions:
    """Knobs of the fit; the defaults are the seed's choices where it states one."""

    tau: float = DEFAULT_TAU
    #: "auto": the online-servable representation with the highest ρ; or force one.
    representation: Literal["auto", "count", "count_idf", "binary"] = "auto"
    #: A fixed layer mask (model layer indices) instead of the greedy search.
    layer_mask: tuple[int, ...] | None = None
    #: Take the smallest mask whose ρ is within this of the peak (0: the peak itself).
    mask_tolerance: float = 0.0
    #: Pairs for ρ: all when R(R-1)/2 <= max_pairs, else this many drawn at random.
    max_pairs: int = 5_000
    #: Share of requests held out of the representation/mask choice, to report ρ on unseen requests.
    holdout_fraction: float = 0.2
    balanced: bool = True
    restarts: int = 3
    max_iter: int = 50
    seed: int = 0
    #: Also cluster with vanilla K-means and report its cluster sizes (the seed's Fig. 15 ablation).
    compare_vanilla: bool = False


def _split(num_requests: int, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Search and held-out request indices; no held-out set when either side would have < 3 requests."""
    held = round(num_requests * fraction)
    order = rng.permutation(num_requests)
    if held < 3 or num_requests - held < 3:
        return np.sort(order), np.empty(0, dtype=np.int64)
    return np.sort(order[held:]), np.sort(order[:held])


def _finite(value: float | None) -> float | None:
    return None if value is None or not np.isfinite(value) else float(value)


def _check(options: FitOptions, decoders: int, counts: RequestCounts) -> None:
    if not 0.0 <= options.tau <= 2.0:
        raise FitError(f"tau must lie in [0, 2] (cosine similarities differ by at most 2), got {options.tau}")
    if options.representation != "auto" and options.representation not in ONLINE_REPRESENTATIONS:
        raise FitError(f"representation must be auto or one of {ONLINE_REPRESENTATIONS}, got {options.representation}")
    if not 0.0 <= options.holdout_fraction < 1.0:
        raise FitError(f"holdout fraction must lie in [0, 1), got {options.holdout_fraction}")
    if options.mask_tolerance < 0:
        raise FitError(f"mask tolerance must be non-negative, got {options.mask_tolerance}")
    if options.max_pairs < 3:
        raise FitError(f"max_pairs must be at least 3, got {options.max_pairs}")
    if options.layer_mask is not None:
        mask = options.layer_mask
        if not mask or len(set(mask)) != len(mask) or min(mask) < 0 or max(mask) >= counts.num_layers:
            raise FitError(f"layer mask must list distinct layers in [0, {counts.num_layers}), got {list(mask)}")
    if decoders < 1:
        raise FitError(f"need at least one decoder, got {decoders}")


def _usable_counts(
    data: RoutingTrace | RequestCounts, decoders: int, options: FitOptions, decoder_ids: list[str] | None
) -> tuple[RequestCounts, int]:
    """The calibration requests with both prefill and decode tokens (checked against the options), and how
    many were dropped for lacking either."""
    counts = request_counts(data) if isinstance(data, RoutingTrace) else data
    _check(options, decoders, counts)
    usable = (counts.prefill_tokens > 0) & (counts.decode_tokens > 0)
    dropped = int((~usable).sum())
    counts = counts.subset(usable) if dropped else counts
    if counts.num_requests < max(3, decoders):
        raise FitError(
            f"{counts.num_requests} usable calibration requests (with prefill and decode tokens) "
            f"for {decoders} decoders: need at least max(3, decoders)"
        )
    if decoder_ids is not None and len(decoder_ids) != decoders:
        raise FitError(f"{len(decoder_ids)} decoder ids for {decoders} decoders")
    return counts, dropped


def _choose_representation(options: FitOptions, rho_all: dict[Representation, float]) -> Representation:
    """The forced representation, or (auto) the online-servable one with the highest ρ; ρ must be defined."""
    online = [r for r in ONLINE_REPRESENTATIONS if np.isfinite(rho_all[r])]
    if not online:
        raise FitError("ρ is undefined for every representation: all signatures or decode patterns are identical")
    chosen: Representation = (
        max(online, key=lambda r: rho_all[r]) if options.representation == "auto" else options.representation
    )
    if not np.isfinite(rho_all[chosen]):
        raise FitError(f"ρ is undefined for {chosen}: its signatures are all identical (or all zero)")
    return chosen


def _model_shape(counts: RequestCounts) -> ModelShape:
    return ModelShape(
        name=counts.model_name[:128] or "unknown",
        num_layers=counts.num_layers,
        num_experts=counts.num_experts,
        top_k=counts.top_k,
    )


def _label_mix(counts: RequestCounts, labels: np.ndarray, decoders: int) -> dict[str, Any] | None:
    """Per cluster, how many calibration requests of each domain label (the trace's, for reports) it holds."""
    if counts.label is None:
        return None
    width = int(counts.label.max()) + 1 if counts.label_names is None else len(counts.label_names)
    mix = np.zeros((decoders, width), dtype=np.int64)
    np.add.at(mix, (labels, counts.label), 1)
    return {"label_names": list(counts.label_names or map(str, range(width))), "per_cluster": mix.tolist()}


def _band_sizes(signatures: np.ndarray, centroids: np.ndarray, tau: float) -> np.ndarray:
    """How selective τ is: decoders within τ of each calibration request's best similarity."""
    similarity = signatures @ centroids.T
    return (similarity >= similarity.max(axis=1, keepdims=True) - tau).sum(axis=1)


def fit_routing_artifact(
    data: RoutingTrace | RequestCounts,
    decoders: int,
    options: FitOptions | None = None,
    *,
    decoder_ids: list[str] | None = None,
    created_at: float | None = None,
) -> tuple[RoutingArtifact, dict[str, Any]]:
    """Fit one centroid per decoder from calibration requests; returns the artifact (version 1: the caller
    that persists it assigns the real version) and a JSON-ready report."""
    # SciPy (k-means' assignment, rho's rank statistics) costs seconds to import: imported here, by the fit
    # alone, so that importing this module (for `FitOptions`, `FitError`) stays cheap.
    from switchyard.solver.kmeans import spherical_kmeans
    from switchyard.solver.rho import (
        calibration_pairs,
        decode_target,
        greedy_layer_search,
        pair_cosine_distances,
        rho,
        rho_along,
        rho_of_distances,
        rho_sampling_error,
    )

    options = options or FitOptions()
    clock = time.perf_counter
    start = clock()
    timings: dict[str, float] = {}

    counts, dropped = _usable_counts(data, decoders, options, decoder_ids)
    timings["counts"] = clock() - start

    # --- ρ of every representation, all layers ---
    t = clock()
    rng = np.random.default_rng(options.seed)
    search, held = _split(counts.num_requests, options.holdout_fraction, rng)
    idf = idf_weights(counts.prefill)
    candidates = [r for r in REPRESENTATIONS if r != "gate_prob" or counts.prefill_gate is not None]
    feats = {r: features(r, counts.prefill, idf, counts.prefill_gate) for r in candidates}
    target = decode_target(counts.decode[search], calibration_pairs(search.size, options.max_pairs, options.seed))
    held_target = None
    if held.size:
        held_target = decode_target(counts.decode[held], calibration_pairs(held.size, options.max_pairs, options.seed))
    distances = {r: pair_cosine_distances(f[search], target.pairs) for r, f in feats.items()}
    rho_all = {r: rho_of_distances(d, target) for r, d in distances.items()}
    rho_error = {r: _finite(rho_sampling_error(d, target, seed=options.seed)) for r, d in distances.items()}
    rho_held = {r: rho(f[held], held_target) for r, f in feats.items()} if held_target else None
    chosen = _choose_representation(options, rho_all)
    timings["rho_representations"] = clock() - t

    # --- layer mask ---
    t = clock()
    feature = feats[chosen]
    search_result: LayerSearch | None = None
    if options.layer_mask is None:
        search_result = greedy_layer_search(feature[search], target)
        mask = search_result.mask(options.mask_tolerance)
    else:
        mask = np.array(sorted(options.layer_mask))
    rho_selected = rho(signature_vectors(feature[search], mask), target)
    rho_selected_held = rho(signature_vectors(feature[held], mask), held_target) if held_target else None
    curve_held = rho_along(feature[held], held_target, search_result.order) if held_target and search_result else None
    timings["layer_search"] = clock() - t

    # --- clustering ---
    t = clock()
    signatures = signature_vectors(feature, mask)
    clustering = spherical_kmeans(
        signatures,
        decoders,
        balanced=options.balanced,
        restarts=options.restarts,
        max_iter=options.max_iter,
        seed=options.seed,
    )
    timings["kmeans"] = clock() - t
    vanilla_sizes = None
    if options.compare_vanilla:
        vanilla = spherical_kmeans(signatures, decoders, balanced=False, restarts=options.restarts, seed=options.seed)
        vanilla_sizes = vanilla.sizes.tolist()

    # --- artifact ---
    model = _model_shape(counts)
    weights = cell_weights(chosen, idf)[mask].astype(np.float32)
    centroids = clustering.centroids.astype(np.float32)
    layer_mask = [int(layer) for layer in mask]
    artifact = RoutingArtifact(
        version=1,
        content_hash=content_hash(model, chosen, layer_mask, weights, centroids, options.tau, decoder_ids),
        created_at=time.time() if created_at is None else created_at,
        model=model,
        representation=chosen,
        layer_mask=layer_mask,
        idf=weights,
        centroids=centroids,
        tau=options.tau,
        rho=float(np.clip(np.nan_to_num(rho_selected), -1.0, 1.0)),
        decoder_ids=decoder_ids,
        num_calibration=counts.num_requests,
    )
    timings["total"] = clock() - start

    band_sizes = _band_sizes(signatures, clustering.centroids, options.tau)

    label_mix = _label_mix(counts, clustering.labels, decoders)

    report: dict[str, Any] = {
        "model": model.model_dump(),
        "num_requests": counts.num_requests,
        "dropped_requests": dropped,
        "num_search": int(search.size),
        "num_holdout": int(held.size),
        "pairs": {
            "search": target.pairs.size,
            "search_all_pairs": target.pairs.total,
            "exhaustive": target.pairs.exhaustive,
            "holdout": held_target.pairs.size if held_target else 0,
        },
        "rho": {r: _finite(v) for r, v in rho_all.items()},
        "rho_sampling_error": rho_error,
        "rho_holdout": {r: _finite(v) for r, v in rho_held.items()} if rho_held else None,
        "representation": chosen,
        "layer_order": search_result.order.tolist() if search_result else None,
        "rho_by_num_layers": [_finite(v) for v in search_result.rho] if search_result else None,
        "rho_by_num_layers_holdout": [_finite(v) for v in curve_held] if curve_held is not None else None,
        "layer_mask": layer_mask,
        "rho_selected": _finite(rho_selected),
        "rho_selected_holdout": _finite(rho_selected_held),
        "decoders": decoders,
        "balanced": options.balanced,
        "capacity": clustering.capacity,
        "cluster_sizes": clustering.sizes.tolist(),
        "cluster_sizes_vanilla": vanilla_sizes,
        "kmeans_objective": clustering.objective,
        "kmeans_iterations": clustering.iterations,
        "label_mix": label_mix,
        "tau": options.tau,
        "band_size_mean": float(band_sizes.mean()),
        "band_size_p90": float(np.percentile(band_sizes, 90)),
        "content_hash": artifact.content_hash,
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items()},
        "timings": timings,
        "fit_seconds": timings["total"],
    }
    return artifact, report
