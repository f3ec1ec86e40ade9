"""Constrained canvases (dgemma_cli/structured/constrain.py): answers held to a JSON Schema or a regular expression are valid
by construction, whatever the weights: a random-weight checkpoint in the real layout, many draws each, through the
Python API, `dgemma run` and `dgemma serve` (the official `openai` client's structured-output parsing).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch

from dgemma_cli.structured.constrain import (RowConstraint, Structure, best_path, compile_structure, integer_regex,
                                  number_regex, schema_regex)
from dgemma_cli.errors import UsageError

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parent.parent

SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                 "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
    "array of enums": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "ranged numbers": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 12},
                                                         "p": {"type": "number", "minimum": 0, "maximum": 1}},
                       "required": ["n", "p"]},
    "nested, optional fields": {
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1},
                                                                 "nick": {"type": "string", "maxLength": 4}},
                                "required": ["id"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                       "note": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["user"]},
}
REGEXES = [r"[A-Z]{2}-[0-9]{3}", r"(yes|no|maybe)", r"[a-z]+@[a-z]+\.(com|org)", r"-?[0-9]{1,4}(\.[0-9]{1,2})?"]


# ------------------------------------------------------------------------------------------------ the expressions


@pytest.mark.parametrize("lo,hi", [(0, 0), (0, 9), (1, 9), (5, 123), (-5, 5), (-120, -3), (17, 4321), (99, 100),
                                   (None, 5), (3, None), (None, -4), (-4, None), (0, None), (None, None), (100, 999)])
def test_integer_ranges_match_exactly_their_integers(lo, hi):
    rx = re.compile(f"(?:{integer_regex(lo, hi)})")
    for v in range(-5000, 5000):
        want = (lo is None or v >= lo) and (hi is None or v <= hi)
        assert (rx.fullmatch(str(v)) is not None) == want, v
    for text in ["01", "-0", "+1", "1.0", "", "1e3"]:  # not how JSON writes an integer
        assert rx.fullmatch(text) is None, text


def test_number_ranges_and_what_is_refused():
    rx = re.compile(f"(?:{number_regex({'minimum': 0, 'maximum': 1})})")
    for text in ["0", "0.5", "0.999", "1", "1.0", "1.00"]:
        assert rx.fullmatch(text), text
    for text in ["1.5", "2", "-0.1", "01", "1.01"]:
        assert not rx.fullmatch(text), text
    with pytest.raises(UsageError, match="whole-number bounds"):
        number_regex({"minimum": -1.5, "maximum": 2})
    with pytest.raises(UsageError, match="holds no integer"):
        schema_regex({"type": "integer", "minimum": 3, "maximum": 2})
    with pytest.raises(UsageError, match="not JSON"):
        Structure("json_schema", "{bad").regex()
    with pytest.raises(UsageError, match="not a regular expression"):
        Structure("regex", "[a-").regex()


def test_schema_ranges_are_written_in():
    rx = schema_regex({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 12}},
                       "required": ["n"]})
    assert re.fullmatch(rx, '{"n":12}') and re.fullmatch(rx, '{"n": 1}')
    assert not re.fullmatch(rx, '{"n":13}') and not re.fullmatch(rx, '{"n":0}')


# ---------------------------------------------------------------------------------------------- tokens and search


def test_token_bytes_spell_what_decoding_writes(checkpoints):
    """The automaton is built from each token's bytes: they must be what decoding the token writes."""
    from dgemma_cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(checkpoints["five_to_one"])
    spelled = tok.token_bytes()
    ids = [i for i, b in enumerate(spelled) if b]
    assert len(ids) > 400 and all(spelled[i] is None for i in (0, 1, 2, 105, 106))  # control tokens never spelled
    g = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(6000):
        seq = [ids[int(i)] for i in torch.randint(len(ids), (6,), generator=g)]
        try:  # the automaton spells only valid UTF-8 (its expressions are over characters)
            text = b"".join(spelled[i] for i in seq).decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert tok.decode(seq) == text
        checked += 1
    assert checked > 200


