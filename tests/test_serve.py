"""`dgemma serve`: a real server process on the demo model, driven through the official `openai` client.

Every answer is compared with the same request run alone in this process (`Engine.generate` / `Engine.infill`
after seeding torch's global generator): batching must not change a single token. The servers listen on loopback
only, on a port the OS picks (`--port 0`, read from the server's stderr).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from dgemma_cli.engine import load  # noqa: E402
from dgemma_cli.server.protocol import MAX_BODY  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["hello diffusions", "abc def 12 ghijk", "the quick brown ", "lorem ipsum dolo", "zz top rocks 123",
         "a b c d e f g hi", "seven 7 eight 88", "mixed case words"]


class ServerProcess:
    """`dgemma serve` in a subprocess; stderr is read in a thread (it says the port, then errors, if any)."""

    def __init__(self, home: Path, *args: str, model: str = "demo", name: str | None = None):
        """name: the id the server serves the model as (default: `model`, a bundled model's name)."""
        env = {**os.environ, "HOME": str(home), "DGEMMA_HOME": str(home / "dgemma"), "HF_HUB_OFFLINE": "1"}
        env.pop("DGEMMA_API_KEY", None)
        self.model = name or model
        cmd = [sys.executable, "-m", "dgemma_cli", "serve", "--model", model, "--device", "cpu", "--port", "0",
               *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(90) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        line = next(x for x in self.lines if f"serving {self.model} at" in x)
        self.url = line.split(" at ")[1].split("/v1")[0]
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if f"serving {self.model} at" in line:
                self.ready.set()
        self.ready.set()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=kw.pop("timeout", 60), **kw)

    def health(self) -> dict:
        return self.http.get("/health").json()

    def vm_hwm_kb(self) -> int:
        """The server process's peak resident memory (Linux)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("serve"), "--max-batch", "8", "--max-queue", "64")
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def engine():
    return load("demo", device="cpu", dtype="float32")


def refuses_connections(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.ConnectError:
        return True
    return False


def wait_until(check, timeout: float = 30, every: float = 0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out")


# ----------------------------------------------------------------------------- the API through the openai client


def test_models_lists_the_served_model(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_answers_as_the_request_run_alone(server, engine):
    client = server.client()
    for seed, word in [(0, "hello diffusions"), (7, "abc def 12 ghijk")]:
        prompt = f"upper: {word}"
        alone = engine.generate(prompt, seed=seed)
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}], seed=seed)
        assert r.choices[0].message.content == alone.texts[0]
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len(alone.token_ids[0])
        assert r.usage.prompt_tokens == len(alone.prompt_token_ids[0])
        extra = dict(r.model_extra["dgemma"])
        assert 0 < extra.pop("seconds") < 60  # from its admission to its last step
        assert extra == {"seed": seed, "steps_per_canvas": alone.steps_per_canvas[0]}
    assert r.choices[0].message.content == "ABC DEF 12 GHIJK"


def test_chat_streamed_one_chunk_per_canvas(server, engine):
    client = server.client()
    prompt = "upper: hello diffusions"
    alone = engine.generate(prompt, seed=0, max_new_tokens=64)
    chunks = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                                 seed=0, max_tokens=64, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == alone.texts[0] == "HELLO DIFFUSIONS"
    assert 1 <= len(texts) <= len(alone.steps_per_canvas[0])  # at most one piece of text per finished canvas
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(alone.token_ids[0])


def test_stop_strings_and_max_tokens(server, engine):
    client = server.client()
    msg = [{"role": "user", "content": "upper: hello diffusions"}]
    r = client.chat.completions.create(model="demo", messages=msg, seed=0, stop=["DIFF"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("HELLO ", "stop")
    streamed = client.chat.completions.create(model="demo", messages=msg, seed=0, stop="FUS", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "HELLO DIF"
    r = client.chat.completions.create(model="demo", messages=msg, seed=0, max_tokens=5)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("HELLO", "length")
    assert r.choices[0].message.content == engine.generate(msg[0]["content"], seed=0, max_new_tokens=5).texts[0]


def test_guided_choice_and_structured_outputs(server, engine):
    """vLLM's guided_choice (exactly one of its strings) and structured_outputs' keys hold the answer as
    guided_regex and guided_json do; a choice the model would not write alone still comes out whole."""
    client = server.client()
    msg = [{"role": "user", "content": "upper: hello diffusions"}]
    choices = ["HELLO DIFFUSIONS", "HELLO (WORLD)?", "a.b*c"]
    for body in [{"guided_choice": choices, "guided_decoding_backend": "xgrammar"},
                 {"structured_outputs": {"choice": choices}}]:
        r = client.chat.completions.create(model="demo", messages=msg, seed=0, max_tokens=32, extra_body=body)
        assert r.choices[0].message.content == "HELLO DIFFUSIONS" and r.choices[0].finish_reason == "stop"
    for seed in range(2):  # metacharacters are literal: the answer is one of the strings, never a match of them
        r = client.chat.completions.create(model="demo", messages=msg, seed=seed, max_tokens=32,
                                           extra_body={"guided_choice": ["HELLO (WORLD)?", "a.b*c"]})
        assert r.choices[0].message.content in ("HELLO (WORLD)?", "a.b*c")
    r = client.chat.completions.create(model="demo", messages=msg, seed=0, max_tokens=32,
                                       extra_body={"structured_outputs": {"regex": "[A-Z]{3}", "grammar": None,
                                                                          "disable_any_whitespace": False}})
    assert r.choices[0].message.content == "HEL"
    schema = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 4}}, "required": ["w"]}
    r = client.completions.create(model="demo", prompt="upper: abc\n", seed=0, max_tokens=32,
                                  extra_body={"structured_outputs": {"json": schema}})
    assert set(json.loads(r.choices[0].text)) == {"w"}
    r = client.chat.completions.create(model="demo", messages=msg, seed=0, max_tokens=32,
                                       extra_body={"structured_outputs": {"json_object": True}})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_default_max_tokens_is_the_context_the_prompt_leaves_bounded(server, engine):
    """A request without max_tokens may run past the checkpoint's max_new_tokens (32 on the demo, one canvas) up to
    16 canvases, or what the context leaves after the prompt; /v1/models says which."""
    C, ctx = engine.config.canvas_length, engine.config.text.max_position_embeddings
    card = server.http.get("/v1/models/demo").json()
    assert (card["max_model_len"], card["default_max_tokens"]) == (ctx, 16 * C)
    client = server.client()
    # "hello" as a raw prompt never ends on the demo: it runs to the bound (a few steps a canvas, to be quick)
    r = client.completions.create(model="demo", prompt="hello", seed=11, extra_body={"steps": 2})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (16 * C, "length")
    # a prompt that leaves three canvases of context gets those
    prompt = [engine.tokenizer.token_id("a")] * (ctx - 3 * C - 5)
    r = client.completions.create(model="demo", prompt=prompt, seed=0, extra_body={"steps": 2})
    assert r.usage.completion_tokens <= 3 * C
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt=prompt, seed=0, max_tokens=4 * C)
    assert e.value.code == "context_length_exceeded"


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_completion_with_suffix_equals_dgemma_fim(server, tmp_path):
    client = server.client()
    cases = [("upper: abc def 12 ghijk\nABC D", "HIJK\n", 3), ("upper: hello diffusions\nHELLO ", "USIONS\n", 0)]
    for prefix, suffix, seed in cases:
        f = tmp_path / f"hole{seed}.txt"
        f.write_text(prefix + "<FILL>" + suffix)
        cli = subprocess.run([sys.executable, "-m", "dgemma_cli", "fim", str(f), "--stdout", "--seed", str(seed),
                              "--model", "demo", "--device", "cpu"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert cli.returncode == 0, cli.stderr
        r = client.completions.create(model="demo", prompt=prefix, suffix=suffix, seed=seed)
        assert prefix + r.choices[0].text + suffix == cli.stdout
    assert cli.stdout == "upper: hello diffusions\nHELLO DIFFUSIONS\n"


def test_raw_completion_streamed_equals_the_single_run(server, engine):
    client = server.client()
    alone = engine.generate("hello", raw=True, seed=11, max_new_tokens=96)
    whole = client.completions.create(model="demo", prompt="hello", seed=11, max_tokens=96)
    parts = client.completions.create(model="demo", prompt="hello", seed=11, max_tokens=96, stream=True)
    assert whole.choices[0].text == alone.texts[0]
    pieces = [c.choices[0].text for c in parts if c.choices and c.choices[0].text]
    assert "".join(pieces) == alone.texts[0]
    # One piece per canvas that settled text: an answer of several canvases arrives in several pieces, each the
    # text its canvas settled (a server that sent the whole answer at the end would give one piece).
    C = engine.config.canvas_length
    canvases = len(alone.steps_per_canvas[0])
    assert canvases >= 3 and len(pieces) >= 2
    settled = [engine.tokenizer.decode(alone.token_ids[0][: C * (k + 1)]) for k in range(canvases)]
    assert all(any(s.startswith("".join(pieces[: i + 1])) for s in settled) for i in range(len(pieces)))


def test_per_step_stream_shows_the_canvas_sharpening(server, engine):
    client = server.client()
    prompt = "upper: lorem ipsum dolo"
    alone = engine.generate(prompt, seed=5)
    C = engine.config.canvas_length
    steps, text = [], ""
    for c in client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}], seed=5,
                                            stream=True, extra_body={"stream_steps": True}):
        step = (c.model_extra or {}).get("dgemma_step")
        if step is not None:
            assert not text, "step chunks of a canvas come before its text"
            steps.append(step)
        elif c.choices and c.choices[0].delta.content:
            text += c.choices[0].delta.content
    assert text == alone.texts[0]
    assert [s["step"] for s in steps] == list(range(1, alone.steps_per_canvas[0][0] + 1))
    for s in steps:
        assert len(s["tokens"]) == len(s["pieces"]) == len(s["accepted"]) == len(s["confidence"]) == C
        assert any(s["accepted"]) and all(0 <= x <= 1 for x in s["confidence"])
        assert s["max_steps"] == engine.settings.max_denoising_steps and s["canvas"] == 0
    # The last step accepts what the answer says, with more confidence than the first.
    last, first = steps[-1], steps[0]
    mean = lambda s: sum(s["confidence"]) / C  # noqa: E731
    assert mean(last) > mean(first)


@pytest.mark.parametrize("fields,settings", [
    ({"steps": 3}, {"max_denoising_steps": 3}),
    ({"entropy_bound": 0.02}, {"entropy_bound": 0.02}),
    ({"temperature": 1.7}, {"t_min": 0.4 * 1.7, "t_max": 0.8 * 1.7}),  # scales the schedule (1 keeps it)
])  # temperature 0 (greedy): tests/test_serve_faults.py
def test_diffusion_settings_as_extra_fields(server, engine, fields, settings):
    """Each field reaches the sampler: the answer and its steps equal the engine's with that setting and differ from
    the request without it (a prompt the demo is unsure of, so that the settings matter), so a server that ignored
    the field would fail here."""
    client = server.client()
    prompt = "what is this? ~~"
    base = engine.generate(prompt, seed=2, max_new_tokens=48)
    alone = engine.generate(prompt, seed=2, max_new_tokens=48, **settings)
    assert (alone.texts, alone.steps_per_canvas) != (base.texts, base.steps_per_canvas)
    temperature = fields.pop("temperature", None)
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}], seed=2,
                                       max_tokens=48, extra_body=fields, **({} if temperature is None else
                                                                            {"temperature": temperature}))
    assert r.choices[0].message.content == alone.texts[0]
    assert r.model_extra["dgemma"]["steps_per_canvas"] == alone.steps_per_canvas[0]


# ----------------------------------------------------------------------------- faults


def test_bad_requests_get_json_errors_and_the_server_keeps_answering(server):
    http = server.http
    ok = {"model": "demo", "messages": [{"role": "user", "content": "upper: hello diffusions"}], "seed": 0}
    cases = [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        ({**ok, "max_tokens": "ten"}, 400, "invalid_type", "max_tokens"),
        ({**ok, "max_tokens": True}, 400, "invalid_type", "max_tokens"),
        ({**ok, "messages": "hi"}, 400, "invalid_type", "messages"),
        ({**ok, "messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value", "messages[0].role"),
        ({**ok, "temperature": "hot"}, 400, "invalid_type", "temperature"),
        ({**ok, "temperature": -0.5}, 400, "invalid_value", "temperature"),
        ({**ok, "temperature": 2.5}, 400, "invalid_value", "temperature"),
        ({**ok, "seed": 1.5}, 400, "invalid_type", "seed"),
        ({**ok, "n": 2}, 400, "unsupported_parameter", "n"),
        ({**ok, "top_logprobs": 2}, 400, "invalid_value", "top_logprobs"),  # without logprobs: true
        ({**ok, "echo": True}, 400, "unsupported_parameter", "echo"),
        ({**ok, "guided_whitespace_pattern": " "}, 400, "unsupported_parameter", "guided_whitespace_pattern"),
        ({**ok, "structured_outputs": {"structural_tag": {}}}, 400, "unsupported_parameter",
         "structured_outputs.structural_tag"),
        ({**ok, "structured_outputs": {"choice": []}}, 400, "invalid_type", "structured_outputs.choice"),
        ({**ok, "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "invalid_value",
         "structured_outputs.regex"),
        ({**ok, "guided_choice": "A"}, 400, "invalid_type", "guided_choice"),
        ({**ok, "guided_regex": "(a)\\1"}, 400, "invalid_value", "guided_regex"),  # in the API's words, below
        ({**ok, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400, "invalid_value", "tools"),
        ({**ok, "functions": [{"name": "f"}]}, 400, "unsupported_parameter", "functions"),
        ({**ok, "stop": [1]}, 400, "invalid_type", "stop"),
        ({**ok, "steps": 0}, 400, "invalid_value", "steps"),
        ({**ok, "model": "gpt-4"}, 404, "model_not_found", "model"),
        ({**ok, "messages": [{"role": "user", "content": "x" * 5000}]}, 400, "context_length_exceeded", "messages"),
        ({**ok, "max_tokens": 10**6}, 400, "context_length_exceeded", "messages"),
        (b"{" + b" " * MAX_BODY + b"}", 413, "request_too_large", None),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
         400, "unsupported_parameter", "messages[0].content"),  # the demo model has no vision tower
    ]
    for body, status, code, param in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post("/v1/chat/completions", content=data, headers={"content-type": "application/json"})
        assert r.status_code == status, (body if isinstance(body, dict) else body[:40], r.text)
        err = r.json()["error"]
        assert (err["code"], err["param"]) == (code, param), err
        assert err["message"] and err["type"] == "invalid_request_error"
        assert "--" not in err["message"], err  # the CLI's flags are not this API's fields
    r = http.post("/v1/completions", json={"model": "demo", "prompt": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = http.get("/nowhere")
    assert r.status_code == 404 and "error" in r.json()
    # Through the client too: the same errors as the API's exceptions.
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=ok["messages"], max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=ok["messages"])
    r = client.chat.completions.create(model="demo", messages=ok["messages"], seed=0)
    assert r.choices[0].message.content == "HELLO DIFFUSIONS"
    assert server.health()["failed"] == 0


LONG = {"model": "demo", "prompt": "hello", "max_tokens": 2048, "stream": True, "stream_steps": True}


def test_a_client_dropping_mid_stream_frees_its_slot(server):
    before = server.health()
    with server.http.stream("POST", "/v1/completions", json={**LONG, "seed": 1}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any('"dgemma_step"' in x for x in got)
        assert server.health()["active"] == 1
    # Gone: the row leaves at the loop's next step, long before its 64 canvases would have finished.
    wait_until(lambda: server.health()["active"] == 0, timeout=10)
    after = server.health()
    assert after["completed"] == before["completed"] and after["failed"] == 0
    # A non-streamed request whose client goes away is dropped too: sent whole, then the connection closed while
    # it is generated (checked active first, so the test does not depend on how fast this machine generates).
    import socket

    body = json.dumps({**LONG, "stream": False, "stream_steps": False, "seed": 2}).encode()
    host, port = server.url.split("//")[1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_until(lambda: server.health()["active"] == 1, timeout=10)
    sock.close()
    wait_until(lambda: server.health()["active"] == 0, timeout=10)
    assert server.health()["completed"] == before["completed"]
    r = server.client().chat.completions.create(model="demo", seed=0,
                                                messages=[{"role": "user", "content": "upper: hello diffusions"}])
    assert r.choices[0].message.content == "HELLO DIFFUSIONS"


@pytest.mark.slow
def test_queue_full_429_api_key_and_sigterm_drain(tmp_path, engine):
    s = ServerProcess(tmp_path, "--max-batch", "2", "--max-queue", "1", "--api-key", "sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="sesame!").models.list()
        client = s.client(api_key="sesame")
        assert [m.id for m in client.models.list().data] == ["demo"]
        # Two streams that would run for a minute or more hold the two rows, and a third request holds the queue's
        # one place; no row can leave before the streams are closed, so the fourth is refused with 429 however slowly
        # this machine runs beside other work (three short requests left a window of seconds, which a loaded CI missed).
        streams = [client.completions.create(model="demo", prompt="hello", seed=seed, max_tokens=4000, stream=True)
                   for seed in (1, 2)]
        wait_until(lambda: s.health()["active"] == 2)
        pool = ThreadPoolExecutor(1)
        queued = pool.submit(client.completions.create, model="demo", prompt="hello", seed=3, max_tokens=96)
        wait_until(lambda: s.health()["queued"] == 1)
        r = s.http.post("/v1/completions", json={"model": "demo", "prompt": "hello"},
                        headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        # SIGTERM with the third still queued: the server drains. The streams' clients leave, which frees their rows;
        # the queued request then runs to its end and is answered; then the process exits 0.
        assert not queued.done()
        s.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: refuses_connections(s.url))  # the listener is closed: the drain has begun
        for stream in streams:
            stream.close()
        answer = queued.result(timeout=120)
        assert s.proc.wait(60) == 0, "".join(s.lines)
        assert answer.choices[0].text == engine.generate("hello", raw=True, seed=3, max_new_tokens=96).texts[0]
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health", timeout=5)
        assert not any("Traceback" in x for x in s.lines), "".join(s.lines)
    finally:
        s.stop()


def test_non_loopback_host_needs_an_api_key():
    r = subprocess.run([sys.executable, "-m", "dgemma_cli", "serve", "--host", "0.0.0.0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "DGEMMA_API_KEY": ""})
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--api-key" in r.stderr and "Traceback" not in r.stderr
    for bad in (["--max-batch", "0"], ["--port", "70000"], ["--max-queue", "-1"]):
        r = subprocess.run([sys.executable, "-m", "dgemma_cli", "serve", *bad], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (bad, r.stderr)


# ----------------------------------------------------------------------------- the loop, in this process


def test_a_failing_request_fails_alone(engine):
    from dgemma_cli.server.batching import BatchLoop, Job, RowDone, RowFailed

    loop = BatchLoop(engine.model, max_batch=4, max_queue=4)
    try:
        got: dict[str, list] = {"bad": [], "good": []}
        done = threading.Event()

        def sink(name):
            def deliver(ev):
                if isinstance(ev, (RowDone, RowFailed)):
                    got[name].append(ev)
                    if got["bad"] and got["good"]:
                        done.set()
            return deliver

        ids = engine.prompt_ids("upper: hello diffusions")
        loop.submit(Job(ids, engine.settings, 0, capacity=4), sink("bad"))  # a cache too small for the prompt
        loop.submit(Job(ids, engine.settings, 0, engine.check_context(len(ids), engine.settings)), sink("good"))
        assert done.wait(30)
        assert isinstance(got["bad"][0], RowFailed) and "KV cache" in got["bad"][0].message
        assert engine.tokenizer.decode(got["good"][0].token_ids) == "HELLO DIFFUSIONS"
    finally:
        loop.close()
    assert loop.stopped


def _run_jobs(loop, jobs: list) -> list:
    """Submit jobs to a BatchLoop at once (the loop admits them together); each job's last event (RowDone or
    RowFailed), in order."""
    from dgemma_cli.server.batching import RowDone, RowFailed

    ends: list = [None] * len(jobs)
    done = threading.Semaphore(0)

    def sink(i):
        def deliver(ev):
            if isinstance(ev, (RowDone, RowFailed)):
                ends[i] = ev
                done.release()
        return deliver

    with loop.cond:  # the loop's lock (reentrant: submit takes it too) until every job is queued
        for i, job in enumerate(jobs):
            loop.submit(job, sink(i))
    for _ in jobs:
        assert done.acquire(timeout=60)
    return ends


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_stop_tests_read_a_step_late_answer_as_at_once(engine):
    """The rows' stop tests read one step late (what the loop does on a GPU: no device-to-host wait in a step),
    against reading them at once and against the single run: the same tokens and steps per canvas for every row,
    three canvases of one row among them (its generator put back after each undone step, so its next canvases draw
    what they would have); the step after a canvas ended was run and undone for the lagged rows, never for a row
    that streams its steps (the host reads those anyway)."""
    import dataclasses

    from dgemma_cli.server.batching import BatchLoop, Job, RowDone

    C, V = engine.model.cfg.canvas_length, engine.model.cfg.text.vocab_size
    endless = dataclasses.replace(engine.settings, max_new_tokens=3 * C, eos_token_ids=(V + 1,))
    cases = [("upper: hello diffusions", 1, engine.settings, False), ("sudoku: ..4./..../.2.1/3...", 0,
             engine.settings, False), ("upper: a b c d", 5, endless, False),
             ("sudoku: 1.../..4./.3../...2", 2, engine.settings, True)]

    def jobs():
        out = []
        for p, seed, settings, steps in cases:
            ids = engine.prompt_ids(p)
            out.append(Job(ids, settings, seed, engine.check_context(len(ids), settings), want_steps=steps))
        return out

    runs = {}
    for lagged in (False, True):
        loop = BatchLoop(engine.model, max_batch=4, max_queue=4, lagged=lagged)
        try:
            ends = _run_jobs(loop, jobs())
        finally:
            loop.close()
        assert all(isinstance(e, RowDone) for e in ends)
        runs[lagged] = ([e.token_ids for e in ends], [e.steps_per_canvas for e in ends], loop.discarded)
    assert runs[True][:2] == runs[False][:2]
    assert runs[False][2] == 0 and runs[True][2] >= 3
    assert len(runs[True][1][2]) == 3  # the endless row's three canvases
    alone = engine.generate("upper: a b c d", seed=5, max_new_tokens=3 * C, eos_token_ids=(V + 1,))
    assert runs[True][0][2] == alone.token_ids[0] and runs[True][1][2] == alone.steps_per_canvas[0]


def test_a_lagged_rows_undone_step_changes_nothing(engine, monkeypatch):
    """The step run after a lagged row's canvas ended (its stop test not read yet) is undone: whatever the model
    guesses in it, the row keeps its canvas and argmax. Here that step's draws and argmax are all one other token
    (the demo model's guess would not have moved): the tokens are still those of the immediate test."""
    import torch

    from dgemma_cli.server import batching
    from dgemma_cli.server.batching import BatchLoop, Job, RowDone

    V = engine.model.cfg.text.vocab_size
    real, moved = batching._Row.settle, []

    def settle(row, sample, argmax, entropy):
        if row.lagged and bool(row.done.all()):  # the canvas ended a step ago: this step is the undone one
            moved.append(row.ci)
            sample, argmax = torch.full_like(sample, V - 1), torch.full_like(argmax, V - 1)
        return real(row, sample, argmax, entropy)

    def tokens(lagged: bool) -> list:
        ids = [engine.prompt_ids(p) for p in ("upper: hello diffusions", "sudoku: ..4./..../.2.1/3...")]
        jobs = [Job(i, engine.settings, seed, engine.check_context(len(i), engine.settings)) for seed, i in
                enumerate(ids)]
        loop = BatchLoop(engine.model, max_batch=2, max_queue=2, lagged=lagged)
        try:
            ends = _run_jobs(loop, jobs)
        finally:
            loop.close()
        assert all(isinstance(e, RowDone) for e in ends)
        return [e.token_ids for e in ends]

    at_once = tokens(False)
    monkeypatch.setattr(batching._Row, "settle", settle)
    assert tokens(True) == at_once
    assert moved  # a canvas stopped early, and its undone step ran


@pytest.mark.gpu
def test_stop_tests_read_a_step_late_on_a_gpu():
    """On CUDA the loop reads its rows' stop tests a step late by default: one request at a time (a GPU's bits depend
    on the batch's shape, so rows are compared alone), the same tokens and steps as the immediate test, over three
    canvases, with the undone steps counted."""
    import dataclasses

    from dgemma_cli.server.batching import BatchLoop, Job

    engine = load("demo", device="cuda", dtype="bfloat16")
    C, V = engine.model.cfg.canvas_length, engine.model.cfg.text.vocab_size
    endless = dataclasses.replace(engine.settings, max_new_tokens=3 * C, eos_token_ids=(V + 1,))
    ids = engine.prompt_ids("upper: a b c d")
    runs = {}
    for lagged in (None, False):  # None: the default, lagged on CUDA
        loop = BatchLoop(engine.model, max_batch=1, max_queue=1, lagged=lagged)
        try:
            end = _run_jobs(loop, [Job(ids, endless, 5, engine.check_context(len(ids), endless))])[0]
        finally:
            loop.close()
        runs[lagged] = (end.token_ids, end.steps_per_canvas, loop.discarded, loop.lagged)
    assert runs[None][:2] == runs[False][:2] and len(runs[None][1]) == 3
    assert runs[None][3] and runs[None][2] >= 1 and runs[False][2] == 0


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_a_row_whose_forward_raises_fails_alone_mid_batch(engine, monkeypatch, capfd):
    """Four requests in one batch. Any forward that holds the third one's row at its third step or later raises (a
    row whose own input breaks the network): the batched step fails, each row then runs that step alone; the third
    fails with one line on stderr and an error that names no exception text, the others run on (two of them
    mid-canvas) and answer token for token what they answer alone. Then every batched forward raises: each row runs
    every step alone, the answers are still the alone ones, and that failure is said once."""
    import dgemma_cli.server.batching as batching
    from dgemma_cli.server.batching import BatchLoop, Job, RowDone, RowFailed

    prompts = [("sudoku: ..4./..../.2.1/3...", 0), ("upper: hello diffusions", 1),
               ("sudoku: 1.../..4./.3../...2", 666), ("sudoku: ..1./4.../...3/.2..", 2)]
    alone = [engine.generate(p, seed=seed).token_ids[0] for p, seed in prompts]

    def jobs():
        out = []
        for p, seed in prompts:
            ids = engine.prompt_ids(p)
            out.append(Job(ids, engine.settings, seed, engine.check_context(len(ids), engine.settings)))
        return out

    real = batching.denoise_rows

    def row_breaks(rows) -> str | None:
        return f"broken by a row, {len(rows)} in the forward" if any(r.job.seed == 666 and r.steps >= 2
                                                                      for r in rows) else None

    def batch_breaks(rows) -> str | None:
        return "broken by batching" if len(rows) > 1 else None

    broken = {"now": row_breaks}

    def denoise_rows(model, rows, *args, **kw):
        if why := broken["now"](rows):
            raise RuntimeError(f"{why}\nsecond line")
        return real(model, rows, *args, **kw)

    monkeypatch.setattr(batching, "denoise_rows", denoise_rows)
    loop = BatchLoop(engine.model, max_batch=4, max_queue=4)
    try:
        capfd.readouterr()
        ends = _run_jobs(loop, jobs())
        assert isinstance(ends[2], RowFailed)
        assert [e.token_ids for k, e in enumerate(ends) if k != 2] == [a for k, a in enumerate(alone) if k != 2]
        assert (loop.failed, loop.completed, loop.peak_batch) == (1, 3, 4)
        err = capfd.readouterr().err
        assert err == "dgemma: internal error in a generation: RuntimeError: broken by a row, 1 in the forward\n"
        broken["now"] = batch_breaks
        ends = _run_jobs(loop, jobs())
        assert all(isinstance(e, RowDone) for e in ends) and [e.token_ids for e in ends] == alone
        err = capfd.readouterr().err
        assert err == ("dgemma: internal error in a step of 4 rows together (each ran alone instead): RuntimeError: "
                       "broken by batching\n")
        assert (loop.failed, loop.completed) == (1, 7)
    finally:
        loop.close()
    assert loop.stopped


# ----------------------------------------------------------------------------- adapters and the base in one batch


SUDOKU = ["sudoku: ..4./..../.2.1/3...", "sudoku: 1.../..4./.3../...2", "sudoku: ..1./4.../...3/.2.."]


@pytest.fixture(scope="module")
def adapter_server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("serve-adapter"), "--adapter", "sudoku=demo-sudoku-lora",
                      "--max-batch", "4")
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.mark.slow
def test_adapter_and_base_rows_mixed_at_any_step_answer_as_alone(adapter_server, engine):
    """Requests for the base and for an adapter (one that adapts the self-conditioning MLP too), four at a time,
    each sent a little after the others: rows join while others are mid-canvas, so one forward holds rows of both
    models, some at their first step and some self-conditioned. Every answer is the one the request gets alone.
    At most 12 steps a canvas keeps it fast; the base on a puzzle and the adapter on text take all 12."""
    from dgemma_cli.checkpoint.names import resolve_adapter

    engines = {"demo": engine, "sudoku": load("demo", device="cpu", dtype="float32",
                                              adapters=[resolve_adapter("demo-sudoku-lora")], adapter_slots=[1])}
    rnd = random.Random(1)
    prompts = SUDOKU + [f"upper: {w}" for w in WORDS[:3]]
    rounds = [[(rnd.choice(["demo", "sudoku"]), rnd.choice(prompts), rnd.randrange(3), rnd.uniform(0, 0.03))
               for _ in range(4)] for _ in range(20)]
    alone = {q[:3]: engines[q[0]].generate(q[1], seed=q[2], max_denoising_steps=12).texts[0]
             for r in rounds for q in r}
    http, before = adapter_server.http, adapter_server.health()

    def ask(q: tuple) -> tuple[int, str]:
        model, prompt, seed, after = q
        time.sleep(after)
        r = http.post("/v1/chat/completions", json={"model": model, "seed": seed, "steps": 12,
                                                    "messages": [{"role": "user", "content": prompt}]})
        return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text

    with ThreadPoolExecutor(4) as pool:
        for r in rounds:
            assert list(pool.map(ask, r)) == [(200, alone[q[:3]]) for q in r], r
    after = adapter_server.health()
    assert after["failed"] == 0 and after["completed"] - before["completed"] == 80
    rows = (after["row_forwards"] - before["row_forwards"]) / (after["forwards"] - before["forwards"])
    assert rows > 1.5, f"mean batch {rows:.2f}: requests were not batched"
    assert not any("internal error" in line for line in adapter_server.lines), "".join(adapter_server.lines)
    assert len(set(alone.values())) > 6  # the models answer apart


