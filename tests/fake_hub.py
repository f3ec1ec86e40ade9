"""A small in-process imitation of the Hugging Face Hub HTTP API, for download tests without a network.

It serves what `huggingface_hub` needs to fetch files from model repos:

* `GET /api/models/{repo}` and `GET /api/models/{repo}/revision/{rev}`: model info (`sha`, `siblings`);
* `GET /api/models/{repo}/tree/{rev}[/{path}]`: the file listing (one page), as `list_repo_tree` reads it;
* `HEAD` / `GET /{repo}/resolve/{rev}/{filename}`: file metadata (`ETag`, `X-Repo-Commit`, `Content-Length`,
  `Accept-Ranges`) and bytes, with `Range: bytes=N-[M]` answered by `206` + `Content-Range`. Files are served
  directly (no redirect to a CDN, no xet headers), so `huggingface_hub` takes its plain HTTP path.

Errors carry the `X-Error-Code` header `huggingface_hub` turns into its exception classes: `RepoNotFound`
(401 without a token, 404 with one), `RevisionNotFound`, `EntryNotFound`, `GatedRepo` (401 without a token,
403 with a token that has no access). A gated repo's info and listing stay public, as on the Hub; only its
files need the token.

Failure injection: `hub.cut_get(repo_id, filename, after=N)` makes the next GET of that file send its headers
and only the first N bytes of the body, then drop the connection.

Every request is recorded in `hub.requests` (method, path, query, Range header, Authorization header). Besides
the calls a download makes, the first Hub call of a process may be preceded by `GET /api/agent-harnesses` (a
registry huggingface_hub fetches once per process; answered 404 here), so filter the log rather than compare it
whole, e.g. with `hub.file_requests(filename)`.

The `fake_hub` fixture starts a server for one test and points `huggingface_hub` at it. Because
`huggingface_hub` reads its environment once, at import, into `huggingface_hub.constants`, setting environment
variables is not enough for an in-process call; the fixture patches (see `point_hub_at`):

* `constants.ENDPOINT` and `constants.HUGGINGFACE_CO_URL_TEMPLATE` (plus `HF_ENDPOINT` in the environment), and
  the endpoint of the module-level `huggingface_hub.hf_api.api` instance behind the top-level helper functions;
* `constants.HF_HUB_OFFLINE` = False (conftest sets HF_HUB_OFFLINE=1 for every test; the env var is removed too);
* `constants.HF_HOME`, `HF_HUB_CACHE`, `HF_ASSETS_CACHE`, `HF_XET_CACHE`, `HF_TOKEN_PATH`, `HF_STORED_TOKENS_PATH`,
  `AGENT_HARNESSES_PATH`, re-derived from this test's HF_HOME (the values computed at import belong to whichever
  HF_HOME was set then);
* HF_TOKEN and HUGGING_FACE_HUB_TOKEN are removed from the environment (the token is read at call time).

`set_offline(monkeypatch, True)` switches offline mode on the same way (env var and constant).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest


@dataclass
class Request:
    method: str
    path: str  # as sent (percent-encoded), without the query string
    query: str
    range: str | None
    authorization: str | None


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    sha: str
    branches: dict[str, str]
    token: str | None = None  # gated: files need "Authorization: Bearer <token>"
    cuts: dict[str, list[int]] = field(default_factory=dict)  # filename -> pending "cut after N bytes" GETs


class FakeHub:
    """The server and its state. Use `add_repo` (or `serve_directory`) to publish repos."""

    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- configuration ---------------------------------------------------------------------------------

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, gated_token: str | None = None,
                 branches: tuple[str, ...] = ("main",)) -> FakeRepo:
        """Publish `files` (name -> bytes) as one commit of `repo_id`, reachable by its sha and by `branches`."""
        digest = hashlib.sha1(repo_id.encode())
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        sha = digest.hexdigest()
        repo = FakeRepo(dict(files), sha, {b: sha for b in branches}, gated_token)
        with self._lock:
            self.repos[repo_id] = repo
        return repo

    def cut_get(self, repo_id: str, filename: str, after: int, times: int = 1) -> None:
        """The next `times` GETs of `filename` send only `after` bytes of their body, then drop the connection."""
        with self._lock:
            self.repos[repo_id].cuts.setdefault(filename, []).extend([after] * times)

    # -- request log helpers ------------------------------------------------------------------------------

    def file_requests(self, filename: str, method: str | None = None) -> list[Request]:
        """Recorded /resolve/ requests for `filename` (any repo, any revision)."""
        return [r for r in list(self.requests)
                if "/resolve/" in r.path and unquote(r.path).endswith("/" + filename)
                and (method is None or r.method == method)]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()


def etag_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, *args):  # keep test output clean
        pass

    def do_HEAD(self):
        self._handle(body=False)

    def do_GET(self):
        self._handle(body=True)

    # -- plumbing ------------------------------------------------------------------------------------------

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"", send_body: bool = True):
        self.send_response(status)
        headers = {"Content-Length": str(len(body)), **headers}
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if send_body and body:
            self.wfile.write(body)

    def _json(self, obj, status: int = 200, headers: dict[str, str] | None = None, send_body: bool = True):
        body = json.dumps(obj).encode()
        self._send(status, {"Content-Type": "application/json", **(headers or {})}, body, send_body)

    def _error(self, status: int, code: str, message: str, send_body: bool, extra: dict[str, str] | None = None):
        headers = {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})}
        self._json({"error": message}, status, headers, send_body)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization")
        if auth and auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return None

    def _handle(self, body: bool):
        hub = self.hub
        parts = urlsplit(self.path)
        with hub._lock:
            hub.requests.append(Request(self.command, parts.path, parts.query, self.headers.get("Range"),
                                        self.headers.get("Authorization")))
        path = parts.path
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/"):], body)
        segs = path.lstrip("/").split("/")
        if len(segs) >= 5 and segs[2] == "resolve":
            repo_id = unquote(segs[0]) + "/" + unquote(segs[1])
            return self._resolve(repo_id, unquote(segs[3]), unquote("/".join(segs[4:])), body)
        self._error(404, "NotFound", "Not found", body)

    def _lookup(self, repo_id: str, send_body: bool) -> FakeRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            status = 404 if self._token() else 401
            self._error(status, "RepoNotFound", "Repository not found", send_body)
        return repo

    def _commit(self, repo: FakeRepo, revision: str, send_body: bool) -> str | None:
        sha = repo.branches.get(revision) or (revision if revision == repo.sha else None)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", send_body)
        return sha

    # -- /api/models/... -------------------------------------------------------------------------------------

    def _api(self, rest: str, send_body: bool):
        segs = rest.split("/")
        if len(segs) < 2:
            return self._error(404, "NotFound", "Not found", send_body)
        repo_id = unquote(segs[0]) + "/" + unquote(segs[1])
        repo = self._lookup(repo_id, send_body)
        if repo is None:
            return
        tail = segs[2:]
        if not tail or (len(tail) == 2 and tail[0] == "revision"):
            revision = unquote(tail[1]) if tail else "main"
            sha = self._commit(repo, revision, send_body)
            if sha is None:
                return
            info = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                    "gated": "manual" if repo.token else False, "disabled": False, "tags": [],
                    "siblings": [{"rfilename": name, "size": len(data)}  # sizes: the Hub's with files_metadata
                                 for name, data in sorted(repo.files.items())]}
            return self._json(info, send_body=send_body)
        if len(tail) >= 2 and tail[0] == "tree":
            sha = self._commit(repo, unquote(tail[1]), send_body)
            if sha is None:
                return
            prefix = unquote("/".join(tail[2:]))
            prefix = prefix + "/" if prefix else ""
            entries = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                       for name, data in sorted(repo.files.items()) if name.startswith(prefix)]
            return self._json(entries, send_body=send_body)
        self._error(404, "NotFound", "Not found", send_body)

    # -- /{repo}/resolve/{rev}/{file} --------------------------------------------------------------------------

    def _resolve(self, repo_id: str, revision: str, filename: str, send_body: bool):
        repo = self._lookup(repo_id, send_body)
        if repo is None:
            return
        if repo.token is not None and self._token() != repo.token:
            if self._token() is None:
                status, msg = 401, (f"Access to model {repo_id} is restricted. You must have access to it and be "
                                    "authenticated to access it. Please log in.")
            else:
                status, msg = 403, (f"Access to model {repo_id} is restricted and you are not in the authorized "
                                    f"list. Visit {self.hub.url}/{repo_id} to ask for access.")
            return self._error(status, "GatedRepo", msg, send_body)
        sha = self._commit(repo, revision, send_body)
        if sha is None:
            return
        data = repo.files.get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", "Entry not found", send_body, {"X-Repo-Commit": sha})
        headers = {"ETag": f'"{etag_of(data)}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start, end = 0, len(data)
        status = 200
        rng = self.headers.get("Range")
        if rng and send_body:
            try:
                unit, spec = rng.split("=", 1)
                a, b = spec.split("-", 1)
                start = int(a)
                end = int(b) + 1 if b else len(data)
                if unit.strip() != "bytes" or not 0 <= start < len(data) or end > len(data) or end <= start:
                    raise ValueError
            except ValueError:
                return self._send(416, {"Content-Range": f"bytes */{len(data)}"}, b"", send_body)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        chunk = data[start:end]
        cut = None
        if send_body:
            with self.hub._lock:
                pending = repo.cuts.get(filename)
                if pending:
                    cut = pending.pop(0)
        if cut is None:
            return self._send(status, headers, chunk, send_body)
        # Promise the whole body, send part of it, then drop the connection.
        self.send_response(status)
        headers["Content-Length"] = str(len(chunk))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(chunk[:cut])
        self.wfile.flush()
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# -- helpers for tests -----------------------------------------------------------------------------------------


def serve_directory(hub: FakeHub, repo_id: str, path: Path | str, **kwargs) -> FakeRepo:
    """Publish every file under the local directory `path` (recursively, '/'-separated names) as `repo_id`."""
    root = Path(path)
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    return hub.add_repo(repo_id, files, **kwargs)


TEXT_SHARD = "model-00001-of-00002.safetensors"
VISION_SHARD = "model-00002-of-00002.safetensors"
AUDIO_SHARD = "model-audio.safetensors"


def diffusion_gemma_files(text_floats: int = 32_768, audio: bool = False) -> dict[str, bytes]:
    """A DiffusionGemma-like repo: config, tokenizer placeholders, and a 2-shard safetensors index where the
    second shard holds only `model.encoder.vision_tower.*` / `model.encoder.embed_vision.*` tensors (with `audio`,
    a third shard, AUDIO_SHARD, holds only `model.audio_tower.*` ones). The text shard is about 4*text_floats
    bytes."""
    import numpy as np
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    text = {
        "model.decoder.embed_tokens.weight": rng.standard_normal((text_floats // 64, 64), dtype=np.float32),
        "model.decoder.norm.weight": np.ones(64, dtype=np.float32),
        "model.encoder.language_model.layers.0.layer_scalar": np.ones(1, dtype=np.float32),
    }
    vision = {
        "model.encoder.vision_tower.patch_embed.weight": rng.standard_normal((64, 16), dtype=np.float32),
        "model.encoder.vision_tower.norm.weight": np.ones(16, dtype=np.float32),
        "model.encoder.embed_vision.embedding_projection.weight": rng.standard_normal((64, 16), dtype=np.float32),
    }
    text_bytes, vision_bytes = save(text), save(vision)
    weight_map = {**{k: TEXT_SHARD for k in text}, **{k: VISION_SHARD for k in vision}}
    extra = {}
    if audio:
        extra[AUDIO_SHARD] = save({"model.audio_tower.conv.weight": np.ones((8, 8), dtype=np.float32)})
        weight_map["model.audio_tower.conv.weight"] = AUDIO_SHARD
    total = len(text_bytes) + len(vision_bytes) + sum(map(len, extra.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    config = {"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"]}
    return {
        "config.json": json.dumps(config).encode(),
        "tokenizer.json": b'{"version": "1.0", "model": {"type": "placeholder"}}',
        "tokenizer_config.json": b'{"model_max_length": 1024}',
        "processor_config.json": b'{"image_processor": {"max_soft_tokens": 280}}',
        "README.md": b"# fake model\n",
        "model.safetensors.index.json": json.dumps(index).encode(),
        TEXT_SHARD: text_bytes,
        VISION_SHARD: vision_bytes,
        **extra,
    }


def closed_endpoint() -> str:
    """An http://127.0.0.1:PORT URL where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def point_hub_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Make in-process `huggingface_hub` calls use `endpoint`, this test's HF_HOME, no token, online mode."""
    from huggingface_hub import constants, hf_api

    endpoint = endpoint.rstrip("/")
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hf_api.api, "endpoint", endpoint)

    home = os.environ["HF_HOME"]
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ASSETS_CACHE", "HF_XET_CACHE", "HF_TOKEN_PATH",
                "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HOME", home)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(home, "hub"))
    monkeypatch.setattr(constants, "HF_ASSETS_CACHE", os.path.join(home, "assets"))
    monkeypatch.setattr(constants, "HF_XET_CACHE", os.path.join(home, "xet"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", os.path.join(home, "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", os.path.join(home, "stored_tokens"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", os.path.join(home, ".agent_harnesses.json"))
    set_offline(monkeypatch, False)


def set_offline(monkeypatch: pytest.MonkeyPatch, offline: bool) -> None:
    from huggingface_hub import constants

    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


@pytest.fixture
def fake_hub(monkeypatch):
    """A running FakeHub for one test, with huggingface_hub pointed at it (see the module docstring)."""
    hub = FakeHub().start()
    point_hub_at(monkeypatch, hub.url)
    try:
        yield hub
    finally:
        hub.stop()
