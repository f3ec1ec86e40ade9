"""Ollama's API on `dgemma serve` (dgemma_cli/server/ollama_api.py), driven through the official `ollama` Python client
against a real server process on the bundled demo model: every answer equals the same request run alone in this
process (the batch changes nothing), streaming is Ollama's NDJSON, `format` holds answers to JSON or a schema; and
what Ollama's API documents: `system`, `think` (and `thinking` back), `images`, `context`, long `stop` lists,
negative `num_predict`, tool calls as message.tool_calls, /api/show's capabilities. Answers the demo model cannot
give (a thought, a tool call) come from a scripted batch loop behind the real app on a real socket.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ollama = pytest.importorskip("ollama")

from dgemma_cli.engine import load  # noqa: E402
from dgemma_cli.tools import check_tools  # noqa: E402
from test_serve import ServerProcess  # noqa: E402

PROMPT = "upper: hello diffusions"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("ollama"), "--max-batch", "4")
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def engine():
    return load("demo", device="cpu", dtype="float32")


@pytest.fixture
def client(server):
    return ollama.Client(host=server.url, timeout=60)


def test_chat_and_generate_answer_as_alone(client, engine):
    r = client.chat(model="demo", messages=[{"role": "user", "content": PROMPT}], options={"seed": 3})
    alone = engine.generate(PROMPT, seed=3)
    assert r.message.role == "assistant" and r.message.content == alone.texts[0] == "HELLO DIFFUSIONS"
    assert r.done and r.done_reason == "stop" and r.eval_count == len(alone.token_ids[0])
    assert r.prompt_eval_count == len(alone.prompt_token_ids[0]) and r.total_duration > 0
    g = client.generate(model="demo:latest", prompt="upper: abc def 12 ghijk", options={"seed": 1})
    assert g.response == engine.generate("upper: abc def 12 ghijk", seed=1).texts[0] and g.done
    raw = client.generate(model="demo", prompt="<bos>x", raw=True, options={"seed": 2, "num_predict": 8})
    assert raw.response == engine.generate("<bos>x", raw=True, seed=2, max_new_tokens=8).texts[0]
    infill = client.generate(model="demo", prompt="upper: hello diffusions\nHELLO ", suffix="USIONS",
                             options={"seed": 0})
    assert infill.response == engine.infill("upper: hello diffusions\nHELLO ", "USIONS", seed=0)


def test_streaming_is_ndjson_ending_done(client, server, engine):
    parts = list(client.chat(model="demo", messages=[{"role": "user", "content": PROMPT}], stream=True,
                             options={"seed": 0, "num_predict": 64}))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == engine.generate(PROMPT, seed=0, max_new_tokens=64).texts[0]
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count > 0
    with httpx.stream("POST", server.url + "/api/generate", json={"model": "demo", "prompt": PROMPT}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and all(not x["done"] for x in lines[:-1])


@pytest.mark.slow  # make test's time: the slow suite (CI) runs it
def test_format_json_and_schema(client):
    schema = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 5}}, "required": ["w"]}
    for seed in range(2):
        r = client.chat(model="demo", messages=[{"role": "user", "content": PROMPT}], format=schema,
                        options={"seed": seed})
        value = json.loads(r.message.content)
        assert set(value) == {"w"} and len(value["w"]) <= 5
    g = client.generate(model="demo", prompt=PROMPT, format="json", options={"seed": 0})
    assert isinstance(json.loads(g.response), dict)


def test_models_show_ps_version(client, server):
    names = [m.model for m in client.list().models]
    assert names == ["demo:latest"]
    shown = client.show("demo")
    assert shown.details.family == "diffusiongemma" and "completion" in shown.capabilities
    assert [m.model for m in client.ps().models] == ["demo:latest"]
    assert server.http.get("/api/version").json()["version"]
    assert server.http.get("/").text == "Ollama is running"


def test_errors_are_ollamas(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and "demo" in e.value.error
    r = server.http.post("/api/chat", json={"model": "demo", "messages": "nope"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = server.http.post("/api/chat", json={"model": "demo", "messages": [{"role": "user", "content": "x"}],
                                            "format": "xml"})
    assert r.status_code == 400 and "format" in r.json()["error"]
    # loading a model (an empty prompt) answers at once, as Ollama does
    r = server.http.post("/api/generate", json={"model": "demo", "prompt": ""})
    assert r.json()["done"] is True and r.json()["done_reason"] == "load"


def test_a_web_page_cannot_drive_the_ollama_routes(server):
    """The same Host / Origin guard as the OpenAI routes: a page on another origin is refused before any work."""
    body = {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "stream": False}
    for origin in ("http://evil.example", "null"):
        r = httpx.post(server.url + "/api/chat", json=body, headers={"Origin": origin})
        assert r.status_code == 403, origin
    r = httpx.post(server.url + "/api/chat", json=body, headers={"Host": "evil.example"})
    assert r.status_code == 403


def test_ollama_messages_become_openai_ones():
    """Ollama's tool calls (arguments as an object) and tool results (named by tool_name) in OpenAI's shapes."""
    from types import SimpleNamespace

    from dgemma_cli.server.ollama_api import _with_calls, chat_body

    body = chat_body(SimpleNamespace(model_id="demo", slot_of=lambda m: 0 if m == "demo" else None), {
        "model": "demo:latest", "tools": [{"type": "function", "function": {"name": "f"}}], "options": {"seed": 4},
        "messages": [{"role": "user", "content": "x"},
                     {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                      "arguments": {"a": 1}}}]},
                     {"role": "tool", "tool_name": "f", "content": "done"}]})
    assert body["tools"][0]["function"]["name"] == "f" and body["seed"] == 4
    call = body["messages"][1]["tool_calls"][0]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'} and call["type"] == "function"
    assert body["messages"][2] == {"role": "tool", "content": "done", "name": "f"}
    out = _with_calls("chat", {"message": {"role": "assistant", "content": ""},
                               "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]})
    assert out["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"a": 1}}}]


def test_load_and_unload_answer_as_ollama(client, server):
    """Ollama's idiom: a chat with no messages (a generate with no prompt) loads the model, with keep_alive 0
    unloads it; answered at once, in Ollama's shape. The model stays loaded here either way."""
    for body, reason in (({}, "load"), ({"messages": []}, "load"), ({"messages": [], "keep_alive": 0}, "unload"),
                         ({"keep_alive": "0s"}, "unload"), ({"messages": [], "keep_alive": "5m"}, "load")):
        r = server.http.post("/api/chat", json={"model": "demo", **body})
        assert r.status_code == 200, (body, r.text)
        answer = r.json()
        assert set(answer) == {"model", "created_at", "message", "done_reason", "done"}, answer
        assert answer["message"] == {"role": "assistant", "content": ""} and answer["done"] is True
        assert answer["done_reason"] == reason and answer["model"] == "demo:latest", (body, answer)
    for body, reason in (({}, "load"), ({"prompt": ""}, "load"), ({"keep_alive": 0}, "unload")):
        answer = server.http.post("/api/generate", json={"model": "demo", **body}).json()
        assert set(answer) == {"model", "created_at", "response", "done", "done_reason"}, answer
        assert (answer["response"], answer["done"], answer["done_reason"]) == ("", True, reason), (body, answer)
    assert client.chat(model="demo", messages=[]).done_reason == "load"
    assert client.chat(model="demo", keep_alive=0).done_reason == "unload"
    assert client.generate(model="demo").done_reason == "load"
    assert client.generate(model="demo", keep_alive=0).done_reason == "unload"
    r = server.http.post("/api/chat", json={"model": "llama3", "messages": []})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    # still serving
    r = client.chat(model="demo", messages=[{"role": "user", "content": PROMPT}], options={"seed": 3})
    assert r.message.content == "HELLO DIFFUSIONS"