# ----------------------------------------------------------------------------- load


def _load_requests(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        word = rnd.choice(WORDS)
        kind = ("chat", "raw", "infill")[i % 3]
        req = {"kind": kind, "seed": rnd.randrange(10**6), "steps": rnd.choice([None, 6, 48])}
        if kind == "chat":
            req["prompt"] = f"upper: {word}"
        elif kind == "raw":
            req["prompt"], req["max_tokens"] = rnd.choice(["hello", "upper: " + word + "\n"]), rnd.choice([32, 64])
        else:
            cut = rnd.randrange(1, 15)
            req["prompt"], req["suffix"] = f"upper: {word}\n{word.upper()[:cut]}", word.upper()[cut + 1 :] + "\n"
        out.append(req)
    return out


def _alone(engine, req: dict) -> str:
    kw = {"seed": req["seed"], "max_denoising_steps": req["steps"]}
    if req["kind"] == "chat":
        return engine.generate(req["prompt"], **kw).texts[0]
    if req["kind"] == "raw":
        return engine.generate(req["prompt"], raw=True, max_new_tokens=req["max_tokens"], **kw).texts[0]
    return engine.infill(req["prompt"], req["suffix"], **kw)


def _ask(client, req: dict) -> str:
    extra = {"steps": req["steps"]} if req["steps"] else {}
    if req["kind"] == "chat":
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": req["prompt"]}],
                                           seed=req["seed"], extra_body=extra)
        return r.choices[0].message.content
    kw = {"suffix": req["suffix"]} if req["kind"] == "infill" else {"max_tokens": req["max_tokens"]}
    r = client.completions.create(model="demo", prompt=req["prompt"], seed=req["seed"], extra_body=extra, **kw)
    return r.choices[0].text


