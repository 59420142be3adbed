"""The engine book (`book.py`): one admission, liveness and sequence check per process, and its projections'
protocol (`entry.py`). The router's columns, the gateway's registry and the fleet view project it."""

from switchyard.services.engine_book.book import MAX_ENGINES, MAX_HELLO_BYTES, BookCounters, EngineBook, hello_weight
from switchyard.services.engine_book.entry import BookEntry, BookListener, BookListenerBase, HelloChange

__all__ = [
    "MAX_ENGINES",
    "MAX_HELLO_BYTES",
    "BookCounters",
    "BookEntry",
    "BookListener",
    "BookListenerBase",
    "EngineBook",
    "HelloChange",
    "hello_weight",
]
