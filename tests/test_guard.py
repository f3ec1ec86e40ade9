"""Who may talk to `dgemma serve` (dgemma_cli/server/guard.py), through real sockets to real server processes on the
demo model: the Host check on every route, --allow-host, a server bound to every interface, web pages' Origin, the
Content-Type rule (OpenAI's routes want JSON's type; Ollama's take any body as JSON, as Ollama and its clients do,
and keep pages out by Origin and Host), and each refusal in its route's own error shape.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import httpx
import pytest
from test_serve import ServerProcess

from dgemma_cli.server.guard import allowed_hosts

APP = "http://app.example:5173"
LAN_NAME = "dgemma.lan"
KEY = "sk-test-key"
HEADER_TIMEOUT = 2
PROMPT = "upper: hello diffusions"
ANSWER = "HELLO DIFFUSIONS"
CHAT = {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "stream": False, "options": {"seed": 3}}
GENERATE = {"model": "demo", "prompt": PROMPT, "stream": False, "options": {"seed": 3}}
OPENAI_CHAT = {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "seed": 3}
# (method, path, JSON body) of every route; the body one it answers with a 200
ROUTES = [("POST", "/v1/chat/completions", OPENAI_CHAT), ("POST", "/v1/completions", {"model": "demo",
                                                                                      "prompt": "x", "max_tokens": 4}),
          ("GET", "/v1/models", None), ("GET", "/v1/models/demo", None), ("GET", "/health", None),
          ("POST", "/api/chat", CHAT), ("POST", "/api/generate", GENERATE), ("POST", "/api/show", {"model": "demo"}),
          ("GET", "/api/tags", None), ("GET", "/api/ps", None), ("GET", "/api/version", None), ("GET", "/", None)]
NOT_JSON = [None, "application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("guard"), "--allow-origin", APP, "--allow-host", LAN_NAME,
                      "--header-timeout", str(HEADER_TIMEOUT))
    yield s
    assert s.stop() == 0, "".join(s.lines)


def send(url: str, method: str, path: str, body, headers: dict | None = None, content_type: str | None = None,
         **kw) -> httpx.Response:
    """A request with exactly these headers: the body as JSON's text, sent with `content_type` (None: no
    Content-Type at all)."""
    data = json.dumps(body).encode() if body is not None else None
    h = {**({"Content-Type": content_type} if content_type else {}), **(headers or {})}
    return httpx.request(method, url + path, content=data, headers=h, timeout=60, **kw)


def is_ollama_error(r: httpx.Response) -> bool:
    return r.headers["content-type"] == "application/json" and set(r.json()) == {"error"} and \
        isinstance(r.json()["error"], str) and r.json()["error"] != ""


def is_openai_error(r: httpx.Response, code: str | None = None) -> bool:
    e = r.json()["error"]
    return isinstance(e, dict) and set(e) == {"message", "type", "param", "code"} and (code is None or
                                                                                       e["code"] == code)


def answered(r: httpx.Response, path: str) -> bool:
    """A 200 with the right answer (the generating routes), or a 200 at all."""
    if r.status_code != 200:
        return False
    if path == "/api/chat":
        return r.json()["message"]["content"] == ANSWER
    if path == "/api/generate":
        return r.json()["response"] == ANSWER
    if path == "/v1/chat/completions":
        return r.json()["choices"][0]["message"]["content"] == ANSWER
    return True


def test_ollama_routes_take_a_body_sent_without_jsons_type(server):
    """Ollama asks for no Content-Type: litellm's ollama/ and ollama_chat/ send none, curl -d (Ollama's docs) sends
    a form's. Such a POST with no Origin (no web page behind it) is answered, its body read as JSON."""
    for path, body in (("/api/chat", CHAT), ("/api/generate", GENERATE)):
        for kind in NOT_JSON:
            r = send(server.url, "POST", path, body, content_type=kind)
            assert answered(r, path), (path, kind, r.status_code, r.text)
    r = send(server.url, "POST", "/api/show", {"model": "demo"}, content_type="application/x-www-form-urlencoded")
    assert r.status_code == 200 and "completion" in r.json()["capabilities"]
    r = send(server.url, "POST", "/api/chat", {**CHAT, "stream": True})  # streamed too
    assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["done"] is True
    # a form body that is no JSON: a 400 in Ollama's shape, not a 415
    r = httpx.post(server.url + "/api/chat", data={"model": "demo"})
    assert r.status_code == 400 and is_ollama_error(r) and "JSON" in r.json()["error"], r.text


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_the_curl_of_ollamas_docs_works(server):
    """`curl URL/api/generate -d '{...}'`, as Ollama's API docs write it (curl -d sends a form's type)."""
    out = subprocess.run(["curl", "-s", server.url + "/api/generate", "-d", json.dumps(GENERATE)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert json.loads(out.stdout)["response"] == ANSWER, out.stdout + out.stderr
    out = subprocess.run(["curl", "-s", server.url + "/api/chat", "-d", json.dumps({**CHAT, "stream": True})],
                         capture_output=True, text=True, timeout=60, check=False)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert "".join(x["message"]["content"] for x in lines) == ANSWER and lines[-1]["done"], out.stdout


def test_a_web_page_cannot_post_to_ollamas_routes(server):
    """What keeps a page out of Ollama's routes, now that any body is read: a browser names the page in Origin on
    every cross-site POST (a form's, fetch's simple requests), refused unless --allow-origin names it; a rebinding
    page's own name in Host is refused. Both before any work, in Ollama's shape."""
    before = server.health()["completed"]
    for path, body in (("/api/chat", CHAT), ("/api/generate", GENERATE), ("/api/show", {"model": "demo"})):
        for kind in NOT_JSON + ["application/json"]:
            for origin in ("http://evil.example", "null", APP + ".evil.example", "http://127.0.0.1:9"):
                r = send(server.url, "POST", path, body, {"Origin": origin}, kind)
                assert r.status_code == 403 and is_ollama_error(r), (path, kind, origin, r.text)
                assert "--allow-origin" in r.json()["error"] and "access-control-allow-origin" not in r.headers
            r = send(server.url, "POST", path, body, {"Host": "evil.example"}, kind)
            assert r.status_code == 403 and is_ollama_error(r) and "--allow-host" in r.json()["error"], r.text
            for site in ("cross-site", "same-site"):  # a browser that left Origin off still says who sent it
                r = send(server.url, "POST", path, body, {"Sec-Fetch-Site": site}, kind)
                assert r.status_code == 403 and is_ollama_error(r) and "--allow-origin" in r.json()["error"], r.text
    assert server.health()["completed"] == before  # nothing was generated
    r = send(server.url, "POST", "/api/show", {"model": "demo"}, {"Sec-Fetch-Site": "none"}, "text/plain")
    assert r.status_code == 200, r.text  # the user's own navigation (or a program's) is no page's
    # the page --allow-origin names may, whatever the type, and reads the answer
    r = send(server.url, "POST", "/api/chat", CHAT, {"Origin": APP}, "text/plain")
    assert answered(r, "/api/chat") and r.headers["access-control-allow-origin"] == APP
    pre = httpx.options(server.url + "/api/chat", headers={"Origin": "http://evil.example",
                                                           "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 403 and is_ollama_error(pre)


def test_openai_routes_still_want_jsons_type(server):
    """/v1 keeps the Content-Type rule: a page's typeless or text/plain POST (which needs no preflight) is a 415
    in OpenAI's shape, whatever its Origin says."""
    for _, path, body in [x for x in ROUTES if x[0] == "POST" and x[1].startswith("/v1")]:
        for kind in NOT_JSON:
            r = send(server.url, "POST", path, body, content_type=kind)
            assert r.status_code == 415 and is_openai_error(r, "unsupported_media_type"), (path, kind, r.text)
        r = send(server.url, "POST", path, body, {"Origin": "http://evil.example"}, "application/json")
        assert r.status_code == 403 and is_openai_error(r, "origin_not_allowed")


def test_every_route_refuses_a_foreign_host_and_answers_its_own(server):
    """The Host check holds on each route (a DNS-rebinding page reads whatever it reaches), in the route's own
    error shape; the server's own names, and --allow-host's, are answered on each."""
    port = server.url.rsplit(":", 1)[1]
    for method, path, body in ROUTES:
        ct = "application/json" if body is not None else None
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "other.lan"):
            r = send(server.url, method, path, body, {"Host": host}, ct)
            assert r.status_code == 403, (method, path, host, r.status_code, r.text)
            ok = is_ollama_error(r) if path.startswith("/api") or path == "/" else is_openai_error(
                r, "host_not_allowed")
            assert ok and "--allow-host" in r.text, (path, r.text)
        for host in (f"127.0.0.1:{port}", "localhost", f"[::1]:{port}", f"{LAN_NAME}:{port}", LAN_NAME.upper()):
            r = send(server.url, method, path, body, {"Host": host}, ct)
            assert answered(r, path), (method, path, host, r.status_code, r.text)


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_a_server_on_every_interface_answers_its_lan_names(tmp_path):
    """Bound to 0.0.0.0 (which needs a key), the server is reached by whatever name or address the LAN knows it
    by: any Host is answered, the key is what guards it (a 401 in each route's shape), and pages' Origin is still
    refused."""
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("::") is None
    assert allowed_hosts("127.0.0.1", ["*"]) is None and "127.0.0.1" in allowed_hosts("127.0.0.1")
    s = ServerProcess(tmp_path, "--host", "0.0.0.0", "--api-key", KEY)
    url = "http://127.0.0.1:" + s.url.rsplit(":", 1)[1]
    try:
        port = url.rsplit(":", 1)[1]
        key = {"Authorization": f"Bearer {KEY}"}
        for host in ("192.168.1.20", f"192.168.1.20:{port}", "mybox.local", f"mybox:{port}", f"[fe80::1]:{port}"):
            for method, path, body in ROUTES:
                ct = "application/json" if body is not None else None
                r = send(url, method, path, body, {"Host": host, **key}, ct)
                assert answered(r, path), (host, path, r.status_code, r.text)
        for path, body in (("/api/chat", CHAT), ("/api/generate", GENERATE), ("/api/tags", None)):
            r = send(url, "POST" if body else "GET", path, body, {"Host": "mybox.local"})
            assert r.status_code == 401 and is_ollama_error(r) and "API key" in r.json()["error"], r.text
        r = send(url, "POST", "/v1/chat/completions", OPENAI_CHAT, {"Host": "mybox.local"}, "application/json")
        assert r.status_code == 401 and is_openai_error(r, "invalid_api_key")
        r = send(url, "POST", "/api/chat", CHAT, {"Origin": "http://evil.example", **key}, "text/plain")
        assert r.status_code == 403 and is_ollama_error(r)
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_ollamas_paths_answer_errors_in_ollamas_shape(server):
    """Unknown /api/* routes, a wrong method, and the others' faults: {"error": "..."}, where /v1 answers in
    OpenAI's shape."""
    for method, path, status in (("POST", "/api/nowhere", 404), ("GET", "/api/embeddings", 404),
                                 ("GET", "/api/chat", 405), ("DELETE", "/api/tags", 405), ("POST", "/", 405),
                                 ("GET", "/api", 404)):
        r = httpx.request(method, server.url + path, timeout=60)
        assert r.status_code == status and is_ollama_error(r), (method, path, r.status_code, r.text)
    r = httpx.post(server.url + "/v1/nowhere", json={})
    assert r.status_code == 404 and is_openai_error(r, "not_found")
    r = httpx.post(server.url + "/api/chat", json={**CHAT, "model": "nope"})
    assert r.status_code == 404 and is_ollama_error(r)


def test_a_header_timeout_on_ollamas_paths_is_in_ollamas_shape(server):
    host, port = server.url.split("//")[1].rsplit(":", 1)
    socks = []
    for start in (b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Ty", b"POST /v1/chat/completions HTTP/1.1\r\nHo"):
        sock = socket.create_connection((host, int(port)), timeout=HEADER_TIMEOUT + 10)
        sock.sendall(start)
        socks.append(sock)
    began = time.perf_counter()
    answers = []
    for sock in socks:
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        sock.close()
        assert data.startswith(b"HTTP/1.1 408 "), data
        answers.append(json.loads(data.partition(b"\r\n\r\n")[2]))
    assert time.perf_counter() - began < HEADER_TIMEOUT + 5
    assert set(answers[0]) == {"error"} and "did not arrive" in answers[0]["error"]
    assert answers[1]["error"]["code"] == "request_timeout"
