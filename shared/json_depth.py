"""A nesting bound for JSON request bodies, so deep nesting is a client error and never a RecursionError.

`json.loads` raises RecursionError (not ValueError) on ~1,000 levels, and a body just under that parses and then
fails wherever it is walked again deeper in the stack (`json.dumps`, FastAPI's error encoder): a 500 with a
traceback per request. Bodies nested deeper than `MAX_DEPTH` are refused instead. The check is cheap for
ordinary bodies: a body with at most `MAX_DEPTH` opening brackets cannot be deeper, and finding that out takes a
few `bytes.find` calls; only bodies with more are walked (containers only, no recursion).
"""

from __future__ import annotations

import json
from typing import Any

#: Deeper bodies are refused. OpenAI bodies nest a handful of levels (a tool's JSON schema a few dozen at most);
#: serde_json's default is the same 128.
MAX_DEPTH = 128


class TooDeep(ValueError):
    """The body nests deeper than the bound (or than Python's parser can)."""

    def __init__(self, limit: int = MAX_DEPTH) -> None:
        super().__init__(f"request body is nested more than {limit} levels deep")


def may_exceed(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """False when `raw` cannot nest deeper than `limit`: it has at most `limit` opening brackets (strings included).

    `bytes.find` (memchr), stopping at the `limit + 1`-th: ~25x faster than two `bytes.count` passes on a 0.5 MiB
    prompt (11 µs against 285 µs here), where the count cost a third of the body's `json.loads`."""
    seen = 0
    for bracket in (b"[", b"{"):
        at = raw.find(bracket)
        while at != -1:
            seen += 1
            if seen > limit:
                return True
            at = raw.find(bracket, at + 1)
    return False


def depth(value: Any) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0, `[]` is 1)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        level += 1
        deepest = max(deepest, level)
        stack.extend((child, level) for child in item if isinstance(child, (list, dict)))
    return deepest


def loads(raw: bytes, limit: int = MAX_DEPTH) -> Any:
    """`json.loads` that raises `TooDeep` (a ValueError) instead of RecursionError, and for bodies past `limit`."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise TooDeep(limit) from None
    if may_exceed(raw, limit) and depth(value) > limit:
        raise TooDeep(limit)
    return value