def test_the_search_finds_the_most_probable_valid_canvas(checkpoints):
    """On a small vocabulary, the search equals brute force: the best-scoring canvas whose text the expression
    accepts (ending at an end id, pads after) among every assignment."""
    from dgemma_cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(checkpoints["five_to_one"])
    auto = compile_structure(Structure("regex", "(ab|a)b?"), tok, 512)
    spelled = tok.token_bytes()
    letters = [i for i, b in enumerate(spelled) if b in (b"a", b"b", b"ab")]
    end, pad = 1, 0
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        score = torch.full((4, 512), -1e4)
        score[:, letters + [end, pad]] = torch.randn(4, len(letters) + 2, generator=g)
        got, ok = best_path(auto, score, auto.start, 4, 0, [end], pad)
        best, best_tokens = -float("inf"), None
        import itertools

        for combo in itertools.product(letters + [end, pad], repeat=4):
            cut = next((k for k, t in enumerate(combo) if t in (end, pad)), 4)
            if cut == 4 or combo[cut] != end or any(t not in (end, pad) for t in combo[cut + 1 :]):
                continue  # must end at an end id within the canvas (after = 0), then only end or pad ids
            if not re.fullmatch(b"(ab|a)b?", b"".join(spelled[t] for t in combo[:cut])):
                continue
            s = sum(float(score[k, t]) for k, t in enumerate(combo))
            if s > best:
                best, best_tokens = s, combo
        assert ok
        assert sum(float(score[k, t]) for k, t in enumerate(got.tolist())) == pytest.approx(best)
        assert got.tolist()[: got.tolist().index(end) + 1] == list(best_tokens[: best_tokens.index(end) + 1])


def test_a_constraint_that_cannot_fit_says_so(checkpoints):
    from dgemma_cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(checkpoints["five_to_one"])
    auto = compile_structure(Structure("regex", "[a-z]{12}"), tok, 512)
    logp = torch.log_softmax(torch.randn(16, 512), -1)
    rc = RowConstraint(auto, max_new_tokens=5, end_ids=[1], pad_id=0)  # 12 letters in 5 tokens: only if merged
    tokens, argmax = torch.zeros(16, dtype=torch.long), torch.zeros(16, dtype=torch.long)
    rc.step(logp, tokens, argmax, greedy=True)
    rc.end_canvas(argmax.tolist())
    assert not rc.satisfied or len(tok.decode(argmax.tolist()[:5]).strip()) == 12


# --------------------------------------------------------------------------------------- through every entry point


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schemas_hold_on_random_weights(checkpoints, name):
    """20 draws (a batch of 20 rows) on random weights: every answer parses and validates; the draws differ."""
    from dgemma_cli.engine import load

    engine = load(str(checkpoints["five_to_one"]), device="cpu")
    schema = SCHEMAS[name]
    result = engine.generate(["give me json"] * 20, seed=1, structure=Structure("json_schema", json.dumps(schema)),
                             max_new_tokens=160, max_denoising_steps=6)
    assert result.satisfied == [True] * 20
    for text in result.texts:
        _valid(text, schema)
    assert len(set(result.texts)) >= 10


@pytest.mark.slow
def test_regexes_hold_on_random_weights(checkpoints):
    from dgemma_cli.engine import load

    engine = load(str(checkpoints["five_to_one"]), device="cpu")
    for rx in REGEXES:
        result = engine.generate(["x"] * 20, seed=2, structure=Structure("regex", rx), max_new_tokens=48,
                                 max_denoising_steps=6)
        assert result.satisfied == [True] * 20, rx
        assert all(re.fullmatch(rx, t) for t in result.texts), (rx, result.texts)
        assert len(set(result.texts)) >= 3, rx


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgemma_cli", "run", "--device", "cpu", "-q", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, **kw)


