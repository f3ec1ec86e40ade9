"""One place turns finished canvases into text (dgemma_cli/answer.py AnswerText): `dgemma run`'s streamed answer
(FinishedCanvases) and the server's (serve.AnswerText) are the same text for the same canvases, and what streams
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
