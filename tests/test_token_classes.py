"""The token automaton built over token classes (dgemma_cli/structured/classes.py) against outlines-core's token
Index (structure.regex_tables): the same language over a vocabulary holding what walks through a string's body
(multibyte characters, their bytes alone, escapes, tokens that close a string and go on), the same most probable
canvas, and valid answers from its draws."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from dgemma_cli.structured.classes import NotClassed, class_tables, marked
from dgemma_cli.structured.constrain import TokenAutomaton, best_path
from dgemma_cli.structured.structure import Structure, outlines_vocabulary, regex_tables

EXTRA = ["é", "日本", "語", "\\", "\\n", "\\\"", "n", "n\"", "\",", "\"}", "ab\"", "\"a", "a\",\"", "\", \"", "\":",
         "{\"", "xyz", "hello world", "  ", "\t", "\n", "\"\"", "}", ",", "12", "3.5", "true", "null", "[\"", "\"]"]


def vocabulary() -> list[bytes | None]:
    """Printable ASCII one and two characters long, the pieces above, and the bytes of 'é' and '日' alone (a
    character split over two tokens); ids 0-2 special."""
    words: list[bytes | None] = [None, None, None]
    chars = [chr(c) for c in range(32, 127)]
    words += [c.encode() for c in chars]
    words += [(a + b).encode() for a in "abc\"\\ ,:{}[]" for b in "abc\"\\ ,:{}[]n"]
    words += [w.encode() for w in EXTRA]
    words += [b"\xc3", b"\xa9", b"\xe6", b"\x97\xa5", b"\xe6\x97"]
    seen, out = set(), []
    for w in words:
        if w is None or w not in seen:
            out.append(w)
            seen.add(w)
    return out


WORDS = vocabulary()
V = len(WORDS)

SCHEMAS = {
    "function": {"type": "object", "properties": {"location": {"type": "string"},
                                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                 "required": ["location"], "additionalProperties": False},
    "bounded": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                 "tags": {"type": "array", "items": {"type": "string",
                                                                                      "minLength": 1,
                                                                                      "maxLength": 2}},
                                                 "note": {"type": "string", "minLength": 2}},
                "required": ["name", "tags"]},
    "optional": {"type": "object", "properties": {"a": {"type": "string", "minLength": 2},
                                                  "b": {"anyOf": [{"type": "string"}, {"type": "null"}]}}},
}


def explicit(tables: dict) -> tuple[list[dict[int, int]], list[bool]]:
    """Tables -> each state's {token: next state}, and which states accept."""
    out: list[dict[int, int]] = [{} for _ in range(tables["S"])]
    masks, classes = dict(tables["big"]), dict(tables.get("classes", []))
    for g, (a, b) in enumerate(zip(tables["src"], tables["dst"])):
        if g in masks:
            toks = tables["masks"][masks[g]]
        elif g in classes:
            toks = np.flatnonzero(np.isin(tables["token_class"], tables["class_sets"][classes[g]]))
        else:
            toks = tables["tokens"][tables["offsets"][g] : tables["offsets"][g + 1]]
        for t in np.asarray(toks).tolist():
            assert out[a].get(t, b) == b, "two edges on one token"
            out[a][t] = b
    return out, [d == 0 for d in tables["dist"]]


def same_language(t1: dict, t2: dict) -> str | None:
    """None where the two automata accept the same token sequences, else the first difference found."""
    e1, f1 = explicit(t1)
    e2, f2 = explicit(t2)
    seen, todo = {(0, 0)}, [((0, 0), [])]
    while todo:
        (a, b), path = todo.pop()
        if f1[a] != f2[b] or set(e1[a]) != set(e2[b]):
            return f"after {[WORDS[t] for t in path]}: {sorted(set(e1[a]) ^ set(e2[b]))[:8]}"
        for t, na in e1[a].items():
            pair = (na, e2[b][t])
            if pair not in seen:
                seen.add(pair)
                todo.append((pair, path + [t]))
    return None


def both(regex: str, specials=()):
    return (class_tables(regex, WORDS, V, specials),
            regex_tables(regex, outlines_vocabulary(WORDS, V, specials), V))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schemas_have_the_language_of_the_index(name):
    regex = Structure("json_schema", json.dumps(SCHEMAS[name])).regex()
    assert marked(regex)[1] is not None  # its strings are bodies
    new, old = both(regex)
    assert new["classes"], "no class edges: the bodies were walked token by token"
    assert same_language(new, old) is None


@pytest.mark.parametrize("regex", [r"[0-9]{1,3}", r'"[^"]{2,5}"', r"[a-z ]*\.", r"(?:yes|no|maybe)"])
def test_expressions_have_the_language_of_the_index(regex):
    new, old = both(regex)
    assert same_language(new, old) is None


def test_a_call_with_special_tokens_has_the_language_of_the_index():
    from dgemma_cli.structured.structure import SPECIAL_BASE

    q = f"\\U{SPECIAL_BASE:08X}"
    regex = f"\\U{SPECIAL_BASE + 1:08X}call:f\\{{x:{q}[^<\\U00100000-\\U0010FFFF]{{0,3}}{q}\\}}\\U{SPECIAL_BASE + 2:08X}"
    new, old = both(regex, specials=(0, 1, 2))
    assert new["classes"] and same_language(new, old) is None


def test_an_accepting_state_keeps_its_way_on():
    """outlines-core's Index drops the edges from an accepting state to one that is not: `(?:ab)+` over single
    letters takes 'ab' and stops. The class builder keeps them."""
    new, old = both("(?:ab)+")
    a, b = WORDS.index(b"a"), WORDS.index(b"b")
    auto_new, auto_old = TokenAutomaton(new), TokenAutomaton(old)
    assert auto_new.advance(0, [a, b, a, b]) is not None and bool(auto_new.final[auto_new.advance(0, [a, b, a, b])])
    assert auto_old.advance(0, [a, b, a, b]) is None


