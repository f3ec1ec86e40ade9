"""A request body's JSON, parsed and checked so that nothing later meets what it cannot handle, without stalling
the server: the rule is that this module knows JSON, nothing of HTTP or the API's fields.

Checked: at most MAX_DEPTH levels of nesting, at most MAX_CONTAINERS objects and arrays, integers within
+-MAX_INT, and strings (keys too) that are Unicode text (a lone surrogate such as "\\ud800" is legal JSON but no
text: it cannot be encoded, tokenized or echoed).

What a body may cost is bounded before it is parsed. json.loads holds the GIL from start to end and builds every
value on the server's heap: a 20 MiB body of five million numbers in one flat array takes half a second and some
400 MB, during which the event loop answers nobody. So a body is counted first: its commas and opening brackets
(strings included) are counted while it streams in (`Counts`, bytes.count on each chunk: memchr speed), and a body
with more than MAX_COMMAS_HERE commas or MAX_BRACKETS_HERE brackets, which may hold that many values, is counted
exactly in a helper process: its strings blanked by one regular expression (C speed, no Python objects), then its
values bounded by its commas and brackets outside strings. Past MAX_VALUES values or MAX_CONTAINERS objects and
arrays it is refused there, unparsed; otherwise it is parsed here, at a cost that the bounds hold to tens of
milliseconds. Every request a client really sends stays below the first count and is parsed here directly.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64  # the API's deepest JSON (a tool's parameters schema) is far shallower
MAX_INT = 2**64  # a JSON integer's magnitude; seeds go up to 2**64 - 1
MAX_INT_DIGITS = len(str(MAX_INT))
MAX_CONTAINERS = 50_000  # objects and arrays in one body: 4096 messages of several content parts each, and tools
MAX_VALUES = 320_000  # values (numbers, strings, literals, objects, arrays) in one body: an Ollama `context` of
# the real model's 262,144 token ids, with room for the rest of its request
MAX_BRACKETS_HERE = 20_000  # '{' and '[' bytes (in strings too) up to which a body is parsed in this process
MAX_COMMAS_HERE = 100_000  # ',' bytes (in strings too) up to which a body is parsed in this process


@dataclass
class Counts:
    """A body's commas and opening brackets, strings included, counted chunk by chunk as it arrives."""

    commas: int = 0
    brackets: int = 0

    def add(self, chunk: bytes) -> None:
        self.commas += chunk.count(b",")
        self.brackets += chunk.count(b"{") + chunk.count(b"[")

    @classmethod
    def of(cls, data: bytes) -> Counts:
        counts = cls()
        counts.add(data)
        return counts

    @property
    def needs_helper(self) -> bool:
        """Whether the body may hold more values than are parsed here without counting them exactly first."""
        return self.commas > MAX_COMMAS_HERE or self.brackets > MAX_BRACKETS_HERE


class BodyError(Exception):
    """A body that is not a request: HTTP status, message, error code."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def parse(data: bytes, counts: Counts | None = None) -> Any:
    """The body's JSON value, checked; BodyError if it is not acceptable. A body that may hold many values is
    counted exactly in the helper process first (the module's docstring). Blocks while the helper counts: the
    server's handlers use `parse_async`."""
    counts = Counts.of(data) if counts is None else counts
    if counts.needs_helper:
        _raise_verdict(lambda: _helper().submit(count_elsewhere, data).result())
    return parse_here(data)


async def parse_async(data: bytes, counts: Counts) -> Any:
    """`parse` for the event loop: the helper's count awaited (no thread waits on it), then the parse in a thread of
    this module's own (a flood of large bodies does not take the threads that other requests' work runs on)."""
    if counts.needs_helper:
        future = _helper().submit(count_elsewhere, data)
        verdict = await _awaited_verdict(asyncio.wrap_future(future))
        if verdict is not None:
            raise BodyError(*verdict)
    return await asyncio.get_running_loop().run_in_executor(_parse_threads(), parse_here, data)


async def _awaited_verdict(future):
    try:
        return await future
    except BrokenProcessPool:  # the helper died on this body (its memory, say): a new one for the next
        _drop_helper()
        raise _unparsed() from None


def _raise_verdict(ask) -> None:
    try:
        verdict = ask()
    except BrokenProcessPool:
        _drop_helper()
        raise _unparsed() from None
    if verdict is not None:
        raise BodyError(*verdict)


def _unparsed() -> BodyError:
    return BodyError(400, "the body's JSON could not be parsed within this server's limits", "invalid_json")


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


# a JSON string: quote, then runs of ordinary bytes and escapes (written unrolled: no backtracking, C speed)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def count_elsewhere(data: bytes) -> tuple[int, str, str] | None:
    """In the helper process: None if the body holds at most MAX_CONTAINERS objects and arrays and MAX_VALUES values,
    else (status, message, code). Its strings are blanked first, so what is counted is the JSON's own syntax; every
    value but the first of a container follows a comma, so values <= commas + 2 x containers + 1 (for valid JSON;
    an invalid body stops json.loads at its first fault, within what was counted)."""
    bare = _STRING.sub(b'""', data)
    containers = bare.count(b"{") + bare.count(b"[")
    if containers > MAX_CONTAINERS:
        return 400, f"the body holds more than {MAX_CONTAINERS} JSON objects and arrays", "invalid_json"
    if bare.count(b",") + 2 * containers + 1 > MAX_VALUES:
        return 400, f"the body holds more than {MAX_VALUES} JSON values", "invalid_json"
    return None


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim), so that the megabytes a large body
    passed through do not stay in the server's resident memory (glibc raises its mmap threshold after the first
    large free, and keeps what later ones leave on its heap). Elsewhere: nothing."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None
_pool = None
_threads = None
_pool_lock = threading.Lock()


def _parse_threads():
    """Two threads that parse bodies (json.loads holds the GIL, so more would not parse faster)."""
    global _threads
    with _pool_lock:
        if _threads is None:
            from concurrent.futures import ThreadPoolExecutor

            _threads = ThreadPoolExecutor(2, "dgemma-body")
        return _threads


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