@pytest.mark.slow
def test_run_json_schema_and_regex(checkpoints, tmp_path):
    schema = SCHEMAS["ranged numbers"]
    (tmp_path / "s.json").write_text(json.dumps(schema))
    model = str(checkpoints["five_to_one"])
    p = _run(["--model", model, "--seed", "0", "--steps", "6", "--json-schema", str(tmp_path / "s.json"),
              "numbers please"])
    assert p.returncode == 0, p.stderr
    _valid(p.stdout, schema)
    # the schema from stdin, --json's object, another seed: another valid answer
    q = _run(["--model", model, "--seed", "4", "--steps", "6", "--json", "--json-schema", "-", "numbers please"],
             input=json.dumps(schema))
    assert q.returncode == 0, q.stderr
    _valid(json.loads(q.stdout)["text"], schema)
    assert json.loads(q.stdout)["text"] != p.stdout.rstrip("\n")
    p = _run(["--model", model, "--seed", "0", "--steps", "6", "--regex", REGEXES[0], "a code"])
    assert p.returncode == 0 and re.fullmatch(REGEXES[0], p.stdout.rstrip("\n")), p


@pytest.mark.slow
def test_run_says_when_the_schema_cannot_be_completed(checkpoints, tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(SCHEMAS["nested, optional fields"]))
    p = _run(["--model", str(checkpoints["five_to_one"]), "--seed", "0", "--steps", "4", "--max-new-tokens", "4",
              "--json-schema", str(tmp_path / "s.json"), "x"])
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1 and "could not be completed to match --json-schema within --max-new-tokens 4" \
        in p.stderr
    assert p.stdout.startswith("{")  # what was written, cut short


@pytest.mark.parametrize("args,message", [
    (["--regex", "[a-"], "not a regular expression"),
    (["--json-schema", "/nonexistent/s.json"], "cannot read it"),
    (["--json-schema", "s.json", "--regex", "a"], "exclude each other"),
    (["--regex", "é+"], "cannot be compiled for this model's vocabulary"),
    (["--regex", "A{400}", "--max-new-tokens", "8"], "more than max_tokens (8) tokens can hold"),
])
def test_run_refuses_bad_structures_in_one_line(args, message, capsys):
    from cli_helpers import run_main

    code = run_main(["run", "-q", "--device", "cpu", *args, "upper: hello diffusions"])  # the demo: no é
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err


def test_a_regex_that_matches_no_text_is_said_so_not_blamed_on_the_vocabulary(capsys):
    from cli_helpers import run_main

    code = run_main(["run", "-q", "--device", "cpu", "--regex", r"[^\s\S]", "upper: hello diffusions"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "matches no text" in err and "encoding" not in err and "vocabulary" not in err, err


def test_a_gbnf_error_names_the_users_line_and_the_whole_error(tmp_path, capsys):
    from cli_helpers import run_main

    grammar = tmp_path / "g.gbnf"
    grammar.write_text('# letters\nroot ::= "x" | b\nb ::= [Z-A]\n')
    code = run_main(["run", "-q", "--device", "cpu", "--grammar", str(grammar), "upper: hello diffusions"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "line 3" in err and "[Z-A]" in err, err  # the user's line, not the converted grammar's
    assert "the start must be <= the end" in err, err  # the error itself, not only its first line


# ------------------------------------------------------------------------------------------------ dgemma serve


@pytest.fixture(scope="module")
def random_server(tmp_path_factory, checkpoints):
    from test_serve import ServerProcess

    s = ServerProcess(tmp_path_factory.mktemp("serve-structured"), "--max-batch", "8",
                      model=str(checkpoints["five_to_one"]), name="five_to_one")
    s.id = "five_to_one"
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.mark.slow
def test_openai_parse_with_a_pydantic_model(random_server):
    """`client.chat.completions.parse` with a pydantic model: 20 seeds, batched by the server, every answer
    parsed and validated by the client itself."""
    from concurrent.futures import ThreadPoolExecutor
    from typing import Literal

    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        sensor: str = Field(max_length=5)
        level: int = Field(ge=0, le=9)
        unit: Literal["C", "F"]
        ok: bool

    client = random_server.client()

    def ask(seed: int):
        return client.chat.completions.parse(model=random_server.id, response_format=Reading, seed=seed,
                                             messages=[{"role": "user", "content": "a reading"}], max_tokens=160,
                                             extra_body={"steps": 6})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(20)))
    readings = [a.choices[0].message.parsed for a in answers]
    assert all(isinstance(r, Reading) for r in readings)
    assert all(a.choices[0].finish_reason == "stop" for a in answers)
    assert len({r.model_dump_json() for r in readings}) >= 5


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_dates_and_times_are_held_as_rfc_3339_so_pydantic_parses_every_answer(random_server):
    """`format: date-time` (pydantic's datetime) was written with years of 20 digits and no offset, and the openai
    client's `parse` raised ValidationError on seeds 0-3. Now date-time, date and time are held as RFC 3339 writes
    them, and every answer parses; a format not held (email) is said once in the server's log, as an annotation."""
    import datetime

    from pydantic import BaseModel

    class Event(BaseModel):
        at: datetime.datetime
        day: datetime.date
        time: datetime.time

    client = random_server.client()
    for seed in range(4):
        a = client.chat.completions.parse(model=random_server.id, response_format=Event, seed=seed, max_tokens=160,
                                          messages=[{"role": "user", "content": "when?"}], extra_body={"steps": 6})
        assert a.choices[0].finish_reason == "stop", a
        event = a.choices[0].message.parsed
        assert isinstance(event, Event) and event.at.tzinfo is not None and event.time.tzinfo is not None, event
    email = {"type": "object", "properties": {"e": {"type": "string", "format": "email"}},
             "required": ["e"]}
    for _ in range(2):
        r = random_server.http.post("/v1/chat/completions", json={
            "model": random_server.id, "messages": [{"role": "user", "content": "mail"}], "max_tokens": 32,
            "seed": 0, "steps": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "m",
                                                                                              "schema": email}}})
        assert r.status_code == 200, r.text
    said = [x for x in random_server.lines if "format 'email' is not held" in x]
    assert len(said) == 1, random_server.lines


