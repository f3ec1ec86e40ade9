"""One place turns finished canvases into text (dgemma_cli/answer.py AnswerText): `dgemma run`'s streamed answer
(FinishedCanvases) and the server's (server/answering.AnswerText) are the same text for the same canvases, and what streams
is always a prefix of the whole answer."""

from __future__ import annotations

import pytest

from dgemma_cli.answer import AnswerText, FinishedCanvases
from dgemma_cli.engine import load


@pytest.fixture(scope="module")
def tok():
    return load("demo", device="cpu").tokenizer


@pytest.mark.parametrize("text", ["HELLO DIFFUSIONS", "<|channel>thought\nhmm<channel|>  HELLO   WORLD  ",
                                  "AB\n\nCD  EF", "  lead and trail  "])
def test_cli_and_server_text_agree(tok, text):
    settings = load("demo", device="cpu").settings.override(max_new_tokens=200)
    ids = tok.encode(text) + [settings.eos_token_ids[0]]
    canvases = [ids[i : i + 5] for i in range(0, len(ids), 5)]
    written: list[str] = []
    cli = FinishedCanvases(tok, settings, write=written.append)
    server = AnswerText(tok, limit=settings.max_new_tokens, ends=cli.ends, chat=True)
    sent = ""
    for c in canvases:
        cli.add(c, 1, len(c))
        delta, _ = server.add(c)
        sent += delta
        assert cli.answer().startswith("".join(written)) or cli.ended
    final = cli.answer()
    cli.finish(final)
    assert "".join(written) == final + "\n"
    server.finish(server.ids)
    assert server.sent == final == tok.decode_answer(cli.ids)[1]
    assert sent == final[: len(sent)]  # streamed: a prefix


# --------------------------------------------------------------------------- what waits: half characters, stop strings


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    """A tokenizer with byte fallback (tests/tokenizer_fixture.py): a character outside its vocabulary is spelled as
    its UTF-8 bytes, one token each, so a canvas may end halfway through a character (the demo's cannot)."""
    from tokenizer_fixture import build_tokenizer_files

    from dgemma_cli.tokenizer import Tokenizer

    return Tokenizer.from_dir(build_tokenizer_files(tmp_path_factory.mktemp("byte_tok")))


def _stream(tok, ids, size, **kw):
    """ids in canvases of `size`, then the answer finished: (the deltas, the text sent after each canvas)."""
    at = AnswerText(tok, limit=10_000, ends=[tok.eos_id, tok.end_of_turn_id], **kw)
    deltas, sent = [], []
    for i in range(0, len(ids), size):
        deltas.append(at.add(ids[i : i + size]))
        sent.append(at.sent)
    deltas.append(at.finish(at.ids))
    return at, deltas, sent


SPLIT = ["café ☕ ok", "naïve — 日本語 👍🏽 end", "tab\there, ü", "ß"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text", SPLIT)
def test_a_character_split_across_canvases_waits_whole(byte_tok, text, chat):
    """A character whose bytes are in two canvases is sent when its last byte comes, never as U+FFFD; every delta
    only appends; the deltas add up to the final answer."""
    ids = byte_tok.encode_text(text)
    assert any(byte_tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))  # the case under test
    final = text.strip() if chat else text
    for size in (1, 2, 3):
        at, deltas, sent = _stream(byte_tok, ids, size, chat=chat)
        assert not any("\ufffd" in d for d, _ in deltas), (size, deltas)
        assert all(final.startswith(s) for s in sent), (size, sent)
        assert "".join(d for d, _ in deltas) == at.sent == final


def test_a_thought_split_mid_character_waits_whole(byte_tok):
    text = "<|channel>thought\nnaïve ☕ idea<channel|>café ☕"
    ids = byte_tok.encode(text)
    _, deltas, _ = _stream(byte_tok, ids, 1, chat=True)
    assert not any("\ufffd" in d + t for d, t in deltas)
    assert "".join(t for _, t in deltas) == "naïve ☕ idea" and "".join(d for d, _ in deltas) == "café ☕"


@pytest.mark.parametrize("text,stops,final", [
    ("The answer STOP here", ["STOP"], "The answer "),  # a stop: the text before it, nothing of it
    ("The answer STAYS here", ["STOP"], "The answer STAYS here"),  # its first letters, then not a stop
    ("The answer STOP", ["STOP", "answer ST!"], "The answer "),  # two stops, overlapping prefixes
    ("café ☕ ok", ["☕"], "café "),  # a stop of several bytes, split across canvases
    ("café ☕ ok", ["é ☕!"], "café ☕ ok"),  # a prefix of a stop over a half character, then not a stop
])
def test_a_possible_stop_string_waits_until_it_is_known(byte_tok, text, stops, final):
    """The end of the text that could begin a stop string is not sent until the next canvas tells: a stop cuts
    the answer before it, with nothing of it ever sent; text that turns out not to be one is sent then. What is
    sent is always a prefix of the final answer, and the deltas add up to it."""
    ids = byte_tok.encode_text(text)
    for size in (1, 2):
        at, deltas, sent = _stream(byte_tok, ids, size, chat=False, stops=stops)
        assert all(final.startswith(s) for s in sent), (size, sent)
        assert "".join(d for d, _ in deltas) == at.sent == final
        assert at.stopped == (final != text)
        assert not any("\ufffd" in d for d, _ in deltas)
    at = AnswerText(byte_tok, limit=10_000, ends=[byte_tok.eos_id], chat=False, stops=["STOP"])
    assert at.add(byte_tok.encode_text("The answer ST"))[0] == "The answer "  # held: it may be a stop
    assert at.add(byte_tok.encode_text("AY."))[0] == "STAY."  # known now: not one


def test_dgemma_run_never_writes_half_a_character(byte_tok):
    """`dgemma run`'s stdout (FinishedCanvases): canvas by canvas, never U+FFFD, and at the end the answer and a
    newline."""
    from types import SimpleNamespace

    ids = byte_tok.encode_text("naïve — 日本語 👍🏽 end") + [byte_tok.end_of_turn_id]
    settings = SimpleNamespace(max_new_tokens=200, eos_token_ids=(byte_tok.eos_id,))
    written: list[str] = []
    cli = FinishedCanvases(byte_tok, settings, write=written.append)
    for i in range(0, len(ids), 3):
        canvas = ids[i : i + 3]
        cli.add(canvas + [0] * (3 - len(canvas)), 1, len(canvas))
        assert "\ufffd" not in "".join(written)
    cli.finish(cli.answer())
    assert "".join(written) == "naïve — 日本語 👍🏽 end\n"
