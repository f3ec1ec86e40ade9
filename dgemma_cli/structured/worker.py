"""Compiling a client's structure in a process of its own, with a time and memory budget (docs/serve.md, Structured
answers).

The rule: a structure a user or a client sends is compiled here, never in the server's or the CLI's own process.
Turning an expression into a token automaton over a 262,144-token vocabulary can take minutes and gigabytes (a
determinization that explodes, a schema's bounded strings times the vocabulary), inside native code that holds the
GIL and ignores signals. In a worker process it can be killed: when it runs past its seconds or its memory, when the
client leaves, on Ctrl-C or SIGTERM. A worker imports no torch (structure.py only) and starts at the first structure
that needs it; it receives the vocabulary once, then compiles one structure at a time, and dies with its parent
(PR_SET_PDEATHSIG). There are `workers` of them (DEFAULT_WORKERS), taken first come, first served, so that one
structure that takes its whole budget holds one worker, not every client's structures behind it.

What cannot fit the answer's tokens is refused before it is compiled: a structure whose shortest word (a choice, a
`const`, a `minLength`, an expression's shortest match) has more characters than `max_tokens` tokens of the
vocabulary's longest can hold (`shortest_chars`). The shortest word is a property of the structure, kept with it,
so the same structure asked again with other max_tokens is judged without a worker.

`StructureCompiler` is the parent's side: the cheap checks (`Structure.check`) in the caller's thread, then the
worker, then the result turned into the search's objects (constrain.TokenAutomaton, constrain.LarkGrammar), cached by
the structure's text; refusals are cached too, so a client resending a bomb pays nothing.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable

from ..errors import UsageError
from .structure import shortest_chars, unanchored

DEFAULT_SECONDS = 30.0  # a structure's compile time budget (--compile-timeout)
DEFAULT_MEMORY = 4 << 30  # each worker's resident memory budget, bytes (--compile-memory)
DEFAULT_WORKERS = 2  # compile workers: one slow structure holds one, the others go on (--compile-workers)
_POLL = 0.02  # seconds between looks at the worker (its memory, the caller's cancel)
EARLY_COMPILER_TOKENS = 32_768  # vocabularies from which `dgemma serve` starts a worker at once (the real one's
# reading and walk take about half a second; a small one's, milliseconds)
_CACHED = 32  # compiled structures kept
_REFUSED = 256  # refusals kept


class Cancelled(Exception):
    """The caller stopped waiting (its client left): nothing is cached."""


class Busy(Exception):
    """Too many structures are waiting for the worker already (MAX_WAITING): try again later."""


MAX_WAITING = 8  # uncached compiles waiting for the worker at once; past it, Busy (the server's 429)


class TooLong(Exception):
    """A structure whose shortest answer cannot fit this request's max_tokens (not cached as a refusal)."""


class Stopped(Exception):
    """The compiler was closed (a server shutting down): nothing is cached."""


