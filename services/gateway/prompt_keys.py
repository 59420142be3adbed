"""A request's prompt as prefix-cache block keys (`shared.prefix_keys`), at the gateway, before routing.

*Token keys* (`key_kind` "tokens") name the prompt's blocks as the engines' KV events name theirs: over the model's
token ids at the engines' block size (their hellos' `capacity.block_size`). The token ids are vLLM's own for the
request when a tokenizer for the model is configured (`SWITCHYARD_GATEWAY_TOKENIZERS`):

- `/v1/completions`, a string prompt: the tokenizer's encoding with special tokens added, as vLLM's
  `add_special_tokens` defaults to for completions (the request's own `add_special_tokens` is honoured);
  a token-id prompt: the ids as given (vLLM adds nothing to them; no tokenizer needed);
- `/v1/chat/completions`: the messages rendered with the model's chat template (HF's `apply_chat_template`
  environment: sandboxed jinja2, `trim_blocks`, `lstrip_blocks`, `tojson`, `raise_exception`, the special tokens,
  `add_generation_prompt` true unless the request says otherwise), then encoded without special tokens (vLLM's
  chat default). A content list of text parts is joined with newlines (vLLM's "string" content format).

*Text keys* ("text") otherwise: blocks of `block_size * CHARS_PER_TOKEN` bytes of the prompt text (a chat's
messages as compact JSON). They only approximate the engines' blocks, so the router and the gateway match them
against what they routed, never against KV events. So are a chat request that names its own template or tools,
content with non-text parts, and a template that fails to render.

What is tokenized: HF `tokenizers` costs ~1-3 µs a token on this machine (10-25 ms for an 8K-token prompt), far
over the gateway's budget. Two things bring it down without changing a key:

- *Only the seen text.* Per model the gateway keeps which leading text (256-byte blocks, chained like block keys)
  the prompts it was sent began with (`tokenize_seen_blocks`, oldest half out past it, `prefix_routed_ttl_s`). No
  engine can hold the blocks of a prefix no prompt had, so only the leading text seen before is tokenized, up to
  a cut (below); its tokens are exactly the first tokens of the whole prompt, and their keys its leading keys (a
  tokenizer that cannot be cut: all of the prompt). A prompt that begins like none before is not tokenized at all
  (no keys: nothing could match). The exact prompt token count goes to the router only when all of the prompt was
  tokenized. One gateway replica knows only its own prompts: a prefix another replica (or this one before a
  restart) routed gets keys here from the second time this replica sees it. `tokenize_all` tokenizes every
  prompt in full instead.
- *Pieces.* A long text is tokenized in pieces of ~`tokenize_piece_chars` cut at a space before a letter, where
  the common pre-tokenizers split anyway; each tokenizer is checked at load on texts that cut there (words,
  digits, punctuation, runs of spaces, other scripts) and one whose tokens differ is never cut. New pieces go to
  `encode_batch` at once (parallel, without the GIL); pieces an earlier prompt had come from an LRU cache.

Where it runs: text of at most `tokenize_inline_chars` characters to tokenize on the event loop; longer text in
a worker thread (`encode_batch` releases the GIL; `encode` does not: a thread running it would stall the loop as
much). The thread hop costs ~0.07 ms here, about what 250 characters cost to tokenize inline. Figures:
`docs/fragments/gateway-prefix.md`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from switchyard.shared.errors import ConfigError
from switchyard.shared.prefix_keys import block_keys, text_keys
from switchyard.shared.schemas import MAX_PROMPT_BLOCKS

if TYPE_CHECKING:
    from switchyard.services.gateway.settings import GatewaySettings

__all__ = ["ModelTokenizer", "PromptKeyer", "PromptKeys", "parse_tokenizers"]

log = logging.getLogger(__name__)

#: Where a long text may be cut for tokenizing in pieces: a space between a non-space and a letter, which every
#: common pre-tokenizer (GPT-2/Llama-3 byte-level regexes, SentencePiece's metaspace, whitespace) also splits at.
#: Each tokenizer is checked at load (`ModelTokenizer._check_pieces`); one that disagrees is never cut.
_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")
#: The check's texts: words, punctuation, digits, contractions, runs of spaces and newlines, non-Latin scripts.
_CHECK_TEXTS = (
    "The quick brown fox, it's said, jumped 12345 times over the lazy dog's back.  Twice!\n\nThen it "
    "rested: naïve café owners served crème brûlée at 3.14 pm; 東京 and Zürich   agreed. Don't we'll they've "
    "x=1+2 (ok) [yes] {no} <tag> #hash @user https://example.com/a?b=c  \t tab\tend "
    "Über Ärger öffnet ñandú, ελληνικά κείμενα και русский текст тоже. " * 3,
    "user\nWrite a function that returns the sum of a list.\nassistant\ndef total(xs):\n    return sum(xs)\n"
    "Numbers 1 22 333 4444 55555 and words again and again " * 4,
)

#: A rough characters-per-token ratio (as `body.CHARS_PER_TOKEN`): text blocks cover about one token block.
CHARS_PER_TOKEN = 4
#: The seen-text index's block (characters): how finely the gateway knows which leading text it has seen.
SEEN_BLOCK_CHARS = 256
_SEEN_MAX_CHARS = MAX_PROMPT_BLOCKS * 64
_NO_KEYS = np.zeros(0, dtype=np.uint64)
#: Seen leading texts whose keys `PromptKeyer` keeps (~4 KB each for 8K tokens).
_MEMO_ENTRIES = 4096
#: Text up to this long is cut into pieces (and they are looked up in the cache) on the event loop.
_LOOK_UP_INLINE_CHARS = 64 * 1024


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """The prompt's block keys (uint64, at most `MAX_PROMPT_BLOCKS`), how they were named, and the exact prompt
    token count when the prompt was tokenized (None: only estimated)."""

    keys: np.ndarray
    kind: str  # "tokens" | "text"
    tokens: int | None


def parse_tokenizers(spec: str) -> dict[str, str]:
    """`"model=path,model2=path2"` → {model: path}; a malformed entry is a `ConfigError` naming it."""
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        model, sep, path = entry.partition("=")
        if not sep or not model.strip() or not path.strip():
            raise ConfigError(f"SWITCHYARD_GATEWAY_TOKENIZERS: {entry!r} is not model=path")
        out[model.strip()] = path.strip()
    return out


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict with its `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(template: str) -> Any:
    """The template in the environment HF's `apply_chat_template` renders in."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class ModelTokenizer:
    """One model's tokenizer (HF `tokenizers`), chat template and special tokens, loaded from `path`."""

    def __init__(self, model: str, path: str, piece_chars: int = 2048, cache_pieces: int = 4096) -> None:
        from tokenizers import Tokenizer

        self.model = model
        self.piece_chars = piece_chars
        self.cache_pieces = cache_pieces
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()  # piece text -> its token ids, LRU
        self._lock = threading.Lock()
        self.cache_hits = self.cache_misses = 0
        where = Path(path).expanduser()
        file = where / "tokenizer.json" if where.is_dir() else where
        if not file.is_file():
            raise ConfigError(f"SWITCHYARD_GATEWAY_TOKENIZERS: no tokenizer for model {model!r} at {path!r}")
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust library raises a bare Exception for a malformed file
            raise ConfigError(f"SWITCHYARD_GATEWAY_TOKENIZERS: {str(file)!r} is not a tokenizer: {exc}") from None
        config: dict[str, Any] = {}
        config_file = file.parent / "tokenizer_config.json"
        if config_file.is_file():
            try:
                loaded = json.loads(config_file.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"SWITCHYARD_GATEWAY_TOKENIZERS: cannot read {str(config_file)!r}: {exc}") from None
            config = loaded if isinstance(loaded, dict) else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next(
                (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
            )
        jinja_file = file.parent / "chat_template.jinja"
        if jinja_file.is_file():  # newer HF checkpoints keep it beside the config
            template = jinja_file.read_text()
        self.chat_template: Any = None
        if isinstance(template, str) and template:
            try:
                self.chat_template = _compile(template)
            except Exception as exc:  # a template jinja2 cannot parse: said at startup, not per request
                raise ConfigError(f"SWITCHYARD_GATEWAY_TOKENIZERS: model {model!r}'s chat template: {exc}") from None
        self.special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
            if (text := _token_text(config.get(name))) is not None
        }
        self._prefix = self._suffix = np.zeros(0, dtype=np.int64)
        self.pieces = piece_chars > 0 and self._check_pieces()
        if piece_chars > 0 and not self.pieces:
            log.info("model %s: its tokenizer is not cut into pieces (it tokenizes a cut text differently)", model)

    def _check_pieces(self) -> bool:
        """Whether this tokenizer gives a text cut at `_CUT` the tokens of the whole text, and adds its special
        tokens as one fixed prefix and suffix (which are then added to the pieces' tokens)."""
        affixes = set()
        for text in (*_CHECK_TEXTS, " ".join(self.special.values()) + " " + _CHECK_TEXTS[0]):
            bare = self.tokenizer.encode(text, add_special_tokens=False).ids
            full = self.tokenizer.encode(text, add_special_tokens=True).ids
            found = _affixes(bare, full)
            cut = [i for e in self.tokenizer.encode_batch(_cut(text, 24), add_special_tokens=False) for i in e.ids]
            if found is None or cut != bare:
                return False
            affixes.add(found)
        if len(affixes) != 1:
            return False
        prefix, suffix = affixes.pop()
        self._prefix, self._suffix = np.array(prefix, dtype=np.int64), np.array(suffix, dtype=np.int64)
        return True

    def encode(self, texts: Sequence[str], add_special_tokens: bool, off_loop: bool) -> list[Sequence[int]]:
        """Token ids of each text. `off_loop` (in a worker thread): through `encode_batch`, which releases the GIL,
        and a long text in pieces (`encode_long`)."""
        if off_loop and self.pieces:
            return [self.encode_long(t, add_special_tokens) for t in texts]
        if off_loop or len(texts) > 1:
            return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        return [self.tokenizer.encode(texts[0], add_special_tokens=add_special_tokens).ids]

    def encode_long(self, text: str, add_special_tokens: bool, suffix: bool = True) -> np.ndarray:
        """A long text's token ids, tokenized in pieces of about `piece_chars` cut at `_CUT`: the pieces no
        earlier prompt had are encoded at once (`encode_batch`: in parallel, without the GIL); those one had (a
        shared system prompt, the earlier turns of a conversation) come from an LRU cache of `cache_pieces`."""
        return self.finish(self.look_up(text), add_special_tokens, suffix)

    def look_up(self, text: str) -> _Pieces:
        """`text` cut into pieces, with the cached ids of those an earlier prompt had (cheap: the event loop's)."""
        pieces = _cut(text, self.piece_chars)
        cache = self._cache
        with self._lock:
            found = [cache.get(p) for p in pieces]
            for piece, ids in zip(pieces, found, strict=True):
                if ids is not None:
                    cache.move_to_end(piece)
        missing = sum(len(p) for p, ids in zip(pieces, found, strict=True) if ids is None)
        return _Pieces(pieces, found, missing)

    def finish(self, looked: _Pieces, add_special_tokens: bool, suffix: bool = True) -> np.ndarray:
        """The ids of looked-up pieces: the missing ones encoded (`encode_batch`), all joined, special tokens added."""
        pieces, found = looked.pieces, looked.found
        missing = [p for p, ids in zip(pieces, found, strict=True) if ids is None]
        self.cache_hits += len(pieces) - len(missing)
        self.cache_misses += len(missing)
        if missing:
            encoded = self.tokenizer.encode_batch(missing, add_special_tokens=False)
            new = {p: np.array(e.ids, dtype=np.int64) for p, e in zip(missing, encoded, strict=True)}
            with self._lock:
                for piece, ids in new.items():
                    self._cache[piece] = ids
                while len(self._cache) > self.cache_pieces:
                    self._cache.popitem(last=False)
            found = [new[p] if ids is None else ids for p, ids in zip(pieces, found, strict=True)]
        if not add_special_tokens:
            return np.concatenate(found)
        parts = [self._prefix, *found, self._suffix] if suffix else [self._prefix, *found]
        return np.concatenate(parts)

    def render_chat(self, body: dict[str, Any]) -> str | None:
        """The chat prompt as vLLM renders it, or None where this gateway cannot be sure of it."""
        if self.chat_template is None or body.get("chat_template") is not None or body.get("tools"):
            return None
        messages = []
        for message in body["messages"]:
            content = message.get("content")
            if isinstance(content, list):
                texts = [p.get("text") for p in content if isinstance(p, dict)]
                if len(texts) != len(content) or not all(
                    isinstance(t, str) and p.get("type") == "text" for t, p in zip(texts, content, strict=True)
                ):
                    return None  # images, audio: the engine inserts placeholders this gateway does not know
                message = {**message, "content": "\n".join(texts)}
            messages.append(message)
        kwargs = body.get("chat_template_kwargs")
        add_generation_prompt = body.get("add_generation_prompt", True)
        try:
            return self.chat_template.render(
                **(kwargs if isinstance(kwargs, dict) else {}),
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt is not False,
                **self.special,
            )
        except Exception:  # the template refused the conversation (raise_exception); the engine will say why
            return None