def test_wrong_types_are_refused_in_ollamas_shape(server):
    """`stream` must be a boolean (as /v1 requires it, and as Ollama's own decoding does) and `model` a string;
    answered {"error": "..."} with a 400, never a stream."""
    chat = {"model": "demo", "messages": [{"role": "user", "content": PROMPT}]}
    generate = {"model": "demo", "prompt": PROMPT}
    for path, body in (("/api/chat", chat), ("/api/generate", generate), ("/api/chat", {"model": "demo"}),
                       ("/api/generate", {"model": "demo"})):
        for stream in ("yes", 1, "false", [], {}):
            r = server.http.post(path, json={**body, "stream": stream})
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", (path, stream, r.text)
            assert set(r.json()) == {"error"} and "stream must be true or false" in r.json()["error"], r.text
        assert server.http.post(path, json={**body, "stream": None, "keep_alive": 0}).status_code == 200
    for path, body in (("/api/chat", chat), ("/api/generate", generate), ("/api/show", {})):
        for model in (5, ["demo"], {"name": "demo"}, True):
            r = server.http.post(path, json={**body, "model": model})
            assert r.status_code == 400 and "model must be a string" in r.json()["error"], (path, model, r.text)
    r = server.http.post("/api/chat", json={**chat, "model": ""})
    assert r.status_code == 400 and r.json()["error"] == "model is required"


