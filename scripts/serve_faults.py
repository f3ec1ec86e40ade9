"""The hostile inputs `dgemma serve` must survive, and a soak that sends them mixed with normal requests.

Each case is one HTTP request an attacker (or a web page, or a broken client) can send, with the answer the server
must give: a JSON error in the API's shape with that status and code, quickly, the server going on as before.
tests/test_serve_faults.py sends every case through a real server process and a real socket; this script's soak
starts its own server on the bundled demo model and sends `--requests` of them mixed with normal ones, then says
the server's memory as it went, the slowest `/health` while they ran, and whether every normal answer was right:

    .venv/bin/python scripts/serve_faults.py --requests 1000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NORMAL = {"model": "demo", "messages": [{"role": "user", "content": "upper: hello diffusions"}], "seed": 0}
NORMAL_ANSWER = "HELLO DIFFUSIONS"
JSON = {"Content-Type": "application/json"}


@dataclass
class Case:
    name: str
    body: bytes
    status: int
    code: str
    headers: dict = field(default_factory=lambda: dict(JSON))
    method: str = "POST"
    path: str = "/v1/chat/completions"
    heavy: bool = False  # large enough that /health is watched while it is answered
    says: str = ""  # words the error's message must hold (where the status and code alone would not tell)


def chat(**fields) -> bytes:
    return json.dumps({**NORMAL, **fields}).encode()


def cases() -> list[Case]:
    deep = 100_000
    return [
        # A web page reaching a loopback server.
        Case("Host of a rebinding page", b"", 403, "host_not_allowed", {"Host": "evil.example"}, "GET", "/v1/models"),
        Case("Host of a rebinding page, POST", chat(), 403, "host_not_allowed", {**JSON, "Host": "evil.example:80"}),
        Case("a foreign page's Origin", chat(), 403, "origin_not_allowed", {**JSON, "Origin": "http://evil.example"}),
        Case("a foreign page's preflight", b"", 403, "origin_not_allowed",
             {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}, "OPTIONS"),
        Case("text/plain body (no preflight needed)", chat(), 415, "unsupported_media_type",
             {"Content-Type": "text/plain"}),
        Case("body with no Content-Type", chat(), 415, "unsupported_media_type", {}),
        Case("form body", chat(), 415, "unsupported_media_type", {"Content-Type": "application/x-www-form-urlencoded"}),
        # JSON that parses but is no request.
        Case("malformed JSON", b'{"model": "demo", "messages": [', 400, "invalid_json"),
        Case("lone surrogate in content", chat(messages=[{"role": "user", "content": "\ud800"}]), 400, "invalid_json"),
        Case("lone surrogate in model", chat(model="\udfff"), 400, "invalid_json"),
        Case("lone surrogate in a key", b'{"model": "demo", "\\ud800": 1, "messages": []}', 400, "invalid_json"),
        Case("array nested 100,000 deep", b"[" * deep + b"]" * deep, 400, "invalid_json"),
        Case("object nested 100,000 deep", b'{"a":' * deep + b"1" + b"}" * deep, 400, "invalid_json"),
        # the body, its messages list and the message hold the 62 arrays: 65 deep, one past body.MAX_DEPTH
        Case("a body nested 65 deep", chat(messages=[{"role": "user", "content": "x", "extra": (
            json.loads("[" * 62 + "]" * 62))}]), 400, "invalid_json"),
        Case("max_tokens of 401 digits", chat()[:-1] + b', "max_tokens": 1' + b"0" * 400 + b"}", 400, "invalid_value"),
        Case("seed of 30 digits", chat()[:-1] + b', "seed": 1' + b"0" * 29 + b"}", 400, "invalid_value"),
        # Past 4300 digits Python's int() refuses the text itself, in words about Python's settings.
        Case("seed of 5,000 digits", chat()[:-1] + b', "seed": 1' + b"0" * 4999 + b"}", 400, "invalid_value",
             says="5000 digits; none may pass 2**64"),
        Case("model a number", chat(model=5), 400, "invalid_type", says="'model' must be a string"),
        Case("stream a string", chat(stream="yes"), 400, "invalid_type", says="'stream' must be true or false"),
        Case("temperature 1e400", chat()[:-1] + b', "temperature": 1e400}', 400, "invalid_type"),
        # Bombs.
        Case("one 19 MiB string", chat(messages=[{"role": "user", "content": "a" * (19 << 20)}]), 400,
             "context_length_exceeded", heavy=True),
        Case("300,000 one-character messages", chat(messages=[{"role": "user", "content": "a"}] * 300_000), 400,
             "invalid_json", heavy=True),
        Case("5,000 one-character messages", chat(messages=[{"role": "user", "content": "a"}] * 5_000), 400,
             "invalid_value"),
        Case("a body over 20 MiB", b'{"a": "' + b"x" * (21 << 20) + b'"}', 413, "request_too_large", heavy=True),
        Case("Content-Length over 20 MiB", b"{}", 413, "request_too_large", {**JSON, "Content-Length": str(1 << 40)}),
    ]


# ----------------------------------------------------------------------------- raw HTTP over one socket


def request(sock: socket.socket, host: str, case: Case) -> tuple[int, dict]:
    """Send `case` on an open keep-alive connection; (status, JSON body) of the answer."""
    headers = {"Host": host, "Content-Length": str(len(case.body)), **case.headers}
    head = f"{case.method} {case.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    try:
        sock.sendall(head.encode("latin-1") + case.body)
    except (BrokenPipeError, ConnectionResetError):  # the server answered (413) before the whole body was read
        pass
    return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection (got {data[:200]!r})")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-body")
        rest += chunk
    return status, json.loads(rest[:length])


def connect(url: str) -> tuple[socket.socket, str]:
    host, port = url.split("//")[1].rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=60)
    return sock, f"{host}:{port}"


def normal(sock: socket.socket, host: str) -> str:
    status, body = request(sock, host, Case("normal", chat(), 200, ""))
    if status != 200:
        raise AssertionError(f"a normal request got {status}: {body}")
    return body["choices"][0]["message"]["content"]


class HealthWatch:
    """Polls /health every `every` seconds on its own connection and keeps the slowest answer's time."""

    def __init__(self, url: str, every: float = 0.01):
        self.url, self.every = url, every
        self.slowest = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        sock, host = connect(self.url)
        try:
            while not self.stop.is_set():
                t = time.perf_counter()
                status, _ = request(sock, host, Case("health", b"", 200, "", {}, "GET", "/health"))
                self.slowest = max(self.slowest, time.perf_counter() - t)
                assert status == 200
                time.sleep(self.every)
        finally:
            sock.close()

    def __enter__(self) -> HealthWatch:
        self.thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


