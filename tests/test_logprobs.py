"""`logprobs` / `top_logprobs` on `dgemma serve` (dgemma_cli/server/logprobs.py), through the official `openai` client.

A canvas keeps the argmax canvas of its last denoising step, so each answer token's log-probability is read from
that step's distribution: log_softmax(logits / T) at the step's temperature. These tests compute it independently,
running the same request alone in this process step by step (`Engine.generate` with a denoiser that keeps each
step's logits), and compare every token, its value and its alternatives, with what the server returns, alone, in
a stream and in a batch.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from dgemma_cli.engine import load  # noqa: E402
from dgemma_cli.sampler import Step, step_temperature  # noqa: E402
from test_serve import ServerProcess  # noqa: E402

UNSURE = "what is this? ~~"  # a prompt the demo model is not sure of (tests/test_serve.py uses it too)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("logprobs"), "--max-batch", "8")
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def engine():
    return load("demo", device="cpu", dtype="float32")


def committed(engine, monkeypatch, prompt, *, raw: bool = False, seed: int, k: int, **overrides):
    """(answer ids, per answer token (its log-probability, the k most likely [(id, logprob)])): the distribution of
    the last step of the token's canvas, log_softmax(logits / T), from the logits the network returned that step."""
    import dgemma_cli.engine as eng

    kept: list[torch.Tensor] = []
    real = eng.make_denoiser

    def spy(model, batch, capacity):
        d = real(model, batch, capacity)
        inner = d.denoise

        def denoise(canvas, buf, self_conditioned):
            inner(canvas, buf, self_conditioned)
            kept.append(buf.logits.clone())  # the step's logits, before the sampler divides them

        d.denoise = denoise
        return d

    monkeypatch.setattr(eng, "make_denoiser", spy)
    last: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # canvas -> (step, logits, argmax canvas)

    def on_event(ev):
        if isinstance(ev, Step):
            last[ev.canvas_index] = (ev.step, kept[-1], ev.argmax[0].clone())

    result = engine.generate(prompt, raw=raw, seed=seed, on_event=on_event, **overrides)
    monkeypatch.setattr(eng, "make_denoiser", real)
    settings = engine.settings.override(**overrides)
    C, N = engine.config.canvas_length, settings.max_denoising_steps
    ids = result.token_ids[0]
    out = []
    for i, t in enumerate(ids):
        step, logits, argmax = last[i // C]
        assert int(argmax[i % C]) == t  # the answer's token is the argmax of its canvas's last step
        T = step_temperature(N - step + 1, settings, logits.device)
        logp = torch.log_softmax(logits[i % C] / T, dim=-1)
        values, top = logp.topk(k)
        out.append((float(logp[t]), list(zip(top.tolist(), values.tolist()))))
    return result, out


def chat(prompt: str, **kw) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": prompt}], **kw}


def check_chat(engine, content: str, items, expected, ids) -> None:
    """The server's logprobs.content items against the independent computation, token by token."""
    tok = engine.tokenizer
    assert "".join(e.token for e in items) == content
    # The demo's tokens are one character each: the answer's are those of the text, less the whitespace its
    # decoding strips at either end (and special tokens, which decode to nothing).
    pairs = [(t, x) for t, x in zip(ids, expected) if tok.decode([t])]
    while pairs and not tok.decode([pairs[-1][0]]).strip():
        pairs.pop()
    while pairs and not tok.decode([pairs[0][0]]).strip():
        pairs.pop(0)
    assert len(items) == len(pairs) == len(content)
    for e, (t, (value, top)) in zip(items, pairs):
        assert e.token == tok.decode([t]) and bytes(e.bytes) == e.token.encode()
        assert e.logprob == pytest.approx(value, abs=1e-4)
        assert [x.token for x in e.top_logprobs] == [tok.decode([i], skip_special_tokens=False) for i, _ in top]
        assert [x.logprob for x in e.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)
        assert sum(math.exp(x.logprob) for x in e.top_logprobs) <= 1 + 1e-5
        assert all(x.logprob >= y.logprob for x, y in zip(e.top_logprobs, e.top_logprobs[1:]))


def test_chat_logprobs_are_the_distribution_each_token_was_committed_from(server, engine, monkeypatch):
    client = server.client()
    for prompt, seed in [(UNSURE, 2), ("upper: hello diffusions", 0)]:
        alone, expected = committed(engine, monkeypatch, prompt, seed=seed, k=5, max_new_tokens=48)
        r = client.chat.completions.create(**chat(prompt, seed=seed, max_tokens=48, logprobs=True, top_logprobs=5))
        content = r.choices[0].message.content
        assert content == alone.texts[0]
        check_chat(engine, content, r.choices[0].logprobs.content, expected, alone.token_ids[0])
        # streamed: each chunk carries the logprobs of its tokens; together the same items
        items, text = [], ""
        for c in client.chat.completions.create(**chat(prompt, seed=seed, max_tokens=48, logprobs=True,
                                                       top_logprobs=5, stream=True)):
            if c.choices and c.choices[0].logprobs is not None:
                part = c.choices[0].logprobs.content
                assert "".join(e.token for e in part) == (c.choices[0].delta.content or "")
                items += part
            if c.choices:
                text += c.choices[0].delta.content or ""
        assert text == content
        check_chat(engine, content, items, expected, alone.token_ids[0])


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_completion_logprobs_over_several_canvases(server, engine, monkeypatch):
    """A raw completion of three canvases (the demo does not end it): tokens, values, alternatives and offsets;
    special tokens (decoded as nothing) are not among the tokens, as they are not in the text."""
    client = server.client()
    alone, expected = committed(engine, monkeypatch, "hello", raw=True, seed=11, k=3, max_new_tokens=96)
    r = client.completions.create(model="demo", prompt="hello", seed=11, max_tokens=96, logprobs=3)
    choice = r.choices[0]
    assert choice.text == alone.texts[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    tok = engine.tokenizer
    visible = [(t, e) for t, e in zip(alone.token_ids[0], expected) if tok.decode([t])]
    assert len(lp.tokens) == len(visible) and len(alone.steps_per_canvas[0]) == 3
    for i, (t, (value, top)) in enumerate(visible):
        assert lp.tokens[i] == tok.decode([t])
        assert lp.token_logprobs[i] == pytest.approx(value, abs=1e-4)
        assert lp.text_offset[i] == len("".join(lp.tokens[:i]))
        want = {tok.decode([j], skip_special_tokens=False): v for j, v in top}
        want.setdefault(lp.tokens[i], value)  # the chosen token too, as the API always gives it
        # float32 log-softmax of a batch of another shape: a tail alternative near -13 is 1e-5 relative apart
        assert lp.top_logprobs[i] == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert any(v < -0.01 for v in lp.token_logprobs)  # an answer the model is unsure of somewhere


def test_greedy_token_is_its_distributions_argmax_and_batching_changes_nothing(server, engine):
    """temperature 0: every token is the top alternative of its distribution; the same requests sent together (8
    at once, mixed with requests that ask for none) get the same tokens and values as sent one at a time."""
    client = server.client()
    reqs = [chat(p, seed=s, max_tokens=48, temperature=t, logprobs=True, top_logprobs=4)
            for p, s, t in [(UNSURE, 2, 0), ("upper: abc def 12 ghijk", 7, 0), (UNSURE, 5, 1), ("hi", 1, 1)]]

    def ask(req):
        r = client.chat.completions.create(**req)
        lp = r.choices[0].logprobs
        return r.choices[0].message.content, None if lp is None else [
            (e.token, e.logprob, [(x.token, x.logprob) for x in e.top_logprobs]) for e in lp.content]

    alone = [ask(r) for r in reqs]
    for content, items in alone[:2]:
        assert "".join(t for t, _, _ in items) == content and items
        for token, value, top in items:
            assert (token, value) == top[0]
    plain = [chat(UNSURE, seed=s, max_tokens=64) for s in range(4)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, reqs + plain))
    assert together[: len(reqs)] == alone
    assert all(items is None for _, items in together[len(reqs):])
    assert server.health()["peak_batch"] > 1


def test_logprobs_follow_the_text_through_stops_and_structures(server):
    """Whatever the text returned is cut to (a stop string, a structure's bytes), the tokens concatenate to it."""
    client = server.client()
    r = client.chat.completions.create(**chat("upper: hello diffusions", seed=0, stop=["DIFF"], logprobs=True))
    assert r.choices[0].message.content == "HELLO "
    assert [e.token for e in r.choices[0].logprobs.content] == list("HELLO ")
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = client.chat.completions.create(**chat("upper: hello diffusions", seed=0, logprobs=True, top_logprobs=2),
                                       extra_body={"guided_choice": ["HELLO WORLD", "HELLO DIFFUSIONS", "no"]})
    content = r.choices[0].message.content
    assert content in ("HELLO WORLD", "HELLO DIFFUSIONS", "no")
    assert "".join(e.token for e in r.choices[0].logprobs.content) == content
    r = client.completions.create(model="demo", prompt="upper: abc\n", seed=0, logprobs=0, max_tokens=32)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and all(len(t) == 1 for t in lp.top_logprobs)


def test_logprobs_off_and_refusals(server):
    """Not asked: null, nothing computed. Out of range: one 400 each. Prompt log-probabilities (lm-eval's
    loglikelihood: echo with logprobs and max_tokens 0) are refused in one line: a canvas decoder defines none."""
    client = server.client()
    r = client.chat.completions.create(**chat("upper: hi", seed=0))
    assert r.choices[0].logprobs is None
    r = client.chat.completions.create(**chat("upper: hi", seed=0, logprobs=False))
    assert r.choices[0].logprobs is None
    http = httpx.Client(base_url=server.url, timeout=60)
    ok = chat("upper: hi", seed=0)
    cases = [
        ("/v1/chat/completions", {**ok, "top_logprobs": 2}, "invalid_value", "top_logprobs"),
        ("/v1/chat/completions", {**ok, "logprobs": True, "top_logprobs": 21}, "invalid_value", "top_logprobs"),
        ("/v1/chat/completions", {**ok, "logprobs": 1}, "invalid_type", "logprobs"),
        ("/v1/completions", {"model": "demo", "prompt": "hi", "logprobs": True}, "invalid_type", "logprobs"),
        ("/v1/completions", {"model": "demo", "prompt": "hi", "logprobs": 21}, "invalid_value", "logprobs"),
        ("/v1/completions", {"model": "demo", "prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0},
         "unsupported_parameter", "echo"),
    ]
    for route, body, code, param in cases:
        r = http.post(route, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), err
        assert "\n" not in err["message"]
    r = http.post("/v1/completions", json=cases[-1][1])
    assert "loglikelihood" in r.json()["error"]["message"]


def test_tokens_follow_the_answers_own_decoding(engine):
    """Without a server, on the demo's tokenizer: a thought channel, a tool call, special tokens, stripped
    whitespace and a stop string are not in the content, so their tokens are not among the logprobs; handed out
    canvas by canvas (as a stream), every token of the content comes once, in order, and the pieces add up to it."""
    from dgemma_cli.answer import AnswerText
    from dgemma_cli.server.logprobs import AnswerLogprobs

    tok = engine.tokenizer
    cases = [  # (generated text, chat, tools, stops, the content)
        ("<|channel>thought\nhmm<channel|>  HI THERE \n", True, False, [], "HI THERE"),
        ("OK<|tool_call>call:f{}<tool_call|>", True, True, [], "OK"),
        ("abc<mask>def STOP ghi", False, False, ["STOP"], "abcdef "),
        (" raw text, kept as is ", False, False, [], " raw text, kept as is "),
    ]
    for (generated, chat, tools, stops, content), by_prefix in [(c, b) for c in cases for b in (False, True)]:
        ids = tok.encode(generated)
        for size in (len(ids), 3):  # whole, then as canvases of 3
            text = AnswerText(tok, limit=len(ids), ends={1}, chat=chat, tools=tools, stops=stops)
            lp = AnswerLogprobs(tok, text)
            if by_prefix:  # the way taken for a tokenizer whose decoding is not its tokens' bytes in a row
                lp._spans = lambda ids, sent, lp=lp: (lp._spans_by_prefix(ids, sent), 0)
            entries = []
            for k in range(0, len(ids), size):
                lp.add([(-float(i), [(t, -float(i))]) for i, t in enumerate(ids[k : k + size], start=k)])
                text.add(ids[k : k + size])
                entries += lp.take(final=text.stopped)
                if text.stopped:
                    break
            if not text.stopped:
                text.finish(ids)
                entries += lp.take(final=True)
            assert text.sent == content
            assert "".join(e.piece for e in entries) == content, (generated, size)
            positions = [-int(e.logprob) for e in entries]  # each entry's value says which position it is
            assert positions == sorted(set(positions)) and all(ids[p] == e.token for p, e in zip(positions, entries))
            assert all(tok.decode([e.token]).strip() for e in entries if e.piece.strip())


def test_invalid_bytes_keep_the_linear_way_and_the_prefix_way_decodes_each_prefix_once(tmp_path):
    """A byte-fallback tokenizer (Gemma's) decodes a run of byte tokens that is no UTF-8 as one U+FFFD per token,
    where Python's decoder writes one per invalid sequence: the per-token texts then disagreed with the answer's,
    and every canvas of the answer took the exact way, which decoded each prefix again (cubic in the answer's
    length, on the event loop: 11 s of CPU for 4096 tokens). The runs are now read as the library reads them; and
    the exact way, where a tokenizer still needs it, decodes each prefix once over the whole answer."""
    from tokenizer_fixture import build_tokenizer_files

    from dgemma_cli.answer import AnswerText
    from dgemma_cli.server.logprobs import AnswerLogprobs
    from dgemma_cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(build_tokenizer_files(tmp_path / "tok", 512))
    byte = lambda b: tok.token_id(f"<0x{b:02X}>")  # noqa: E731
    unit = [byte(0xE4), byte(0xBD)] + tok.encode_text(" hello") + [byte(0xE4), byte(0xBD), byte(0xA0)] + \
        tok.encode_text(" world")
    ids = (unit * (2048 // len(unit) + 1))[:2048]

    def stream(by_prefix: bool) -> tuple[str, list, int]:
        text = AnswerText(tok, limit=len(ids), ends={1}, chat=False)
        lp = AnswerLogprobs(tok, text)
        decodes = [0]
        texts_of = text.texts_of

        def counted(part):
            decodes[0] += 1
            return texts_of(part)

        text.texts_of = counted
        if by_prefix:
            lp._spans = lambda ids, sent: (lp._spans_by_prefix(ids, sent), 0)
        entries = []
        for k in range(0, len(ids), 256):
            lp.add([(-float(i), []) for i in range(k, k + 256)])
            text.add(ids[k : k + 256])
            entries += lp.take()
        text.finish(ids)
        entries += lp.take(final=True)
        return text.sent, entries, decodes[0]

    sent, entries, decodes = stream(by_prefix=False)
    assert "".join(e.piece for e in entries) == sent
    assert sent.startswith("\ufffd\ufffd hello你 world\ufffd\ufffd hello")  # one U+FFFD per byte token, as decoded
    canvases = len(ids) // 256
    assert decodes == canvases + 1  # the answer's own decoding only: the per-token way throughout
    positions = [-int(e.logprob) for e in entries]
    assert positions == sorted(set(positions)) and all(ids[p] == e.token for p, e in zip(positions, entries))
    sent2, entries2, decodes = stream(by_prefix=True)
    assert sent2 == sent and "".join(e.piece for e in entries2) == sent
    assert decodes - canvases - 1 < 1.1 * len(ids)  # each prefix about once, not once per canvas (8 times)