def test_show_does_not_tell_where_the_model_lives(client, server, engine):
    """/api/show names the model by its id: the server's directories are no client's business."""
    r = server.http.post("/api/show", json={"model": "demo"})
    assert r.status_code == 200 and "FROM demo\n" in r.json()["modelfile"]
    for where in (str(engine.path), str(engine.path.parent), "dgemma_cli", "/"):
        assert where not in r.json()["modelfile"], where
    assert str(engine.path) not in r.text and str(ROOT) not in r.text
    assert client.show("demo:latest").modelfile == r.json()["modelfile"]


# ----------------------------------------------------------------------------- what Ollama's API documents, checked


def test_show_lists_what_the_model_does(client):
    """Ollama's capabilities: completion, tools (the vocabulary has the tool-call tokens, the template renders tools),
    thinking (the template takes enable_thinking, the vocabulary has the thought channel), insert (infill); the
    demo has no vision tower, so no vision (the picture demo's is in test_images_reach_a_vision_model)."""
    shown = client.show("demo")
    assert shown.capabilities == ["completion", "tools", "thinking", "insert"]
    # what a request without num_predict gets: the server's default max_tokens (docs/serve.md), 2 canvases of 256
    # on the demo's 512-position context, not the checkpoint's max_new_tokens of 32
    assert "num_predict 512\n" in shown.parameters, shown.parameters


def test_system_reaches_the_template(client, server, engine):
    """/api/generate's `system` and /api/chat's system message: the system turn the engine renders."""
    alone = engine.generate(PROMPT, system="Answer briefly.", seed=4)
    g = client.generate(model="demo", prompt=PROMPT, system="Answer briefly.", options={"seed": 4})
    assert g.prompt_eval_count == len(alone.prompt_token_ids[0]) and g.response == alone.texts[0]
    assert g.prompt_eval_count > len(engine.generate(PROMPT, seed=4).prompt_token_ids[0])  # the turn is there
    c = client.chat(model="demo", options={"seed": 4}, messages=[{"role": "system", "content": "Answer briefly."},
                                                                 {"role": "user", "content": PROMPT}])
    assert c.prompt_eval_count == g.prompt_eval_count and c.message.content == alone.texts[0]


def test_think_reaches_the_template(client, engine):
    """`think` asks the template for the thought channel (<|think|>); the demo writes no thought, so no `thinking`
    field comes back (test_thinking_and_tool_calls_come_back_in_ollamas_shape has one that does)."""
    msgs = [{"role": "user", "content": PROMPT}]
    thinking = engine.tokenizer.encode_chat(msgs, enable_thinking=True)
    assert len(thinking) > len(engine.tokenizer.encode_chat(msgs))
    for think in (True, "high"):
        r = client.chat(model="demo", messages=msgs, think=think, options={"seed": 3})
        assert r.prompt_eval_count == len(thinking) and r.message.thinking is None, think
        g = client.generate(model="demo", prompt=PROMPT, think=think, options={"seed": 3})
        assert g.prompt_eval_count == len(thinking) and g.thinking is None, think
    assert client.chat(model="demo", messages=msgs, think=False).prompt_eval_count < len(thinking)