def test_the_date_expressions_accept_exactly_rfc_3339():
    import re

    from dgemma_cli.structured.structure import date_time_regex

    date, time_, stamp = (re.compile(date_time_regex(f)) for f in ("date", "time", "date-time"))
    for good in ("2024-02-29", "2000-02-29", "1900-02-28", "0001-01-01", "9999-12-31", "2023-04-30"):
        assert date.fullmatch(good), good
    for bad in ("1900-02-29", "2023-02-29", "0000-01-01", "2024-04-31", "2024-13-01", "20240-01-01", "24-01-01"):
        assert not date.fullmatch(bad), bad
    for good in ("23:59:59Z", "00:00:00.123456+05:30", "12:00:00-23:59"):
        assert time_.fullmatch(good), good
    for bad in ("24:00:00Z", "12:00:60Z", "12:00:00", "12:00:00.1234567Z", "12:00:00+24:00"):
        assert not time_.fullmatch(bad), bad
    assert stamp.fullmatch("2024-02-29T23:59:59.5Z") and not stamp.fullmatch("2024-02-29T23:59:59")


@pytest.mark.slow
def test_json_object_streamed_and_cut_short(random_server):
    client = random_server.client()
    chunks = client.chat.completions.create(model=random_server.id, messages=[{"role": "user", "content": "json"}],
                                            response_format={"type": "json_object"}, seed=3, max_tokens=96,
                                            stream=True, extra_body={"steps": 4})
    text, reasons = "", []
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            reasons.append(c.choices[0].finish_reason)
    # a whole JSON object (it may end where max_tokens does: "length", as OpenAI says when the limit is reached)
    assert isinstance(json.loads(text), dict) and reasons[-1] in ("stop", "length")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS["object"]}}
    # its shortest answer (21 characters) could fit 5 tokens of this vocabulary (at most 5 characters each), not 3
    with pytest.raises(openai.BadRequestError, match="shortest answer is 21 characters"):
        client.chat.completions.create(model=random_server.id, messages=[{"role": "user", "content": "json"}],
                                       max_tokens=3, seed=0, response_format=fmt, extra_body={"steps": 4})
    short = client.chat.completions.create(
        model=random_server.id, messages=[{"role": "user", "content": "json"}], max_tokens=5, seed=0,
        response_format=fmt, extra_body={"steps": 4})
    assert short.choices[0].finish_reason == "length"  # the schema did not fit: said, not returned as if whole
    with pytest.raises(json.JSONDecodeError):
        json.loads(short.choices[0].message.content)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                  "maximum": 1}}}}, "response_format"),
    ({"response_format": {"type": "regex"}}, "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
])
def test_bad_response_formats_are_400s(random_server, body, param):
    r = random_server.http.post("/v1/chat/completions", json={"model": random_server.id,
                                                               "messages": [{"role": "user", "content": "x"}],
                                                               **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


GRAMMAR = 'start: "(" NUM ("+" NUM){0,3} ")"\nNUM: /[0-9]{1,3}/\n'
GBNF = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= "yes" | "no"\n'


def _grammar_ok(text: str) -> bool:
    return re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3}){0,3}\)", text) is not None