# ----------------------------------------------------------------------------- slow and vanishing clients


def partial_headers(url: str, sent: bytes = b"") -> socket.socket:
    """A client that opens a connection and sends `sent` (part of a request line or of its headers), then nothing:
    returned open."""
    sock, host = connect(url)
    if sent:
        sock.sendall(sent.replace(b"{host}", host.encode()))
    return sock


def closed_after(sock: socket.socket, within: float) -> tuple[float, bytes]:
    """Waits up to `within` seconds for the server to close `sock`: (seconds it took, what it sent first)."""
    t, data = time.perf_counter(), b""
    try:
        while True:
            sock.settimeout(max(0.01, t + within - time.perf_counter()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the connection was still open after {within} s (got {data[:200]!r})") from None
    return time.perf_counter() - t, data


def slow_client(url: str) -> socket.socket:
    """A client that announces a body and sends a few bytes of it, then nothing: returned open."""
    sock, host = connect(url)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 100000\r\n\r\n{{\"model\": ".encode())
    return sock


def vanishing_client(url: str, body: bytes) -> None:
    """A client that sends a whole request and closes the connection before the answer (a reset, not a FIN)."""
    sock, host = connect(url)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


# ----------------------------------------------------------------------------- a flood of large bodies


def flat_array_body(path: str, size: int = 20 << 20) -> bytes:
    """A body of `size` bytes that is mostly one flat array of numbers (millions of values, two brackets): for
    /v1/chat/completions an unknown field the server ignores, for Ollama's /api/generate its `context`."""
    if path.startswith("/api/"):
        head = b'{"model": "demo", "prompt": "upper: x", "stream": false, "context": ['
    else:
        head = b'{"model": "demo", "messages": [{"role": "user", "content": "upper: x"}], "junk": ['
    n = (size - len(head) - 2) // 4
    return head + b",".join([b"1e9"] * n) + b"]}"


def vm_hwm_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def flood(url: str, pid: int, path: str, clients: int = 8, body: bytes | None = None) -> dict:
    """`clients` connections POST the same large body (flat_array_body) to `path` at once, while /health is polled
    and a plain chat of 16 tokens is sent a moment after them. Returns the figures: each flood request's status and
    seconds, the plain chat's seconds and answer, the slowest /health, the server's resident memory before, its
    peak during (VmHWM, reset first) and after."""
    body = flat_array_body(path) if body is None else body
    case = Case("flood", body, 400, "", dict(JSON), "POST", path)
    sock, host = connect(url)
    normal(sock, host)  # warm
    time.sleep(0.5)
    before = rss_kb(pid)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM starts again from now
    results: list = [None] * clients

    def one(i: int) -> None:
        s, h = connect(url)
        t = time.perf_counter()
        try:
            status, answer = request(s, h, case)
            results[i] = (status, time.perf_counter() - t, answer)
        finally:
            s.close()

    with HealthWatch(url) as watch:
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the flood's bodies are on their way
        plain = Case("plain", json.dumps({**NORMAL, "max_tokens": 16}).encode(), 200, "")
        t0 = time.perf_counter()
        status, answer = request(sock, host, plain)
        plain_s = time.perf_counter() - t0
        for t in threads:
            t.join(120)
    peak = vm_hwm_kb(pid)
    time.sleep(1.0)
    after = rss_kb(pid)
    sock.close()
    return {"path": path, "statuses": [r[0] if r else None for r in results],
            "answers": [r[2] if r else None for r in results],
            "slowest_flood_s": max((r[1] for r in results if r), default=None), "plain_s": plain_s,
            "plain_status": status, "plain_answer": answer["choices"][0]["message"]["content"] if status == 200
            else answer, "slowest_health_s": watch.slowest, "rss_before_kb": before, "peak_kb": peak,
            "rss_after_kb": after}


def report_flood(out: dict) -> str:
    return (f"{out['path']}: {len(out['statuses'])} x {out['statuses'][0]}, slowest {out['slowest_flood_s']:.2f} s; "
            f"plain chat {out['plain_s']:.2f} s ({out['plain_status']}); slowest /health "
            f"{out['slowest_health_s'] * 1000:.0f} ms; server RSS {out['rss_before_kb'] / 1024:.0f} MB before, peak "
            f"{out['peak_kb'] / 1024:.0f} MB, {out['rss_after_kb'] / 1024:.0f} MB after")


# ----------------------------------------------------------------------------- slow structure compiles

# fits any max_tokens; takes seconds to compile on the demo's vocabulary (two ways to read every run of x)
SLOW_SCHEMA = {"type": "string", "pattern": "(.{1,30}|x{1,29}){1,17}"}


def timed_post(url: str, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict, float]:
    sock, host = connect(url)
    t = time.perf_counter()
    try:
        status, answer = request(sock, host, Case("timed", json.dumps(body).encode(), 0, "", dict(JSON), "POST", path))
    finally:
        sock.close()
    return status, answer, time.perf_counter() - t


def compile_contention(url: str, delay: float = 1.0) -> dict:
    """What slow structures cost other clients: a 59,000-character choice with max_tokens 32 and a 30,000-character
    one with max_tokens 16 (no answer that long fits), then a structure that compiles for its whole budget and, a
    `delay` later, a tiny expression from another client. Returns each one's (status, seconds)."""
    base = {**NORMAL, "max_tokens": 32}
    out = {}
    for name, body in (("choice_59000_in_32", {**base, "guided_choice": ["B" * 59000]}),
                       ("choice_30000_in_16", {**base, "max_tokens": 16, "guided_choice": ["B" * 30000]})):
        status, answer, seconds = timed_post(url, body)
        out[name] = (status, seconds, answer)
    slow: list = []
    thread = threading.Thread(target=lambda: slow.append(timed_post(url, {**base, "guided_json": SLOW_SCHEMA})))
    thread.start()
    time.sleep(delay)
    status, answer, seconds = timed_post(url, {**base, "guided_regex": "[A-Z]{3}"})
    out["tiny_regex_behind_a_slow_one"] = (status, seconds, answer)
    thread.join(300)
    out["slow"] = (slow[0][0], slow[0][2], slow[0][1])
    return out


def report_compile(out: dict) -> str:
    return "; ".join(f"{name}: {status} in {seconds:.2f} s" for name, (status, seconds, _) in out.items())


# ----------------------------------------------------------------------------- the soak


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "HOME": str(home), "DGEMMA_HOME": str(home / "dgemma"), "HF_HUB_OFFLINE": "1"}
    env.pop("DGEMMA_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_cli", "serve", "--model", "demo", "--device", "cpu",
                             "--port", "0"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "serving demo at" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, line.split(" at ")[1].split("/v1")[0]
    raise RuntimeError("the server did not start")


def soak(url: str, pid: int, n: int, seed: int = 0, report=print) -> dict:
    """n requests, a third of them normal, the rest hostile cases drawn at random, all on one keep-alive
    connection (reopened where the server rightly closes it). Returns the figures."""
    rng = random.Random(seed)
    battery = cases()
    sock, host = connect(url)
    normal(sock, host)  # warm: the first generation allocates the sampler's buffers
    start = rss_kb(pid)
    marks, wrong = [], 0
    with HealthWatch(url) as watch:
        for i in range(n):
            if i % 3 == 0:
                wrong += normal(sock, host) != NORMAL_ANSWER
            else:
                case = rng.choice(battery)
                status, body = request(sock, host, case)
                assert (status, body["error"]["code"]) == (case.status, case.code), (case.name, status, body)
                assert case.says in body["error"]["message"], (case.name, body)
                if case.status == 413:  # the server closes a connection whose body it did not read
                    sock.close()
                    sock, host = connect(url)
            if (i + 1) % max(1, n // 10) == 0:
                marks.append((i + 1, rss_kb(pid)))
                report(f"{i + 1:5d} requests: server RSS {marks[-1][1] / 1024:.0f} MB")
    sock.close()
    return {"start_kb": start, "marks": marks, "slowest_health_s": watch.slowest, "wrong_answers": wrong}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compiles", action="store_true", help="instead of the soak: choices too long for max_tokens, "
                    "then a tiny expression sent while another client's structure compiles for its whole budget")
    ap.add_argument("--flood", action="store_true", help="instead of the soak: 8 clients each POST a 20 MiB flat "
                    "array at once, to /v1/chat/completions then to /api/generate (its context), with /health and a "
                    "plain chat timed meanwhile")
    args = ap.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as home:
        proc, url = start_server(Path(home))
        try:
            if args.compiles:
                print(report_compile(compile_contention(url)), flush=True)
                return 0
            if args.flood:
                for path in ("/v1/chat/completions", "/api/generate"):
                    print(report_flood(flood(url, proc.pid, path)), flush=True)
                return 0
            out = soak(url, proc.pid, args.requests, args.seed)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    first, last = out["marks"][0][1], out["marks"][-1][1]
    print(f"server RSS after warm-up {out['start_kb'] / 1024:.0f} MB; after {out['marks'][0][0]} requests "
          f"{first / 1024:.0f} MB; after {out['marks'][-1][0]} {last / 1024:.0f} MB "
          f"(max {max(m[1] for m in out['marks']) / 1024:.0f} MB); slowest /health "
          f"{out['slowest_health_s'] * 1000:.0f} ms; wrong normal answers {out['wrong_answers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
