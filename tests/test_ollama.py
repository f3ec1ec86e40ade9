"""Ollama's API on `dgemma serve` (dgemma_cli/ollama_api.py), driven through the official `ollama` Python client
against a real server process on the bundled demo model: every answer equals the same request run alone in this
process (the batch changes nothing), streaming is Ollama's NDJSON, `format` holds answers to JSON or a schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

ollama = pytest.importorskip("ollama")

from dgemma_cli.engine import load  # noqa: E402
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

    from dgemma_cli.ollama_api import _with_calls, chat_body

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