def _gbnf_ok(text: str) -> bool:
    return re.fullmatch(r"\[(yes|no)(,(yes|no)){0,3}\]", text) is not None


@pytest.mark.slow
def test_grammars_hold_on_random_weights(checkpoints):
    """A Lark grammar and a GBNF one (llama.cpp's), 20 draws each on random weights: every answer is a sentence of
    the grammar (bounded grammars: the walk does not look ahead, so an unbounded repetition is ended only when the
    model prefers ending it), and the draws differ."""
    from dgemma_cli.engine import load

    engine = load(str(checkpoints["five_to_one"]), device="cpu")
    for source, ok in ((GRAMMAR, _grammar_ok), (GBNF, _gbnf_ok)):
        result = engine.generate(["x"] * 20, seed=3, structure=Structure("grammar", source), max_new_tokens=64,
                                 max_denoising_steps=6)
        assert result.satisfied == [True] * 20 and all(ok(t) for t in result.texts), result.texts
        assert len(set(result.texts)) >= 5


@pytest.mark.slow
def test_run_grammar_and_serve_guided_fields(checkpoints, tmp_path, random_server):
    (tmp_path / "g.lark").write_text(GRAMMAR)
    p = _run(["--model", str(checkpoints["five_to_one"]), "--seed", "0", "--steps", "6", "--grammar",
              str(tmp_path / "g.lark"), "sum"])
    assert p.returncode == 0 and _grammar_ok(p.stdout.rstrip("\n")), p
    from concurrent.futures import ThreadPoolExecutor

    client = random_server.client()
    for extra, check in (({"guided_regex": REGEXES[2]}, lambda t: re.fullmatch(REGEXES[2], t)),
                         ({"guided_json": SCHEMAS["array of enums"]},
                          lambda t: jsonschema.validate(json.loads(t), SCHEMAS["array of enums"]) is None),
                         ({"guided_grammar": GBNF}, _gbnf_ok)):
        def ask(seed: int, extra=extra):
            return client.chat.completions.create(model=random_server.id, seed=seed, max_tokens=64,
                                                  messages=[{"role": "user", "content": "x"}],
                                                  extra_body={"steps": 4, **extra}).choices[0]

        with ThreadPoolExecutor(8) as pool:  # 20 seeds, batched by the server
            answers = list(pool.map(ask, range(20)))
        assert all(a.finish_reason in ("stop", "length") and check(a.message.content) for a in answers), \
            (extra, [a.message.content for a in answers])
        assert len({a.message.content for a in answers}) >= 5
    # a raw completion can be held too (no suffix)
    r = client.completions.create(model=random_server.id, prompt="code:", seed=2, max_tokens=16,
                                  extra_body={"steps": 6, "guided_regex": REGEXES[0]})
    assert re.fullmatch(REGEXES[0], r.choices[0].text)