class PromptKeyer:
    """Block keys for each request, per model: tokenizers loaded once, long prompts tokenized in threads, and
    (unless `tokenize_all`) only the leading text this gateway has seen lead a prompt before (the module says why)."""

    def __init__(
        self,
        tokenizers: str = "",
        inline_chars: int = 2048,
        threads: int = 2,
        piece_chars: int = 2048,
        cache_pieces: int = 4096,
        tokenize_all: bool = False,
        seen_blocks: int = 200_000,
        seen_ttl_s: float = 600.0,
    ) -> None:
        self.tokenizers = {
            m: ModelTokenizer(m, p, piece_chars, cache_pieces) for m, p in parse_tokenizers(tokenizers).items()
        }
        self.inline_chars = inline_chars
        self.tokenize_all = tokenize_all
        #: Per model, the leading text blocks (`SEEN_BLOCK_CHARS`) of the prompts this gateway was sent.
        self.seen = {m: _Seen(seen_blocks, seen_ttl_s) for m in self.tokenizers}
        #: The keys of seen leading text, by (model, its last seen block's key, where it ends, the text past that
        #: block, special tokens, block size): a prefix seen again costs a dict lookup, not a tokenization.
        self._memo: OrderedDict[tuple[Any, ...], PromptKeys] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._threads = threads

    @classmethod
    def from_settings(cls, g: GatewaySettings) -> PromptKeyer:
        """The keyer `SWITCHYARD_GATEWAY_TOKENIZE*` and the routed index's TTL describe: one reading of those
        settings for the gateway and the endpoint picker (which serves with the gateway's settings)."""
        return cls(
            g.tokenizers,
            g.tokenize_inline_chars,
            g.tokenize_threads,
            g.tokenize_piece_chars,
            g.tokenize_cache_pieces,
            g.tokenize_all,
            g.tokenize_seen_blocks,
            g.prefix_routed_ttl_s,
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def keys(self, body: dict[str, Any], chat: bool, model: str | None, block_size: int) -> PromptKeys:
        """The request's keys; tokenized off the event loop when the text to tokenize is long (see the module)."""
        work = self._plan(body, chat, model, block_size)
        if isinstance(work, PromptKeys):
            return work
        if work.size <= self.inline_chars:
            return self._remember(work, work.run(False))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="sy-tokenize")
        return self._remember(work, await asyncio.get_running_loop().run_in_executor(self._pool, work.run, True))

    def keys_now(self, body: dict[str, Any], chat: bool, model: str | None, block_size: int) -> PromptKeys:
        """`keys` on the calling thread (tests, benches)."""
        work = self._plan(body, chat, model, block_size)
        return work if isinstance(work, PromptKeys) else self._remember(work, work.run(False))

    def _remember(self, work: _Work, keys: PromptKeys) -> PromptKeys:
        if work.memo is not None:
            self._memo[work.memo] = keys
            if len(self._memo) > _MEMO_ENTRIES:
                self._memo.popitem(last=False)
        return keys

    def _plan(self, body: dict[str, Any], chat: bool, model: str | None, block: int) -> PromptKeys | _Work:
        tokenizer = self.tokenizers.get(model) if model is not None else None
        if chat:
            rendered = tokenizer.render_chat(body) if tokenizer is not None else None
            if rendered is None:
                return _text(json.dumps(body["messages"], separators=(",", ":"), ensure_ascii=False), block)
            assert model is not None and tokenizer is not None
            return self._tokenize(tokenizer, model, [rendered], body.get("add_special_tokens", False) is True, block)
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt[0], int):  # token ids: keys without a tokenizer, exact
            return _tokens(prompt, block, len(prompt))
        if isinstance(prompt[0], list):
            return _tokens(prompt[0], block, sum(len(p) for p in prompt))
        if tokenizer is None:
            return _text(prompt[0], block)
        assert model is not None
        return self._tokenize(tokenizer, model, prompt, body.get("add_special_tokens", True) is not False, block)

    def _tokenize(
        self, tokenizer: ModelTokenizer, model: str, texts: list[str], special: bool, block: int
    ) -> PromptKeys | _Work:
        """All of the texts, or the first one's leading text this gateway has seen before (to a cut)."""
        text = texts[0]
        memo = None
        if self.tokenize_all:
            end = len(text)
        else:
            end, anchor, limit = self.seen[model].seen_end(text)
            if end == 0:  # no prompt this gateway was sent began so: no engine holds its blocks (this replica's view)
                return PromptKeys(_NO_KEYS, "tokens", None)
            if len(texts) == 1:
                memo = (model, anchor, end, text[limit:end], special, block)
                known = self._memo.get(memo)
                if known is not None:
                    self._memo.move_to_end(memo)
                    return known
        if not tokenizer.pieces or len(texts) > 1:  # no cut is safe: the whole text (and a batch's others)
            return _Work(sum(len(t) for t in texts), lambda off: _full(tokenizer, texts, special, block, off), memo)
        whole = end == len(text)
        part = text if whole else text[:end]
        # The pieces are looked up on the loop, so a prompt whose pieces are all cached is not sent to a thread;
        # a huge one is cut in the thread too (cutting costs ~3 µs per 1000 characters).
        looked = tokenizer.look_up(part) if len(part) <= _LOOK_UP_INLINE_CHARS else None

        def run(_off: bool) -> PromptKeys:
            ids = tokenizer.finish(looked if looked is not None else tokenizer.look_up(part), special, suffix=whole)
            return _tokens(ids, block, len(ids) if whole else None)

        return _Work(len(part) if looked is None else looked.missing, run, memo)


