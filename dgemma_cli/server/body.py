"""A request body's JSON, parsed and checked so that nothing later meets what it cannot handle, without stalling
the server: the rule is that this module knows JSON, nothing of HTTP or the API's fields.

Checked: at most MAX_DEPTH levels of nesting, at most MAX_CONTAINERS objects and arrays, integers within
+-MAX_INT, and strings (keys too) that are Unicode text (a lone surrogate such as "\\ud800" is legal JSON but no
text: it cannot be encoded, tokenized or echoed).

Why a second process: json.loads holds the GIL from start to end, and a 10 MB body of 300,000 tiny objects takes
it for 150 ms, during which the server's event loop answers nobody. A body that may hold that many objects (more
opening brackets than MAX_BRACKETS_HERE, counted in a few milliseconds, strings included) is first parsed and
checked in a helper process; only one that passes is parsed here, and it holds at most MAX_CONTAINERS objects.
Every request a client really sends stays below the count and is parsed here directly.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any

MAX_DEPTH = 64  # the API's deepest JSON (a tool's parameters schema) is far shallower
MAX_INT = 2**64  # a JSON integer's magnitude; seeds go up to 2**64 - 1
MAX_INT_DIGITS = len(str(MAX_INT))
MAX_CONTAINERS = 50_000  # objects and arrays in one body: 4096 messages of several content parts each, and tools
MAX_BRACKETS_HERE = 20_000  # '{' and '[' bytes (in strings too) up to which a body is parsed in this process


class BodyError(Exception):
    """A body that is not a request: HTTP status, message, error code."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def parse(data: bytes) -> Any:
    """The body's JSON value, checked; BodyError if it is not acceptable. Parsed in a helper process first when it
    may hold many objects (see the module's docstring)."""
    if data.count(b"{") + data.count(b"[") > MAX_BRACKETS_HERE:
        try:
            verdict = _helper().submit(check_elsewhere, data).result()
        except BrokenProcessPool:  # the helper died on this body (its memory, say): a new one for the next
            _drop_helper()
            raise BodyError(400, "the body's JSON could not be parsed within this server's limits",
                            "invalid_json") from None
        if verdict is not None:
            raise BodyError(*verdict)
    return parse_here(data)


def parse_here(data: bytes) -> Any:
    try:
        value = json.loads(data, parse_int=_parse_int)
    except RecursionError:
        raise BodyError(400, f"the body's JSON is nested more than {MAX_DEPTH} levels deep", "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BodyError(400, f"the body is not valid JSON: {str(e)[:200]}", "invalid_json") from None
    check(value)
    return value


def _parse_int(digits: str) -> int:
    """A JSON integer's text; one longer than any integer within MAX_INT is refused before int() reads it: past
    4300 digits int() itself refuses, in words about Python (sys.set_int_max_str_digits), not the API's, and
    reading thousands of digits is work for nothing."""
    length = len(digits.lstrip("-"))
    if length > MAX_INT_DIGITS:
        raise _too_large(length)
    return int(digits)


def _too_large(digits: int) -> BodyError:
    return BodyError(400, f"the body holds an integer of {digits} digits; none may pass 2**64", "invalid_value")


def check(body: Any) -> None:
    """Walk the value (iteratively: a deep document must not exhaust this thread's stack)."""
    todo, containers = [(body, 1)], 0
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (dict, list)):
            containers += 1
            if depth > MAX_DEPTH:
                raise BodyError(400, f"the body's JSON is nested more than {MAX_DEPTH} levels deep", "invalid_json")
            if containers > MAX_CONTAINERS:
                raise BodyError(400, f"the body holds more than {MAX_CONTAINERS} JSON objects and arrays",
                                "invalid_json")
            items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
            for key, v in items:
                if key is not None:
                    _check_text(key)
                todo.append((v, depth + 1))
        elif isinstance(value, str):
            _check_text(value)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise _too_large(len(str(abs(value))))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(400, "the body holds a string with a lone surrogate (\\ud800-\\udfff): not Unicode text",
                        "invalid_json") from None


def check_elsewhere(data: bytes) -> tuple[int, str, str] | None:
    """In the helper process: None if the body passes, else (status, message, code)."""
    try:
        parse_here(data)
    except BodyError as e:
        return e.status, e.message, e.code
    return None


_pool = None
_pool_lock = threading.Lock()


def _helper():
    """The helper process, started at the first body that needs it (spawned: a fork of a process running torch's
    threads is not safe), then kept."""
    global _pool
    with _pool_lock:
        if _pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            _pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return _pool


def _drop_helper() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)
        _pool = None