# ----------------------------------------------------------------------------- the wire: length-prefixed pickles


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _recv(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    data = stream.read(n)
    return pickle.loads(data) if len(data) == n else None


# ----------------------------------------------------------------------------- the worker process


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent ends (a killed server leaves no compile running)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# the directory that holds dgemma_cli/, on the worker's path as it is on ours
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker_main() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    _die_with_parent()
    if os.getppid() != int(os.environ.get("DGEMMA_COMPILE_PARENT", os.getppid())):
        return  # the parent ended before the death signal was armed (a server that is PID 1 is a parent too)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing printed may reach the protocol's stream
    compiler = None
    while True:
        msg = _recv(inp)
        if msg is None:
            return
        if msg[0] == "vocab":
            compiler = Compile(*msg[1:])
            compiler.warm()
            continue
        _, kind, source, max_tokens = msg
        try:
            _send(out, compiler(kind, source, max_tokens))
        except UsageError as e:
            _send(out, ("refused", str(e)))
        except Exception as e:  # noqa: BLE001 (a library's own error on a client's input: a refusal, one line)
            line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            _send(out, ("refused", f"the structure cannot be compiled: {line}"))


class Compile:
    """What the worker does with a structure, over one vocabulary: ("tables", automaton tables) for an expression
    or a schema, ("grammar", llguidance grammar text) for a grammar, or for a schema whose token automaton would
    hold over `max_edges` edges (structure.estimated_edges): llguidance's own JSON Schema grammar, walked as a
    grammar is. UsageError for what is refused. Runs in the worker; tests call it in-process."""

    def __init__(self, words, vocab_size: int, tokenizer_json: str | None, max_edges: int | None = None):
        from .structure import MAX_EDGES

        self.words, self.vocab_size, self.tokenizer_json = words, vocab_size, tokenizer_json
        self.max_edges = MAX_EDGES if max_edges is None else max_edges
        self.vocabularies: dict[tuple, object] = {}  # specials -> outlines-core's Vocabulary, made when first needed
        self.ll_tokenizer = None  # made at the first grammar
        self.token_chars = longest_token(words, vocab_size)

    def __call__(self, kind: str, source: str, max_tokens: int | None = None):
        """(kind, result, shortest): shortest is the fewest characters of an answer (0 where not known, a grammar);
        ("too_long", shortest, shortest) when that cannot fit max_tokens tokens, compiling nothing."""
        from .classes import NotClassed, class_tables
        from .structure import (Structure, estimated_edges, lark_grammar, outlines_vocabulary, regex_tables,
                                schema_grammar, shortest_chars)

        structure = Structure(kind, source)
        if kind == "grammar":
            return "grammar", self._probed(lark_grammar(source)), 0
        regex = structure.regex()
        shortest = shortest_chars(regex)
        if max_tokens is not None and not fits(shortest, max_tokens, self.token_chars):
            return "too_long", shortest, shortest
        specials = structure.specials
        try:  # over token classes (a string's characters a few dozen classes, a bound states, not edges)
            return "tables", class_tables(regex, self.words, self.vocab_size, specials), shortest
        except NotClassed:  # outlines-core's token Index, as large as it is
            pass
        if kind == "json_schema" and estimated_edges(regex, self.vocab_size) > self.max_edges:
            return "grammar", self._probed(schema_grammar(structure.prepared)), shortest
        if specials not in self.vocabularies:  # the plain one, and one per set of special tokens a call names
            self.vocabularies[specials] = outlines_vocabulary(self.words, self.vocab_size, specials)
        return "tables", regex_tables(regex, self.vocabularies[specials], self.vocab_size), shortest

    def warm(self) -> None:
        """The vocabulary's own work, done once when it arrives (classes.py caches it per vocabulary): its spellings
        with and without plane 16's byte, and every token's walk through a JSON string's body, so that a structure's
        first compile pays only for itself."""
        for kind, source in (("regex", "a"), ("json_schema", '{"type": "string"}')):
            try:
                self(kind, source)
            except Exception:  # noqa: BLE001 (a vocabulary that spells neither: the first structure will say so)
                pass

    def _probed(self, grammar: str) -> str:
        if self.ll_tokenizer is None:
            self.ll_tokenizer = _ll_tokenizer(self.words, self.vocab_size, self.tokenizer_json)
        _probe_grammar(grammar, self.ll_tokenizer)
        return grammar


def longest_token(words, vocab_size: int) -> int:
    """The most characters one token can put in an answer: its bytes (a character is at least one byte)."""
    return max((len(w) for w in words[:vocab_size] if w), default=1)


def fits(shortest: int, max_tokens: int, token_chars: int) -> bool:
    """Whether an answer of `shortest` characters can fit in max_tokens tokens of at most token_chars each."""
    return shortest <= max_tokens * token_chars


def too_long(shortest: int, max_tokens: int, token_chars: int) -> str:
    per = f"{token_chars} character{'s' if token_chars != 1 else ''}"
    return (f"the structure's shortest answer is {shortest:,} characters, more than max_tokens ({max_tokens:,}) "
            f"tokens can hold (at most {per} a token): raise max_tokens or shorten it")


def _ll_tokenizer(words, vocab_size: int, tokenizer_json: str | None):
    """llguidance's tokenizer over these token bytes (structure.ll_tokenizer), text encoded by the checkpoint's own
    tokenizer.json when there is one, else greedily by the longest token."""
    from .structure import ll_tokenizer

    if tokenizer_json is not None:
        from tokenizers import Tokenizer

        hf = Tokenizer.from_str(tokenizer_json)

        def encode(text: str) -> list[int]:
            return hf.encode(text, add_special_tokens=False).ids
    else:
        ids = {b: i for i, b in enumerate(words[:vocab_size]) if b}
        longest = max(map(len, ids), default=1)

        def encode(text: str) -> list[int]:
            data, out, i = text.encode(), [], 0
            while i < len(data):
                n = next((n for n in range(min(longest, len(data) - i), 0, -1) if data[i : i + n] in ids), 0)
                if n:
                    out.append(ids[data[i : i + n]])
                i += max(n, 1)
            return out

    return ll_tokenizer(words, vocab_size, encode, eos_id=0)


def _probe_grammar(grammar: str, tokenizer) -> None:
    """Build the grammar's matcher and its first mask: the work llguidance does before a first step, done here
    under the budget."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise UsageError(f"the grammar cannot be compiled for this model's vocabulary: "
                         f"{matcher.get_error().splitlines()[0][:300]}")


# ----------------------------------------------------------------------------- the parent's side


def _rss(pid: int) -> int:
    """A process's resident memory in bytes (0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GB"


class _Worker:
    """One compile worker process (started at the first compile it takes) and whether a compile holds it."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.busy = False

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass


class StructureCompiler:
    """Compiles structures over one tokenizer's vocabulary in `workers` worker processes, each structure within
    `seconds` and each worker within `memory` bytes; results and refusals cached by the structure's text, and each
    structure's shortest answer beside them (refused against max_tokens without a worker)."""

    def __init__(self, tokenizer, vocab_size: int, seconds: float = DEFAULT_SECONDS, memory: int = DEFAULT_MEMORY,
                 workers: int = DEFAULT_WORKERS):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.seconds, self.memory = seconds, memory
        self._workers = [_Worker() for _ in range(max(1, workers))]
        self._free = threading.Condition()  # a worker freed, or a turn in the line passed on
        self._line: list[object] = []  # callers waiting for a worker, first come first served
        self._cache_lock = threading.Lock()
        self._done: OrderedDict = OrderedDict()  # (kind, source) -> TokenAutomaton | LarkGrammar
        self._refused: OrderedDict = OrderedDict()  # (kind, source) -> the refusal's line
        self._shortest: OrderedDict = OrderedDict()  # (kind, source) -> its shortest answer's characters
        self.closed = False
        self._waiting = 0  # compile() calls past the cache: waiting for a worker or in one
        self._token_chars: int | None = None

    @property
    def pids(self) -> list[int]:
        """The running workers' process ids."""
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.poll() is None]

    def token_chars(self) -> int:
        if self._token_chars is None:
            self._token_chars = longest_token(self.tokenizer.token_bytes(), self.vocab_size)
        return self._token_chars

    def compile(self, structure, cancelled: Callable[[], bool] | None = None, max_tokens: int | None = None):
        """`structure` compiled (from the cache when it was before); UsageError (one line) when it cannot be, or
        not within the budget, or (max_tokens given) when its shortest answer cannot fit max_tokens tokens;
        Cancelled when `cancelled()` turns true while it waits."""
        key = (structure.kind, structure.source)
        with self._cache_lock:
            if key in self._shortest and max_tokens is not None:
                self._check_fits(self._shortest[key], max_tokens)
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key]
            if key in self._refused:
                raise UsageError(self._refused[key])
        with self._cache_lock:
            if self._waiting >= MAX_WAITING:
                raise Busy(f"{self._waiting} structures are waiting to compile")
            self._waiting += 1
        try:
            structure.check_size()  # the rest of the checks run in the worker, under its budget
            if structure.kind == "regex" and max_tokens is not None:  # an expression's (a choice's) shortest match
                # is read here, in Python's linear parser, so that one too long waits for no worker
                self._check_fits(shortest_chars(unanchored(structure.source)), max_tokens)
            request = ("compile", structure.kind, structure.source, max_tokens)
            kind, result, shortest = self._in_worker(request, cancelled, key)
            with self._cache_lock:
                self._shortest[key] = shortest
                while len(self._shortest) > _REFUSED:
                    self._shortest.popitem(last=False)
            if max_tokens is not None:
                self._check_fits(shortest, max_tokens)  # not a refusal of the structure: another max_tokens fits
            if kind == "cached":
                return result
            if kind == "refused":
                raise UsageError(result)
            compiled = self._build(kind, result)
        except TooLong as e:
            raise UsageError(str(e)) from None
        except UsageError as e:
            if self.closed:  # stopped, not refused: nothing to remember
                raise Stopped("the structure's compile was stopped: shutting down") from None
            with self._cache_lock:
                self._refused[key] = str(e)
                while len(self._refused) > _REFUSED:
                    self._refused.popitem(last=False)
            raise
        finally:
            with self._cache_lock:
                self._waiting -= 1
        with self._cache_lock:
            self._done[key] = compiled
            while len(self._done) > _CACHED:
                self._done.popitem(last=False)
        return compiled

    def start(self) -> None:
        """Start the first worker now (it reads the vocabulary and walks it, `Compile.warm`), so that the first
        structure a client sends waits for neither (`dgemma serve` calls this at its start). The process is made on
        this thread, since a worker dies with the thread that made it (`_die_with_parent`): the caller's must
        outlive it; the vocabulary goes to it from a helper thread."""
        with self._free:
            worker = self._workers[0]
            if self.closed or worker.busy or (worker.proc is not None and worker.proc.poll() is None):
                return
            worker.busy = True
        try:
            worker.kill()
            worker.proc = self._spawn()
        except OSError:
            worker.kill()
            self._give_back(worker)
            return

        def send():
            try:
                self._send_vocabulary(worker.proc)
            except (BrokenPipeError, OSError):
                worker.kill()
            finally:
                if self.closed:  # closed meanwhile: close() may have looked before it was there
                    worker.kill()
                self._give_back(worker)

        threading.Thread(target=send, name="dgemma-compile-start", daemon=True).start()

    def _check_fits(self, shortest: int, max_tokens: int) -> None:
        if not fits(shortest, max_tokens, self.token_chars()):
            raise TooLong(too_long(shortest, max_tokens, self.token_chars()))

    def _build(self, kind: str, result):
        from .constrain import LarkGrammar, TokenAutomaton

        if kind == "tables":
            return TokenAutomaton(result)
        return LarkGrammar(result, self.tokenizer, self.vocab_size)

    def _start(self) -> subprocess.Popen:
        proc = self._spawn()
        self._send_vocabulary(proc)
        return proc

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "from dgemma_cli.structured.worker import _worker_main; "
                                 "_worker_main()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "DGEMMA_COMPILE_PARENT": str(os.getpid()),
                                     "PYTHONPATH": os.pathsep.join(filter(None, [_PROJECT_ROOT,
                                                                                 os.environ.get("PYTHONPATH")]))})

    def _send_vocabulary(self, proc: subprocess.Popen) -> None:
        hf = getattr(self.tokenizer, "_tokenizer", None)  # a dgemma Tokenizer's tokenizers.Tokenizer
        _send(proc.stdin, ("vocab", list(self.tokenizer.token_bytes()), self.vocab_size,
                           hf.to_str() if hasattr(hf, "to_str") else None))

    def _take_worker(self, cancelled) -> _Worker:
        """A free worker, in the order callers asked; polls `cancelled` (and the compiler's closing) meanwhile."""
        me = object()
        with self._free:
            self._line.append(me)
            try:
                while True:
                    self._check_waiting(cancelled)
                    if self._line[0] is me:
                        worker = next((w for w in self._workers if not w.busy), None)
                        if worker is not None:
                            worker.busy = True
                            return worker
                    self._free.wait(_POLL)
            finally:
                self._line.remove(me)
                self._free.notify_all()

    def _give_back(self, worker: _Worker) -> None:
        with self._free:
            worker.busy = False
            self._free.notify_all()

    def _in_worker(self, request, cancelled, key):
        """Send `request` to a free worker, wait for its answer within the budget; the worker is killed on any way
        out but the answer (so that nothing it was doing goes on). ("cached", compiled, shortest) when another
        caller compiled the same structure while this one waited for a worker (or ("refused", line, 0))."""
        worker = self._take_worker(cancelled)
        try:
            with self._cache_lock:
                if key in self._done:
                    return "cached", self._done[key], self._shortest.get(key, 0)
                if key in self._refused:
                    return "refused", self._refused[key], 0
            for attempt in (0, 1):  # a worker that ended between two compiles (killed, or out of memory): a new one
                try:
                    if worker.proc is None or worker.proc.poll() is not None:
                        worker.kill()
                        worker.proc = self._start()
                    proc = worker.proc
                    _send(proc.stdin, request)
                    break
                except (BrokenPipeError, OSError):
                    worker.kill()
                    if attempt:
                        raise UsageError("the structure's compile worker cannot be started") from None
            fd = proc.stdout.fileno()
            buf = bytearray()
            need = None
            deadline = time.monotonic() + self.seconds
            ok = False
            try:
                while True:
                    ready, _, _ = select.select([fd], [], [], _POLL)
                    if ready:
                        chunk = os.read(fd, 1 << 20)
                        if not chunk:
                            self._check_waiting(None)  # closed: say so (and cache nothing)
                            raise UsageError(f"the structure's compile failed (its worker ended; over "
                                             f"{_gib(self.memory)} of memory?)")
                        buf += chunk
                        if need is None and len(buf) >= 8:
                            need = 8 + struct.unpack("<Q", bytes(buf[:8]))[0]
                        if need is not None and len(buf) >= need:
                            ok = True
                            answer = pickle.loads(bytes(buf[8:need]))
                            return answer if len(answer) == 3 else (*answer, 0)  # a refusal: (refused, line)
                        continue
                    self._check_waiting(cancelled)
                    if time.monotonic() > deadline:
                        raise UsageError(f"the structure did not compile within {self.seconds:g} s "
                                         f"(--compile-timeout); simplify it (fewer or shorter bounded strings "
                                         f"and arrays)")
                    if _rss(proc.pid) > self.memory:
                        raise UsageError(f"the structure needs over {_gib(self.memory)} to compile "
                                         f"(--compile-memory); simplify it (fewer or shorter bounded strings and "
                                         f"arrays)")
            finally:
                if not ok:
                    worker.kill()
        finally:
            self._give_back(worker)

    def _check_waiting(self, cancelled) -> None:
        if self.closed:
            raise Stopped("the structure's compile was stopped: shutting down")
        if cancelled is not None and cancelled():
            raise Cancelled()

    def close(self) -> None:
        """Stop the workers now (whatever they compile fails at once) and refuse compiles from here on."""
        self.closed = True
        for worker in self._workers:
            proc = worker.proc
            if proc is not None and proc.poll() is None:
                proc.kill()

    def __del__(self):
        for worker in getattr(self, "_workers", ()):
            proc = worker.proc
            if proc is not None and proc.poll() is None:
                proc.kill()