class _Seen:
    """Which leading text (blocks of `SEEN_BLOCK_CHARS` bytes, chained) the prompts of one model began with, and when.

    Keys chain Python's hash over each block's bytes (`hash((previous key, block))`, ~0.4 µs a block, 1 µs for
    1K tokens' text): equal keys mean equal leading text, within this process (the hash is seeded per process).
    A dict of key -> time last seen: recording a prompt is one `dict.update`; past `max_blocks` the
    oldest-inserted half goes (a prefix seen all along may go too: it is learnt again from its next prompt).
    """

    def __init__(self, max_blocks: int, ttl_s: float) -> None:
        self.max_blocks, self.ttl_s = max_blocks, ttl_s
        self.when: dict[int, float] = {}

    def seen_end(self, text: str) -> tuple[int, int, int]:
        """How much of `text` to tokenize: through its leading blocks seen before, to the last cut in them (0:
        none seen); the key of the last seen block, and the characters those blocks hold. The text's blocks are
        recorded as seen now."""
        data = text.encode()[:_SEEN_MAX_CHARS]
        size = SEEN_BLOCK_CHARS
        keys, key = [], 0
        for start in range(0, len(data) - size + 1, size):
            key = hash((key, data[start : start + size]))
            keys.append(key)
        now = time.monotonic()
        horizon = now - self.ttl_s
        get = self.when.get
        held = 0
        for key in keys:
            if get(key, -math.inf) < horizon:
                break
            held += 1
        self.when.update(dict.fromkeys(keys, now))
        if len(self.when) > self.max_blocks:
            for old in list(itertools.islice(self.when, len(self.when) // 2)):
                del self.when[old]
        if held == 0:
            return 0, 0, 0
        limit = held * size if data.isascii() else len(data[: held * size].decode(errors="ignore"))
        if held == len(keys):  # all of it but a tail shorter than a block: tokenize it all (the exact count too)
            return len(text), keys[-1], limit
        return _last_cut(text, limit), keys[held - 1], limit


def _last_cut(text: str, limit: int) -> int:
    """The last `_CUT` at or before `limit` (searched in growing windows), else all of `text` (text without
    spaces: CJK, some code)."""
    for back in (128, 1024, 8 * SEEN_BLOCK_CHARS):
        last = 0
        for cut in _CUT.finditer(text, max(0, limit - back), min(len(text), limit + 2)):
            if cut.start() <= limit:
                last = cut.start()
        if last:
            return last
    return len(text)


@dataclass(slots=True)
class _Pieces:
    pieces: list[str]
    found: list[np.ndarray | None]
    missing: int  # characters in the pieces not in the cache


def _cut(text: str, size: int) -> list[str]:
    """`text` in pieces, each cut at the first `_CUT` at least `size` characters past the previous cut."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = _CUT.search(text, start + size)
        if cut is None:
            break
        pieces.append(text[start : cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


def _affixes(bare: list[int], full: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(prefix, suffix) with `full == prefix + bare + suffix`, or None."""
    n = len(bare)
    for k in range(len(full) - n + 1):
        if full[k : k + n] == bare:
            return tuple(full[:k]), tuple(full[k + n :])
    return None


@dataclass(slots=True)
class _Work:
    size: int  # characters to tokenize (0: nothing to tokenize)
    run: Callable[[bool], PromptKeys]
    memo: tuple[Any, ...] | None = None  # where `PromptKeyer` keeps the result


def _capped(keys: np.ndarray) -> np.ndarray:
    return keys[:MAX_PROMPT_BLOCKS]


def _tokens(ids: Sequence[int] | np.ndarray, block: int, count: int | None) -> PromptKeys:
    ids = ids[: MAX_PROMPT_BLOCKS * block]
    return PromptKeys(_capped(block_keys(np.asarray(ids, dtype=np.int64), block)), "tokens", count)


def _text(text: str, block: int) -> PromptKeys:
    chars = block * CHARS_PER_TOKEN
    return PromptKeys(_capped(text_keys(text[: MAX_PROMPT_BLOCKS * chars], chars)), "text", None)


def _full(tokenizer: ModelTokenizer, texts: list[str], special: bool, block: int, off: bool) -> PromptKeys:
    ids = tokenizer.encode(texts, special, off)
    return _tokens(ids[0], block, sum(len(i) for i in ids))