@pytest.mark.slow
def test_load_16_clients_64_requests_answer_as_alone(server, engine):
    requests = _load_requests(64)
    expected = [_alone(engine, r) for r in requests]
    before, hwm_before = server.health(), server.vm_hwm_kb()
    clients = [server.client() for _ in range(16)]

    def worker(k: int) -> list[tuple[int, str]]:
        return [(i, _ask(clients[k], requests[i])) for i in range(k, 64, 16)]  # 4 requests each, one at a time

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        results = dict(pair for part in pool.map(worker, range(16)) for pair in part)
    seconds = time.perf_counter() - t0
    after = server.health()
    assert sorted(results) == list(range(64))  # nothing lost
    wrong = [i for i in range(64) if results[i] != expected[i]]
    assert not wrong, [(requests[i], results[i], expected[i]) for i in wrong[:3]]
    assert after["completed"] - before["completed"] == 64 and after["failed"] == 0
    rows = (after["row_forwards"] - before["row_forwards"]) / (after["forwards"] - before["forwards"])
    assert rows > 2, f"mean batch {rows:.2f}: requests were not batched"
    assert after["peak_batch"] <= 8
    # Memory: the sampler's buffers are sized for --max-batch once; 64 requests add no per-request buffers.
    assert after["sampler_buffer_bytes"] == before["sampler_buffer_bytes"]
    grown = server.vm_hwm_kb() - hwm_before
    assert grown < 64 * 1024, f"peak memory grew by {grown} kB"
    assert seconds < 60
    print(f"\n64 requests from 16 clients in {seconds:.2f} s, mean batch {rows:.2f}, peak RSS +{grown} kB")