def test_two_bounds_at_one_place_are_left_to_the_index():
    regex = Structure("json_schema", json.dumps({"anyOf": [{"type": "string", "maxLength": 1},
                                                           {"type": "string", "maxLength": 3}]})).regex()
    with pytest.raises(NotClassed):
        class_tables(regex, WORDS, V)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_most_probable_canvas_is_the_index_searchs(name):
    """The argmax path over classes equals the token-by-token search's on the same log-probabilities (the same
    optimum), with and without the sampler's argmax as a hint."""
    regex = Structure("json_schema", json.dumps(SCHEMAS[name])).regex()
    new, old = both(regex)
    auto_new, auto_old = TokenAutomaton(new), TokenAutomaton(old)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logp = torch.log_softmax(torch.randn(24, V, generator=g) * 3, dim=1)
        want, ok_old = best_path(auto_old, logp, 0, 24, 40, [1], 2)
        got, ok_new = best_path(auto_new, logp, 0, 24, 40, [1], 2)
        hinted, _ = best_path(auto_new, logp, 0, 24, 40, [1], 2, hint=logp.argmax(dim=1))
        assert ok_new == ok_old and torch.equal(got, want) and torch.equal(hinted, want)


def _answer(auto: TokenAutomaton, seed: int, canvas: int = 12, limit: int = 60) -> tuple[list[int], bool]:
    """An answer made canvas by canvas from draws on random log-probabilities, as the sampler's row does."""
    g = torch.Generator().manual_seed(seed)
    row = auto.row(limit, [1], 2, generator=g)
    out: list[int] = []
    while row.produced < limit and not row.ended:
        logp = torch.log_softmax(torch.randn(canvas, V, generator=g) * 2, dim=1)
        sample, argmax = torch.zeros(canvas, dtype=torch.long), torch.zeros(canvas, dtype=torch.long)
        row.step(logp, sample, argmax, greedy=False)
        kept = sample.tolist()
        assert auto.advance(row.state, [t for t in kept[: kept.index(1)] if t != 2] if 1 in kept else
                            kept[: min(canvas, limit - row.produced)]) is not None or not row.ok
        row.end_canvas(kept)
        out += kept
    return out, row.satisfied


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_drawn_answers_are_valid(name):
    schema = SCHEMAS[name]
    auto = TokenAutomaton(class_tables(Structure("json_schema", json.dumps(schema)).regex(), WORDS, V))
    done = 0
    for seed in range(12):
        ids, ok = _answer(auto, seed)
        if ok:
            text = b"".join(WORDS[t] for t in ids[: ids.index(1)] if 1 in ids).decode() if 1 in ids else \
                b"".join(WORDS[t] for t in ids if t not in (1, 2)).decode()
            jsonschema.validate(json.loads(text), schema)
            done += 1
    assert done >= 6


def test_a_bounded_string_costs_states_not_edges():
    """maxLength 30 against 3: a few more states of the same classes, not a vocabulary's worth of edges each."""
    def tables(n: int) -> dict:
        return class_tables(Structure("json_schema", json.dumps({"type": "string", "maxLength": n})).regex(), WORDS, V)

    small, large = tables(3), tables(30)
    assert large["S"] > small["S"]
    assert len(large["tokens"]) <= 12 * len(small["tokens"]) + 1000
    classes = int(large["token_class"].max()) + 1  # the vocabulary's, the same for every bound
    assert len(large["class_sets"]) <= classes and np.array_equal(large["token_class"], small["token_class"])


def test_random_expressions_over_random_strings():
    """Strings made from the vocabulary's own pieces, checked against Python's re on a few body shapes."""
    import re

    rng = random.Random(3)
    body = r'([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'
    for lo, hi in [(0, 2), (1, 4), (3, None)]:
        regex = f'"{body}{{{lo},{hi if hi is not None else ""}}}"'
        auto = TokenAutomaton(class_tables(regex, WORDS, V))
        for _ in range(300):
            ids = [rng.randrange(3, V) for _ in range(rng.randrange(1, 6))]
            text = b"".join(WORDS[t] for t in ids)
            end = auto.advance(0, ids)
            try:
                whole = re.fullmatch(regex, text.decode()) is not None
            except UnicodeDecodeError:
                whole = False
            assert (end is not None and bool(auto.final[end])) == whole, (text, lo, hi)


@pytest.mark.slow
def test_the_same_optimum_at_the_real_vocabulary():
    """At 262,144 tokens (scripts/bench_structured.py's synthetic vocabulary), the function-calling schema and the
    nested model: the class search's argmax canvas is outlines-core automaton's, on random log-probabilities of a
    whole canvas."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_structure_compile import FUNCTION, PYDANTIC
    from bench_structured import SyntheticVocab

    big = 262_144
    words = SyntheticVocab(big).token_bytes()
    g = torch.Generator().manual_seed(1)
    for schema in (FUNCTION, PYDANTIC):
        regex = Structure("json_schema", json.dumps(schema)).regex()
        new = TokenAutomaton(class_tables(regex, words, big))
        old = TokenAutomaton(regex_tables(regex, outlines_vocabulary(words, big), big))
        logp = torch.log_softmax(torch.randn(64, big, generator=g) * 3, dim=1)
        want, ok_old = best_path(old, logp, 0, 64, 200, [1], 0)
        got, ok_new = best_path(new, logp, 0, 64, 200, [1], 0, hint=logp.argmax(dim=1))
        assert ok_new == ok_old and torch.equal(got, want)