def test_a_constraint_the_answer_already_meets_changes_nothing():
    """Greedy on the demo model: its answer matches the expression, so the held run is the free run, step for
    step (the search finds the model's own argmax where it is valid)."""
    from dgemma_cli.engine import load

    engine = load("demo", device="cpu")
    free = engine.generate("upper: hello diffusions", seed=0, temperature=0)
    held = engine.generate("upper: hello diffusions", seed=0, temperature=0,
                           structure=Structure("regex", "[A-Z ]{16}"))
    assert held.texts == free.texts == ["HELLO DIFFUSIONS"]
    assert held.steps_per_canvas == free.steps_per_canvas and held.satisfied == [True]


def test_sample_step_leaves_the_log_probabilities():
    from dgemma_cli.sampler import SamplerBuffers, sample_step

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 4
    buf = SamplerBuffers(6, 50, "cpu")
    buf.logits.copy_(logits)
    t = torch.tensor(0.7)
    _, _, entropy = sample_step(buf, t)
    want = torch.log_softmax(logits / t, dim=-1)
    assert torch.allclose(buf.logits, want, atol=1e-5)
    assert torch.allclose(entropy, -(want.exp() * want).sum(-1), atol=1e-5)


@pytest.mark.slow  # make test's time (a drawn token's law over classes: tests/test_host_search.py)
def test_big_groups_search_as_token_by_token(checkpoints, monkeypatch):
    """Groups above BIG_GROUP tokens, and token classes (a string's characters), are searched through masks: the
    same argmax paths as token by token (outlines-core's automaton, every group a list of tokens), and draws
    distributed as the distribution restricted to the group (the Gumbel-max identity)."""
    import dgemma_cli.structured.constrain as constrain
    from dgemma_cli.structured.structure import outlines_vocabulary, regex_tables
    from dgemma_cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(checkpoints["five_to_one"])
    st = Structure("json_schema", json.dumps(SCHEMAS["nested, optional fields"]))
    exact = constrain.TokenAutomaton(regex_tables(st.regex(), outlines_vocabulary(tok.token_bytes(), 512), 512,
                                                  big_group=10**9))
    monkeypatch.setattr(constrain, "BIG_GROUP", 8)
    monkeypatch.setattr(constrain, "_CACHE", type(constrain._CACHE)())
    masked = constrain.compile_structure(st, tok, 512)
    assert masked.big and not exact.big
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        logp = torch.log_softmax(torch.randn(40, 512, generator=g) * 3, -1)
        a, ok_a = best_path(exact, logp, 0, 40, 0, [1], 0)
        b, ok_b = best_path(masked, logp, 0, 40, 0, [1], 0)
        hinted, ok_h = best_path(masked, logp, 0, 40, 0, [1], 0, hint=logp.argmax(dim=1))  # the sampler's argmax
        assert ok_a and ok_b and ok_h and torch.equal(a, b) and torch.equal(a, hinted)
    word = constrain.compile_structure(Structure("regex", "[a-z]+"), tok, 512)  # one big group from the start
    assert word.big
    logp = torch.log_softmax(torch.randn(1, 512, generator=g) * 2, -1)
    draws = torch.stack([best_path(word, logp, 0, 1, 0, [1], 0, noise=g)[0][0] for _ in range(3000)])
    members = torch.tensor([t for t in range(512) if word.step(0, t) is not None
                            and bool(word.final[word.step(0, t)])])
    want = torch.zeros(512)
    want[members] = logp[0, members].softmax(0)
    seen = torch.bincount(draws, minlength=512).float() / len(draws)
    assert set(draws.tolist()) <= set(members.tolist())
    assert (seen - want).abs().max() < 0.03
    # given the sampler's own draw from the whole distribution (RowConstraint.step(drawn=True)): the same law
    free = torch.multinomial(logp[0].exp(), 3000, replacement=True, generator=g)
    draws = torch.stack([best_path(word, logp, 0, 1, 0, [1], 0, noise=g, hint=free[i : i + 1])[0][0]
                         for i in range(3000)])
    seen = torch.bincount(draws, minlength=512).float() / len(draws)
    assert set(draws.tolist()) <= set(members.tolist())
    assert (seen - want).abs().max() < 0.03


