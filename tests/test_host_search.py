"""A held row's search on the host over token classes (dgemma_cli/structured/host_search.py): each class's best score
and log-mass as the row's own tokens give them (the biggest class's from what the others leave), draws with the law
of the distribution restricted to what the structure allows, and the argmax path the device programme's reference's
(tests/test_device_search.py `reference_step`: the same optimum, found another way)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dgemma_cli.structured.classes import class_tables
from dgemma_cli.structured.constrain import TokenAutomaton, best_path
from dgemma_cli.structured.device_search import device_tables
from dgemma_cli.structured.host_search import _draw_rows, host_tables, search, values
from dgemma_cli.structured.structure import Structure
from test_device_search import reference_step
from test_token_classes import SCHEMAS, V, WORDS

END, PAD = 1, 2


def automaton(source: str, kind: str = "json_schema") -> TokenAutomaton:
    regex = Structure(kind, source).regex()
    return TokenAutomaton(class_tables(regex, WORDS, V))


def scores(P: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(P, V, generator=g) * 3, dim=1)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_each_class_value_is_its_tokens(name):
    """Per position and class: the best score (the biggest class's wherever it can decide a set's best) and the
    log-mass equal the row's own over the class's tokens, the biggest class's mass from what the others leave and,
    at a position where nearly all the mass lies outside it, from its own tokens; a token no row can take is no
    token."""
    auto = automaton(json.dumps(SCHEMAS[name]))
    h = host_tables(auto, [END], PAD)
    cls = torch.from_numpy(h.class_of)
    logp = scores(6, 1)
    logp[1, cls == h.big] -= 40.0  # nearly all the mass outside the biggest class
    logp[2, 7] = -float("inf")
    logp = torch.log_softmax(logp, dim=1)
    argmax = logp.argmax(dim=1)
    cv = values(h, logp, argmax, True, torch.Generator().manual_seed(0))
    decides = (cls[argmax] == h.big).numpy() | h.unsure[cls[argmax].numpy()]
    for c in range(h.t.classes + 1):
        toks = torch.nonzero(cls == c).flatten()
        if not toks.numel():
            continue
        best, mass = logp[:, toks].max(dim=1).values, torch.logsumexp(logp[:, toks], dim=1)
        rows = decides if c == h.big else np.ones(6, dtype=bool)
        assert torch.equal(torch.from_numpy(cv.best[rows, c]), best[torch.from_numpy(rows)]), c
        assert torch.allclose(torch.from_numpy(cv.mass[:, c]), mass, atol=2e-4, rtol=1e-5), c
    assert np.isfinite(cv.drawn).sum() == np.isfinite(cv.mass).sum()


def test_the_two_level_draw_has_the_rows_law():
    """_draw_rows: a row's draws fall on each token as often as its weight says, zero weights never, a row whose
    length is not a whole number of chunks included."""
    g = torch.Generator().manual_seed(5)
    p = torch.rand(2, 1000, generator=g) ** 4
    p[:, ::3] = 0.0
    n = 40000
    u = torch.rand(n, generator=g)
    rows = torch.arange(n) % 2
    picked = _draw_rows(p[rows], u, chunk=64)
    for r in range(2):
        seen = torch.bincount(picked[rows == r], minlength=1000).float() / (n // 2)
        want = p[r] / p[r].sum()
        assert (seen[::3] == 0).all()
        assert (seen - want).abs().max() < 0.006


def test_a_drawn_token_has_the_law_of_what_the_structure_allows():
    """One position whose allowed tokens span several classes, the biggest among them: the drawn token falls on
    each allowed token as the distribution restricted to them says, with the sampler's free draw given (it lands in
    the biggest class at some positions and not at others) and without it."""
    auto = automaton('([a-z]+|"[a-z]*|[0-9]+)x', "regex")
    allowed = torch.tensor([t for t in range(V) if auto.step(0, t) is not None])
    assert len({int(device_tables(auto, [END], PAD).class_of[t]) for t in allowed}) >= 3
    logp = scores(1, 2)
    want = torch.zeros(V)
    want[allowed] = logp[0, allowed].softmax(0)
    g = torch.Generator().manual_seed(3)
    free = torch.multinomial(logp[0].exp(), 3000, replacement=True, generator=g)
    for hint in (None, free):
        draws = torch.stack([best_path(auto, logp, 0, 1, 40, [END], PAD, noise=g,
                                       hint=None if hint is None else hint[i : i + 1])[0][0] for i in range(3000)])
        seen = torch.bincount(draws, minlength=V).float() / len(draws)
        assert set(draws.tolist()) <= set(allowed.tolist())
        assert (seen - want).abs().max() < 0.03


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_argmax_path_is_the_references(name):
    """The argmax path and `ok`, with room to end and cut short, from the start and from inside: those of the
    device programme's reference (per-class keys, each set's best, the programme over edges), which reads every
    class's tokens where the host search reads around the biggest one."""
    auto = automaton(json.dumps(SCHEMAS[name]))
    t = device_tables(auto, [END], PAD)
    h = host_tables(auto, [END], PAD)
    for seed, (room, after, state) in enumerate([(12, 40, 0), (6, 1, 0), (12, 40, 3)]):
        logp = scores(12, 20 + seed)
        want, _, ok = reference_step(t, logp, state, room, after, PAD, None)
        (path, got_ok), (drawn, _) = search(h, logp[:room], state, after, logp[:room].argmax(dim=1), None, True,
                                            torch.Generator().manual_seed(seed))
        assert torch.equal(torch.from_numpy(path), want[:room]) and got_ok == ok, (room, after, state)
        assert auto.advance(state, [x for x in drawn.tolist() if x not in (END, PAD)]) is not None


@pytest.mark.slow  # make test's time: the slow suite (CI) runs it
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_two_hundred_seeds_keep_prefixes_and_end_valid(name):
    """200 seeds of random log-probabilities, canvases kept as the search writes them from the sampler's own draw
    and argmax (RowConstraint.step(drawn=True), as the sampler's step hands them): every kept canvas is a prefix of
    a word of the language, and every answer that ends validates against the schema."""
    import jsonschema

    schema = SCHEMAS[name]
    auto = automaton(json.dumps(schema))
    ended = 0
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        row = auto.row(60, [END], PAD, generator=g)
        ids: list[int] = []
        while row.produced < 60 and not row.ended:
            logp = torch.log_softmax(torch.randn(12, V, generator=g) * 2, dim=1)
            sample = (logp.exp() / torch.empty_like(logp).exponential_(generator=g)).argmax(dim=1)
            argmax = logp.argmax(dim=1)
            row.step(logp, sample, argmax, greedy=False, drawn=True)
            kept = sample.tolist()
            text = [t for t in kept[: kept.index(END)] if t != PAD] if END in kept else kept[: 60 - row.produced]
            assert auto.advance(row.state, text) is not None, (seed, kept)
            row.end_canvas(kept)
            ids += kept
        if row.satisfied:
            body = ids[: ids.index(END)] if END in ids else [t for t in ids if t != PAD]
            jsonschema.validate(json.loads(b"".join(WORDS[t] for t in body).decode()), schema)
            ended += 1
    assert ended >= 150, ended