def test_fused_head_draws_per_request_block():
    """The fused head (CUDA; here in Triton's interpreter) draws from two uniforms per row that `prepare_step` takes
    from each request's own generator: each request's block gets the draws it gets alone, wherever it sits."""
    import torch

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or Triton's interpreter")
    from quant.kernels.head import fused_head

    from dgemma_cli.sampler import SamplerBuffers, prepare_step, sample_step

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    R, H, V, seeds, temps = 4, 32, 300, [11, 22, 33], [0.8, 0.5, 0.4]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(len(seeds) * R, H, generator=g).to(torch.bfloat16).to(dev)
    w = torch.randn(V, H, generator=g).to(torch.bfloat16).to(dev)

    def step(buf, rows, temperature, gens=None):
        prepare_step(buf, temperature, gens)
        fused_head(h[rows], w, 30.0, 4.0, buf.temperature, buf.uniforms, buf.fused)
        return sample_step(buf, temperature)

    buf = SamplerBuffers(len(seeds) * R + R, V, dev, head=(H, torch.bfloat16))  # a block more than used: views
    view = buf.first(len(seeds) * R)
    temperature = torch.tensor(temps, device=dev).repeat_interleave(R)[:, None]
    gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
    together = [x.clone() for x in step(view, slice(None), temperature, gens)]
    for b, (s, t) in enumerate(zip(seeds, temps)):
        alone = SamplerBuffers(R, V, dev, head=(H, torch.bfloat16))
        torch.manual_seed(s)
        expected = step(alone, slice(b * R, (b + 1) * R), torch.tensor(t, device=dev))
        for got, want in zip(together[:2], expected[:2]):  # the draws and the argmax: the same tokens
            assert torch.equal(got[b * R : (b + 1) * R], want)
        # the entropy within float32 summation order (the interpreter's matmul may sum a row otherwise elsewhere)
        assert torch.allclose(together[2][b * R : (b + 1) * R], expected[2], atol=1e-5)