@pytest.fixture(scope="module")
def demo_engine():
    from dgemma_cli.engine import load

    return load("demo", device="cpu")


@pytest.mark.parametrize("rx,limit,whole", [("[A-Z ]{16}", 16, True), ("[A-Z ]{16}", 15, False),
                                            ("[A-Z ]{1,15}", 15, True), ("[A-Z]{5}", 5, True),
                                            ("[A-Z]{6}", 5, False), ("[A-Z]+", 5, True), ("HELLO [A-Z]+", 9, True)])
def test_a_held_answer_keeps_to_max_new_tokens_and_says_whether_it_is_whole(demo_engine, rx, limit, whole):
    """max_new_tokens shorter than the canvas: the answer has at most that many tokens, and `satisfied` says whether
    it is a whole word of the expression (an expression the limit cannot hold is cut short and says so), drawn or
    greedy."""
    for greedy in (False, True):
        r = demo_engine.generate("upper: hello diffusions", seed=0, greedy=greedy, structure=Structure("regex", rx),
                                 max_new_tokens=limit)
        assert len(r.token_ids[0]) <= limit
        assert r.satisfied == [whole] and bool(re.fullmatch(rx, r.texts[0])) == whole, (r.texts, r.satisfied)


def test_the_search_puts_nothing_past_max_new_tokens(demo_engine):
    """A row's searched canvases (argmax and draw) hold pad from max_new_tokens on, whatever the model prefers
    there; a later canvas of an answer that reached the limit is all pad."""
    tok = demo_engine.tokenizer
    auto = compile_structure(Structure("regex", "[A-Z]+"), tok, demo_engine.config.text.vocab_size)
    letters = tok.encode_text("ABCDEFGH")
    V, C = demo_engine.config.text.vocab_size, 8
    logp = torch.full((C, V), -20.0)
    logp[torch.arange(C), torch.tensor(letters)] = 0.0  # the model wants a letter everywhere, never the end
    for limit in (3, 5, 7):
        gen = torch.Generator().manual_seed(0)
        rc = RowConstraint(auto, max_new_tokens=limit, end_ids=[1], pad_id=0, generator=gen)
        sample, argmax = torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.long)
        rc.step(logp, sample, argmax, greedy=False)
        for canvas in (argmax, sample):
            assert canvas.tolist()[:limit] == letters[:limit] and canvas.tolist()[limit:] == [0] * (C - limit)
        rc.end_canvas(argmax.tolist())
        assert rc.satisfied
        rc.step(logp, sample, argmax, greedy=True)  # the next canvas: no room left
        assert argmax.tolist() == [0] * C and sample.tolist() == [0] * C


@pytest.mark.parametrize("kind,source,at,over,count", [  # at: the largest taken; over: its count when one more
    ("regex", "[a-z]{%d}", 512, 513, 513), ("regex", "([a-z]{2}){%d}", 256, 257, 514),
    ("regex", "(x[0-9]{1,4}){%d}", 128, 129, 516), ("grammar", 'start: "a"{%d}', 512, 513, 513),
    ("grammar", 'start: ("a"{2}){%d}', 256, 257, 514),
    ("json_schema", '{"type": "string", "maxLength": %d}', 512, 513, 513),
    ("json_schema", '{"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": %d}', 129, 130, 516)])
def test_repetitions_up_to_max_repeat_are_taken_and_one_more_is_refused(kind, source, at, over, count):
    """Counted repetitions (nested ones multiplied) are refused past MAX_REPEAT, in one line naming the count, in
    expressions, grammars and schemas (their maxLength and maxItems: n items repeat the item's count n - 1 times
    after the first); at the limit they are taken."""
    from dgemma_cli.structured.constrain import MAX_REPEAT

    assert MAX_REPEAT == 512

    def checked(n: int) -> None:
        s = Structure(kind, source % n)
        s.check()
        if kind != "grammar":
            s.regex()

    checked(at)
    with pytest.raises(UsageError) as e:
        checked(over)
    assert f"{count:,}" in str(e.value) and "512" in str(e.value) and "\n" not in str(e.value)