def test_tools_reach_the_template(client, engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": PROMPT}]
    r = client.chat(model="demo", messages=msgs, tools=tools, options={"seed": 3})
    declared = [{"type": "function", "function": f} for f in check_tools(tools)]  # as the server declares them
    assert r.prompt_eval_count == len(engine.tokenizer.encode_chat(msgs, tools=declared)) > \
        len(engine.tokenizer.encode_chat(msgs))
    assert r.done and r.message.tool_calls is None  # the demo answers, it calls nothing


def test_negative_num_predict_runs_to_the_end(client, server, engine):
    """Ollama: num_predict -1 generates until the model ends (-2: until the context is full, the same bound
    here); 0 or a non-integer is a 400 in Ollama's shape."""
    whole = engine.generate(PROMPT, seed=3).texts[0]
    for n in (-1, -2):
        for r in (client.generate(model="demo", prompt=PROMPT, options={"seed": 3, "num_predict": n}),
                  client.chat(model="demo", messages=[{"role": "user", "content": PROMPT}],
                              options={"seed": 3, "num_predict": n})):
            text = r.response if hasattr(r, "response") and r.response is not None else r.message.content
            assert text == whole and r.done_reason == "stop", (n, r)
    short = client.generate(model="demo", prompt=PROMPT, options={"seed": 3, "num_predict": 4})
    assert short.eval_count == 4 and short.done_reason == "length"
    for n in (0, "8", 1.5, True):
        r = server.http.post("/api/generate", json={"model": "demo", "prompt": PROMPT, "options": {"num_predict": n}})
        assert r.status_code == 400 and "options.num_predict" in r.json()["error"], (n, r.text)


def test_stop_lists_as_long_as_editors_send_them(client, server):
    """Ollama has no cap on options.stop and editors send long lists: up to 64 strings (4096 characters together)
    here, where /v1 takes 8; past it a 400 in Ollama's shape."""
    from dgemma_cli.server.ollama_api import MAX_STOP, MAX_STOP_CHARS

    assert MAX_STOP >= 64
    msgs = [{"role": "user", "content": PROMPT}]
    many = [f"</fim_{i}>" for i in range(MAX_STOP - 1)] + ["DIFF"]
    r = client.chat(model="demo", messages=msgs, options={"seed": 0, "stop": many})
    assert r.message.content == "HELLO " and r.done_reason == "stop"
    g = client.generate(model="demo", prompt=PROMPT, options={"seed": 0, "stop": many})
    assert g.response == "HELLO "
    parts = list(client.generate(model="demo", prompt=PROMPT, stream=True, options={"seed": 0, "stop": many}))
    assert "".join(p.response for p in parts) == "HELLO " and parts[-1].done
    body = {"model": "demo", "messages": msgs, "stream": False}
    for stop in (many + ["x"], ["y" * (MAX_STOP_CHARS // 2)] * 2 + ["z"], "", [""], [1], {"a": 1}):
        r = server.http.post("/api/chat", json={**body, "options": {"stop": stop}})
        assert r.status_code == 400 and set(r.json()) == {"error"} and "options.stop" in r.json()["error"], stop
    r = server.http.post("/api/chat", json={**body, "format": "json", "options": {"stop": ["}"]}})
    assert r.status_code == 400 and "format" in r.json()["error"]
    r = server.http.post("/v1/chat/completions", json={"model": "demo", "messages": msgs, "stop": many[:9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"  # OpenAI's routes keep their 8


def test_generate_carries_context_and_takes_it_back(client, server, engine):
    """/api/generate's last object carries `context`: the conversation's token ids (prompt, answer, the turn's
    end). Sent back with the next prompt, the model sees the same tokens as a chat holding both turns."""
    tok = engine.tokenizer
    first = client.generate(model="demo", prompt=PROMPT, options={"seed": 3})
    u1, a1 = {"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.response}
    assert first.context == tok.encode_chat([u1, a1], add_generation_prompt=False)
    second = client.generate(model="demo", prompt="upper: abc def", context=first.context, options={"seed": 1})
    u2 = {"role": "user", "content": "upper: abc def"}
    chat = client.chat(model="demo", messages=[u1, a1, u2], options={"seed": 1})
    assert second.prompt_eval_count == chat.prompt_eval_count == len(tok.encode_chat([u1, a1, u2]))
    assert second.response == chat.message.content and second.context[: len(first.context)] == first.context
    # streamed: only the last object has it; raw prompts and infills carry theirs too
    parts = list(client.generate(model="demo", prompt=PROMPT, stream=True, options={"seed": 3}))
    assert parts[-1].context == first.context and all(p.context is None for p in parts[:-1])
    raw = client.generate(model="demo", prompt="<bos>x", raw=True, options={"seed": 2, "num_predict": 8})
    assert raw.context[:2] == tok.encode("<bos>x") and len(raw.context) == 2 + raw.eval_count
    again = client.generate(model="demo", prompt="y", raw=True, context=raw.context, options={"num_predict": 8})
    assert again.prompt_eval_count == len(raw.context) + len(tok.encode("y"))
    infill = client.generate(model="demo", prompt="upper: hello diffusions\nHELLO ", suffix="USIONS")
    assert infill.context and infill.done
    V = engine.config.text.vocab_size
    for bad in ([-1], [V], ["a"], [True], 5, [0] * engine.config.text.max_position_embeddings):
        r = server.http.post("/api/generate", json={"model": "demo", "prompt": PROMPT, "context": bad})
        assert r.status_code == 400 and set(r.json()) == {"error"} and "context" in r.json()["error"], r.text
    # a context the answer cannot follow within the model's context: a 400, not a failed generation
    r = server.http.post("/api/generate", json={"model": "demo", "prompt": PROMPT, "options": {"num_predict": 256},
                                                "context": [2] * (engine.config.text.max_position_embeddings - 60)})
    assert r.status_code == 400 and "context" in r.json()["error"], r.text


def test_images_on_a_model_without_vision_are_refused_in_ollamas_shape(server):
    pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    for path, body in (("/api/chat", {"messages": [{"role": "user", "content": "x", "images": [pixel]}]}),
                       ("/api/generate", {"prompt": "x", "images": [pixel]})):
        r = server.http.post(path, json={"model": "demo", "stream": False, **body})
        assert r.status_code == 400 and set(r.json()) == {"error"} and "vision" in r.json()["error"], r.text


def test_images_reach_a_vision_model(tmp_path):
    """The picture demo (a vision tower) names the shape in a picture sent as Ollama's bare base64 `images`, on
    /api/chat and /api/generate, and /api/show lists vision."""
    import base64
    import io
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from eval_shapes import held_out
    from train_shapes import QUESTION, draw, parse_answer

    s = ServerProcess(tmp_path, model="demo-shapes")
    try:
        c = ollama.Client(host=s.url, timeout=60)
        assert c.show("demo-shapes").capabilities == ["completion", "vision", "tools", "thinking", "insert"]
        for spec in held_out(2):
            buf = io.BytesIO()
            draw(spec).save(buf, "PNG")
            picture = base64.b64encode(buf.getvalue()).decode()
            r = c.chat(model="demo-shapes", messages=[{"role": "user", "content": QUESTION, "images": [picture]}],
                       options={"seed": 0})
            assert parse_answer(r.message.content) == (spec.colour, spec.shape), r.message.content
            g = c.generate(model="demo-shapes", prompt=QUESTION, images=[picture], options={"seed": 0})
            assert parse_answer(g.response) == (spec.colour, spec.shape), g.response
        r = s.http.post("/api/chat", json={"model": "demo-shapes", "stream": False, "messages": [
            {"role": "user", "content": QUESTION, "images": ["bm90IGEgcGljdHVyZQ=="]}]})
        assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    finally:
        assert s.stop() == 0, "".join(s.lines)


class ScriptedLoop:
    """The batch loop's interface, answering every job with the same token ids at once (the demo model neither
    thinks nor calls tools): what reaches the loop is kept in `jobs`."""

    max_batch = max_queue = 4
    closing = False
    completed = failed = forwards = row_forwards = peak_batch = buffer_bytes = 0
    prefixes = None

    def __init__(self, answer: list[int]):
        self.answer, self.jobs = answer, []

    def load(self):
        return 0, 0

    def submit(self, job, deliver):
        from dgemma_cli.server.batching import RowCanvas, RowDone, Ticket

        self.jobs.append(job)
        deliver(RowCanvas(0, self.answer, 1))
        deliver(RowDone(list(self.answer), [1], True, 0.01))
        return Ticket(job, deliver)


@contextmanager
def scripted_server(engine, answer: list[int]):
    """A real uvicorn on a real socket, in this process, over the real app, engine and tokenizer, with a
    ScriptedLoop: (its URL, the loop)."""
    import socket
    import threading

    import uvicorn
    from test_serve import wait_until

    from dgemma_cli.server.app import build_app
    from dgemma_cli.server.state import Server

    loop = ScriptedLoop(answer)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(build_app(Server(engine, loop, "demo")), log_level="warning",
                                         access_log=False, lifespan="off"))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: http.started, timeout=30)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", loop
    finally:
        http.should_exit = True
        thread.join(10)


def test_thinking_and_tool_calls_come_back_in_ollamas_shape(engine):
    """An answer's thought channel is Ollama's `thinking` (message.thinking on /api/chat), apart from its content;
    its tool calls are message.tool_calls, each {"function": {"name", "arguments": an object}}, whole or streamed."""
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": PROMPT}]
    with scripted_server(engine, tok.encode("<|channel>thought\nit shouts<channel|>HELLO")) as (url, loop):
        c = ollama.Client(host=url, timeout=60)
        r = c.chat(model="demo", messages=msgs, think=True)
        assert (r.message.thinking, r.message.content) == ("it shouts", "HELLO")
        assert loop.jobs[-1].prompt == tok.encode_chat(msgs, enable_thinking=True)
        parts = list(c.chat(model="demo", messages=msgs, think=True, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == "it shouts"
        assert "".join(p.message.content for p in parts) == "HELLO"
        g = c.generate(model="demo", prompt=PROMPT, think=True)
        assert (g.thinking, g.response) == ("it shouts", "HELLO")
        raw = httpx.post(url + "/api/chat", json={"model": "demo", "messages": msgs, "think": True, "stream": False})
        assert raw.json()["message"] == {"role": "assistant", "content": "HELLO", "thinking": "it shouts"}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    declared = [{"type": "function", "function": f} for f in check_tools(tools)]  # as the server declares them
    call = tok.encode('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>')
    with scripted_server(engine, call) as (url, loop):
        c = ollama.Client(host=url, timeout=60)
        r = c.chat(model="demo", messages=msgs, tools=tools)
        assert loop.jobs[-1].prompt == tok.encode_chat(msgs, tools=declared)
        assert r.message.content == "" and len(r.message.tool_calls) == 1
        assert r.message.tool_calls[0].function.name == "get_weather"
        assert r.message.tool_calls[0].function.arguments == {"city": "Paris", "days": 3}
        raw = httpx.post(url + "/api/chat", json={"model": "demo", "messages": msgs, "tools": tools, "stream": False})
        assert raw.json()["message"]["tool_calls"] == [{"function": {"name": "get_weather",
                                                                     "arguments": {"city": "Paris", "days": 3}}}]
        assert "tool_calls" not in raw.json() and raw.json()["done_reason"] == "stop"
        parts = list(c.chat(model="demo", messages=msgs, tools=tools, stream=True))
        assert [p.message.tool_calls for p in parts if p.message.tool_calls] == [r.message.tool_calls]
        # the call and its result sent back, as Ollama's clients send them: rendered for the model
        back = msgs + [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
        c.chat(model="demo", messages=back, tools=tools)
        assert "sunny" in tok.decode(loop.jobs[-1].prompt, skip_special_tokens=False)


def test_a_client_leaving_a_whole_answer_stops_its_row(server):
    """`"stream": false` (what litellm and most scripts send): a client that closes its connection while its
    answer is generated frees its row at once, as on /v1, instead of the row running to its num_predict (a page of
    dropped requests would each have held a row to the end)."""
    import socket

    from test_serve import wait_until

    host, port = server.url.split("//")[1].rsplit(":", 1)
    long = {"num_predict": 3000, "temperature": 2, "seed": 1}  # rows of several seconds on the demo
    for path, body in (("/api/generate", {"model": "demo", "prompt": "zzzz", "raw": True, "stream": False,
                                          "options": long}),
                       ("/api/chat", {"model": "demo", "stream": False, "options": long,
                                      "messages": [{"role": "user", "content": "upper: " + "hello world " * 50}]})):
        before = server.health()["completed"]
        data = json.dumps(body).encode()
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                     + data)
        wait_until(lambda: server.health()["active"] == 1, timeout=10)
        sock.close()
        wait_until(lambda: server.health()["active"] == 0, timeout=5)
        assert server.health()["completed"] == before, path
    r = server.http.post("/api/generate", json={"model": "demo", "prompt": PROMPT, "stream": False,
                                                "options": {"seed": 3}})
    assert r.json()["response"] == "HELLO DIFFUSIONS"


def test_a_malformed_call_in_the_history_is_a_400_not_a_500(server):
    """messages[].tool_calls[].function must be an object: anything else was a 500 (an AttributeError)."""
    for call in ({"function": "x"}, {"function": ["f"]}, "call", 5, {"name": "f"}):
        r = server.http.post("/api/chat", json={"model": "demo", "stream": False, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]})
        assert r.status_code == 400 and set(r.json()) == {"error"}, (call, r.text)
        assert "messages[1].tool_calls" in r.json()["error"]


def test_num_predict_errors_name_num_predict(server):
    """An answer that cannot fit the context is refused naming Ollama's field, num_predict, not /v1's max_tokens."""
    for path, body in (("/api/chat", {"messages": [{"role": "user", "content": PROMPT}]}),
                       ("/api/generate", {"prompt": PROMPT}), ("/api/generate", {"prompt": PROMPT, "raw": True})):
        r = server.http.post(path, json={"model": "demo", "stream": False, **body,
                                         "options": {"num_predict": 10**6}})
        assert r.status_code == 400 and set(r.json()) == {"error"}, (path, r.text)
        assert "num_predict" in r.json()["error"] and "max_tokens" not in r.json()["error"], (path, r.text)


def test_tool_call_arguments_as_json_text_are_read(server):
    """messages[].tool_calls[].function.arguments: an object (Ollama's shape) or its JSON text (as OpenAI's clients
    send it) are the same call; anything else is a 400 naming the field."""
    def history(arguments):
        return {"model": "demo", "stream": False, "options": {"seed": 1, "num_predict": 8}, "messages": [
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_name": "f", "content": "done"}]}

    as_object = server.http.post("/api/chat", json=history({"a": 1}))
    as_text = server.http.post("/api/chat", json=history('{"a": 1}'))
    assert as_object.status_code == as_text.status_code == 200, (as_object.text, as_text.text)
    assert as_text.json()["prompt_eval_count"] == as_object.json()["prompt_eval_count"]
    assert as_text.json()["message"] == as_object.json()["message"]
    for arguments in ("[1]", '"a"', "{not json", 5, [1], True):
        r = server.http.post("/api/chat", json=history(arguments))
        assert r.status_code == 400 and set(r.json()) == {"error"}, (arguments, r.text)
        assert "messages[1].tool_calls[0].function.arguments" in r.json()["error"], (arguments, r.text)


def test_think_raw_and_keep_alive_are_typed_as_stream_is(server):
    """One rule for Ollama's typed fields: a wrong type is a 400 naming the field, as `stream` is. think: a boolean
    or "high" / "medium" / "low"; raw: a boolean; keep_alive: a number (seconds) or a duration ("5m", "1h30m")."""
    chat = ("/api/chat", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "stream": False,
                          "options": {"num_predict": 4}})
    generate = ("/api/generate", {"model": "demo", "prompt": PROMPT, "stream": False, "options": {"num_predict": 4}})
    load = ("/api/chat", {"model": "demo"})
    bad = [(chat, "think", "yes"), (generate, "think", 1), (chat, "think", []), (generate, "raw", "yes"),
           (generate, "raw", 1), (chat, "keep_alive", [0]), (generate, "keep_alive", {}), (chat, "keep_alive", True),
           (load, "keep_alive", [0]), (load, "keep_alive", "soon"), (generate, "keep_alive", "5")]
    for (path, body), key, value in bad:
        r = server.http.post(path, json={**body, key: value})
        assert r.status_code == 400 and set(r.json()) == {"error"}, (path, key, value, r.text)
        assert r.json()["error"].startswith(f"{key} must be"), (path, key, value, r.text)
    good = [(chat, "think", "high"), (generate, "think", False), (generate, "raw", False), (chat, "think", None),
            (chat, "keep_alive", "5m"), (generate, "keep_alive", -1), (chat, "keep_alive", 300.5),
            (generate, "keep_alive", "1h30m"), (load, "keep_alive", "0"), (load, "keep_alive", None)]
    for (path, body), key, value in good:
        r = server.http.post(path, json={**body, key: value})
        assert r.status_code == 200, (path, key, value, r.text)
