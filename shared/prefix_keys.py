"""Chained block keys of a prompt: one 64-bit key per full block, equal keys meaning equal prefixes.

Why one function: an engine's cached blocks and a request's prompt must be named the same way for a prefix
index to match them. The relay beside a vLLM engine names each block it hears stored (vLLM's `BlockStored`
carries the block's token ids and its parent) with `block_keys`, and the gateway names a request's prompt with
the same function over the same tokens and the engine's block size: neither side has to reproduce vLLM's own
hash (its algorithm is a setting, and its seed is random unless PYTHONHASHSEED is set).

Key i covers tokens [0, (i+1)·block): it is a polynomial hash of every block content up to i, then mixed.
All blocks are hashed at once with numpy (uint64 arithmetic wraps mod 2⁶⁴): ~20 µs for 8K tokens, where a
per-block cryptographic hash in Python costs ~1 µs a block. Not collision-proof against a crafted prompt: a
collision only misleads a routing hint (the engine checks its own cache), never what is computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["block_keys", "text_keys"]

_P = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible mod 2**64
_P_INV = np.uint64(pow(int(_P), -1, 2**64))
_MULT = np.random.default_rng(0x5EEDB10C).integers(1, 2**63, size=4096, dtype=np.uint64) | np.uint64(1)
_MAX_BLOCK = len(_MULT)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, vectorised: spreads every input bit over the whole key."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _unmix(x: np.ndarray) -> np.ndarray:
    """The inverse of `_mix` (each step is a bijection on 64 bits): a key back to its chain state."""
    x = _unshift(x, 31)
    x = x * np.uint64(pow(0x94D049BB133111EB, -1, 2**64))
    x = _unshift(x, 27)
    x = x * np.uint64(pow(0xBF58476D1CE4E5B9, -1, 2**64))
    return _unshift(x, 30)


def _unshift(y: np.ndarray, s: int) -> np.ndarray:
    """Inverse of x ^ (x >> s)."""
    x = y.copy()
    shift = s
    while shift < 64:
        x = x ^ (y >> np.uint64(shift))
        shift += s
    return x


def block_keys(tokens: Sequence[int] | np.ndarray, block: int, salt: int = 0, parent: int | None = None) -> np.ndarray:
    """uint64[len(tokens) // block]: the chained key of each full block (a partial last block has none).

    `salt` separates namespaces that share token ids (a model, a LoRA adapter): keys under different salts
    differ. `parent`: the key of the block before `tokens[0]` (the chain continues from it, as vLLM's
    `BlockStored` names its parent); then `salt` is not used. Deterministic across processes and machines:
    ``block_keys(a + b, k)[len(a) // k:] == block_keys(b, k, parent=block_keys(a, k)[-1])`` when
    ``len(a) % k == 0``.
    """
    if not 0 < block <= _MAX_BLOCK:
        raise ValueError(f"block size must be in 1..{_MAX_BLOCK}, got {block}")
    ids = np.asarray(tokens, dtype=np.int64)
    n = len(ids) // block
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        content = ids[: n * block].reshape(n, block).astype(np.uint64) @ _MULT[:block]
        content = _mix(content ^ np.uint64(block))
        terms = np.empty(n + 1, dtype=np.uint64)
        if parent is None:
            terms[0] = _mix(np.array([salt & (2**64 - 1)], dtype=np.uint64))[0]
        else:
            terms[0] = _unmix(np.array([parent], dtype=np.uint64))[0]
        terms[1:] = content
        # S_i = Σ_{j ≤ i} t_j · P^(i−j) = P^i · Σ_{j ≤ i} t_j · P^(−j)  (mod 2**64)
        inv_pow = np.cumprod(np.full(n + 1, _P_INV, dtype=np.uint64)) * _P  # P^-j for j = 0..n
        pow_ = np.cumprod(np.full(n + 1, _P, dtype=np.uint64)) * _P_INV  # P^j
        acc = np.cumsum(terms * inv_pow, dtype=np.uint64) * pow_
        return _mix(acc[1:])


def text_keys(text: str, block_chars: int, salt: int = 0) -> np.ndarray:
    """Keys of a text's full blocks of `block_chars` UTF-8 bytes (a prefix index without a tokenizer)."""
    return block_keys(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), block_chars, salt)
