"""Tool calls in Gemma 4's own format (docs/serve.md, Tool calls): rendering a conversation with tools, reading the
calls out of an answer, and the grammar that holds an answer to a call (tool_choice "required" or a named function).

Gemma 4 writes values in its own notation, not JSON: strings between `<|"|>` marks, bare keys, objects `{k:v,...}`
with keys in the chat template's `dictsort` order (sorted ignoring case: `key_order`), arrays `[...]`, numbers, true,
false, null. A call is
`<|tool_call>call:NAME{key:value,...}<tool_call|>`; several calls may follow one another; a tool's answer comes back
as `<|tool_response>response:NAME{value:...}<tool_response|>` inside the model's turn, and the model goes on there.
A checkpoint's chat template renders tools itself when it knows them; for one that does not (the bundled demos,
test fixtures), `render_tool_chat` writes the same format. This module knows text and token ids, not the model.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
from typing import Any

from .errors import UsageError

QUOTE = '<|"|>'
CALL_START, CALL_END = "<|tool_call>", "<tool_call|>"
RESPONSE_START, RESPONSE_END = "<|tool_response>", "<tool_response|>"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")


def key_order(keys) -> list:
    """Keys in the order Gemma 4's chat template writes an object's (jinja's `dictsort`: sorted ignoring case, ties
    kept in their given order): the order the model reads arguments in, and writes them in a required call."""
    return sorted(keys, key=lambda k: k.lower() if isinstance(k, str) else k)


def gemma_value(v: Any) -> str:
    """A JSON value in Gemma 4's notation."""
    if isinstance(v, str):
        return QUOTE + v + QUOTE
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{gemma_value(v[k])}" for k in key_order(v)) + "}"
    if isinstance(v, list):
        return "[" + ",".join(gemma_value(x) for x in v) + "]"
    return gemma_value(str(v))


def _declaration(schema: Any) -> Any:
    """A parameters schema as Gemma 4 declares it: types upper-cased (STRING, OBJECT, ...), the rest as given."""
    if isinstance(schema, dict):
        return {k: (v.upper() if k == "type" and isinstance(v, str) else _declaration(v)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_declaration(x) for x in schema]
    return schema


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's `tools` -> their function objects, checked (UsageError names the problem)."""
    if not isinstance(tools, list):
        raise UsageError("'tools' must be a list")
    out = []
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
            raise UsageError(f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             "...}} with a name of letters, digits, _ . - (at most 64)")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise UsageError(f"tools[{k}].function.parameters must be a JSON schema object")
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": params})
    if len({f["name"] for f in out}) != len(out):
        raise UsageError("two tools have the same name")
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else json.dumps(content)


def render_tool_chat(messages: list[dict], tools: list[dict] | None, *, bos: str, enable_thinking: bool = False,
                     add_generation_prompt: bool = True) -> str:
    """A conversation with tools in Gemma 4's format, for checkpoints whose template does not render tools.
    messages are OpenAI's (assistant `tool_calls`, `role: tool` with `tool_call_id`); tools from `check_tools`."""
    out, first = [bos], 0
    system = bool(messages) and messages[0].get("role") in ("system", "developer")
    if tools or system or enable_thinking:
        out.append("<|turn>system\n" + ("<|think|>" if enable_thinking else ""))
        if system:
            out.append(_text(messages[0].get("content")))
            first = 1
        for fn in tools or []:
            decl = {"description": fn["description"], "parameters": _declaration(fn["parameters"])}
            out.append("<|tool>declaration:" + fn["name"] + gemma_value(decl) + "<tool|>")
        out.append("<turn|>\n")
    names: dict[str, str] = {}  # tool_call_id -> the function it called
    in_model = False  # a model turn left open by its tool calls: the responses come inside it
    for m in messages[first:]:
        role = m.get("role")
        if role == "tool":
            if not in_model:
                out.append("<|turn>model\n")
                in_model = True
            name = names.get(m.get("tool_call_id"), m.get("name") or "tool")
            out.append(f"{RESPONSE_START}response:{name}{{value:{gemma_value(_text(m.get('content')))}}}"
                       f"{RESPONSE_END}")
            continue
        if in_model:
            out.append("<turn|>\n")
            in_model = False
        out.append("<|turn>" + ("model" if role == "assistant" else role) + "\n" + _text(m.get("content")))
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls:
            for call in calls:
                fn = call.get("function", {})
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    raise UsageError(f"a tool call's arguments are not JSON: {str(args)[:80]}") from None
                names[call.get("id", "")] = fn.get("name", "tool")
                out.append(f"{CALL_START}call:{fn.get('name', 'tool')}{gemma_value(args)}{CALL_END}")
            in_model = True
            continue
        out.append("<turn|>\n")
    if add_generation_prompt and not in_model:
        out.append("<|turn>model\n")
    return "".join(out)


# ----------------------------------------------------------------------------------------------- reading calls


_PYTHON_LITERALS = {"None": None, "True": True, "False": False}


class _Reader:
    """Gemma 4's value notation -> Python values (strings between <|"|> marks or JSON double quotes)."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \n\t\r":
            self.i += 1

    def value(self) -> Any:
        self.ws()
        s, i = self.s, self.i
        if s.startswith(QUOTE, i):
            end = s.find(QUOTE, i + len(QUOTE))
            if end < 0:
                raise ValueError("unterminated string")
            self.i = end + len(QUOTE)
            return s[i + len(QUOTE) : end]
        if s.startswith('"', i):
            value, self.i = json.JSONDecoder().raw_decode(s, i)
            return value
        if s.startswith("{", i):
            self.i += 1
            out = {}
            self.ws()
            if self.s.startswith("}", self.i):
                self.i += 1
                return out
            while True:
                self.ws()
                if self.s.startswith(QUOTE, self.i) or self.s.startswith('"', self.i):
                    key = self.value()
                else:
                    m = re.compile(r"[A-Za-z0-9_.\-$]+").match(self.s, self.i)
                    if not m:
                        raise ValueError(f"a key at {self.i}")
                    key, self.i = m.group(0), m.end()
                self.ws()
                if not self.s.startswith(":", self.i):
                    raise ValueError(f"':' at {self.i}")
                self.i += 1
                out[key] = self.value()
                self.ws()
                if self.s.startswith(",", self.i):
                    self.i += 1
                    continue
                if self.s.startswith("}", self.i):
                    self.i += 1
                    return out
                raise ValueError(f"',' or '}}' at {self.i}")
        if s.startswith("[", i):
            self.i += 1
            out_list: list = []
            self.ws()
            if self.s.startswith("]", self.i):
                self.i += 1
                return out_list
            while True:
                out_list.append(self.value())
                self.ws()
                if self.s.startswith(",", self.i):
                    self.i += 1
                    continue
                if self.s.startswith("]", self.i):
                    self.i += 1
                    return out_list
                raise ValueError(f"',' or ']' at {self.i}")
        m = re.compile(r"true|false|null|None|True|False|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?").match(s, i)
        if not m:
            raise ValueError(f"a value at {i}")
        self.i = m.end()
        # None, True, False: how the published chat template writes a null or a boolean argument (jinja prints a
        # Python value), so a model that learned from it may write them back
        return _PYTHON_LITERALS.get(m.group(0)) if m.group(0) in _PYTHON_LITERALS else json.loads(m.group(0))


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """An answer decoded with its special tokens -> (the text outside the call blocks, [{"name", "arguments"}]).
    A call is complete once its arguments' object is closed: a block cut short (max_tokens, a broken tail) gives
    the calls completed before the cut, and its unfinished rest is dropped, never returned as text. A closed block
    in which no call completes stays in the text (the caller strips special tokens from it, or cuts the text where
    the first block starts, as AnswerText does)."""
    calls, pieces, pos = [], [], 0
    for m in re.finditer(re.escape(CALL_START) + r"(.*?)(?:" + re.escape(CALL_END) + r"|$)", text, re.S):
        body, found = m.group(1), []
        r = _Reader(body)
        try:
            while True:
                r.ws()
                if r.i >= len(body):
                    break
                head = re.compile(r"call:(" + NAME.pattern + r")").match(body, r.i)
                if not head:
                    raise ValueError("no call")
                r.i = head.end()
                args = r.value()
                if not isinstance(args, dict):
                    raise ValueError("arguments are not an object")
                found.append({"name": head.group(1), "arguments": args})
        except (ValueError, json.JSONDecodeError, RecursionError):
            pass  # the calls before this point are whole; the rest of the block is not a call
        if not found and m.group(0).endswith(CALL_END):
            continue
        pieces.append(text[pos : m.start()])
        pos = m.end()
        calls += found
    pieces.append(text[pos:])
    return "".join(pieces), calls


def openai_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls as OpenAI's message.tool_calls."""
    return [{"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


# ------------------------------------------------------------------------------------------ holding to a call


def _bound(value: Any, default: int) -> int:
    """A schema's numeric bound as an integer within +-10^10 (a client's schema may hold anything there)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return default
    return int(max(-(10**10 - 1), min(10**10 - 1, value)))


KEY = re.compile(r"[A-Za-z0-9_.\-$]{1,64}")  # a key Gemma 4's notation writes bare (as _Reader reads it back)
# What the call grammar holds a value to, once check_call_parameters has inlined the $refs (structure.prepare_schema:
# $ref, $defs and annotations such as title, description and default are gone by then). A keyword outside these
# would be ignored, and a call could break it: refused.
_CALL_KEYWORDS = {"type", "properties", "required", "items", "enum", "const", "minimum", "maximum",
                  "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "minItems", "maxItems",
                  "additionalProperties", "anyOf", "oneOf", "allOf", "nullable", "format"}
STRING_CAP = 512  # the most characters of a string in a required call (fewer where max_tokens asks: call_grammar)
ITEMS_CAP = 64  # the most items of an array in a required call (idem)
ROOM = 32  # parallel calls are offered while each still has strings of this many characters (call_grammar)
_SCALARS = ("string", "integer", "number", "boolean", "null")


def check_call_parameters(name: str, params: Any) -> dict:
    """A function's parameters -> the schema its required call is held to ($refs inlined from $defs / definitions,
    a reference nested in itself at most structure.REF_DEPTH times, as for response_format; branches no value can
    take pruned). UsageError, naming the tool and the place, for parameters a call could not be written to or held
    to: not an object schema, a key the call notation cannot write, a keyword the call grammar would ignore."""
    from .structured.structure import prepare_schema

    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise UsageError(f"tool '{name}': its parameters must be an object schema ({{'type': 'object', "
                         f"'properties': ...}}) for a call to be required")
    try:
        prepared = prepare_schema(params)
    except UsageError as e:
        raise UsageError(f"tool '{name}': {e}") from None

    def walk(schema: Any, where: str) -> None:
        if schema is False:
            return
        if not isinstance(schema, dict):
            raise UsageError(f"tool '{name}': the parameter schema at {where} is not an object")
        for key in schema:
            if key not in _CALL_KEYWORDS:
                raise UsageError(f"tool '{name}': '{key}' at {where} cannot be held in a required call (supported: "
                                 f"{', '.join(sorted(_CALL_KEYWORDS | {'$ref', '$defs'}))}, and annotations)")
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise UsageError(f"tool '{name}': properties at {where} must be an object")
        for key, sub in props.items():
            if not KEY.fullmatch(key):
                raise UsageError(f"tool '{name}': the parameter name {json.dumps(key)[:80]} at {where} cannot be "
                                 f"written in a call (letters, digits and _ . - $, at most 64)")
            walk(sub, f"{where}/properties/{key}")
        for key in ("anyOf", "oneOf", "allOf"):
            for i, sub in enumerate(schema.get(key) or []):
                walk(sub, f"{where}/{key}/{i}")
        if isinstance(schema.get("items"), dict):
            walk(schema["items"], f"{where}/items")
        elif "items" in schema and schema["items"] is not False:
            raise UsageError(f"tool '{name}': items at {where} must be one schema (a tuple's cannot be held in a "
                             f"required call)")
        kind = schema.get("type")
        if kind is not None and not (isinstance(kind, str) or (isinstance(kind, list) and kind and all(
                isinstance(k, str) for k in kind))):
            raise UsageError(f"tool '{name}': type at {where} must be a string or a list of strings")
        if "number" in ([kind] if isinstance(kind, str) else kind or []) and any(
                k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            raise UsageError(f"tool '{name}': a number's range at {where} cannot be held in a required call (an "
                             f"integer's can)")

    walk(prepared, "#")
    return prepared


@functools.lru_cache(maxsize=256)
def _integer(lo: int, hi: int) -> tuple[str, int]:
    """(the expression of the integers lo..hi, the product of its counted repetitions)."""
    from .structured.structure import integer_regex, repeat_product

    regex = integer_regex(lo, hi)
    return regex, repeat_product(regex)


class _Lark:
    """call_grammar's notation: llguidance's Lark, a rule per distinct value (named, shared by equal values)."""

    def __init__(self, quote: int | None):
        self.q = self.token(quote) if quote is not None else json.dumps(QUOTE)
        self.quote_cost = 1 if quote is not None else len(QUOTE.encode())
        self.rules: list[str] = []
        self.named: dict[str, str] = {}  # a rule's body -> its name: equal values share one rule

    def token(self, token_id: int) -> str:
        return f"<[{token_id}]>"

    def lit(self, text: str) -> str:
        return json.dumps(text)

    def seq(self, *parts: str) -> str:
        return " ".join(parts)

    def alt(self, name: str, bodies: list[str]) -> str:
        body = " | ".join(f"({b})" if len(bodies) > 1 else b for b in bodies)
        if body not in self.named:
            self.named[body] = name
            self.rules.append(f"{name}: {body}")
        return self.named[body]

    def repeat(self, item: str, lo: int, hi: int | None) -> str:
        return f"({item}){{{lo},{hi}}}" if hi is not None else f"({item})*" if lo == 0 else f"({item})+"

    def optional(self, item: str) -> str:
        return f"({item})?"

    def pattern(self, regex: str) -> str:
        return f"/{regex}/"

    def string(self, lo: int, hi: int | None) -> str:
        return f"{self.q} /[^<]{{{lo},{hi}}}/ {self.q}"


class _Regex:
    """call_regex's notation: one regular expression, every value inlined; special tokens as the characters
    structure.SPECIAL_BASE + k (k: their index in `specials`): Unicode's last private-use plane, which no text token
    of the compiled vocabulary spells (structure.outlines_vocabulary(specials=...) leaves out the tokens that hold a
    byte of it), so that a special token is written only as its own id."""

    def __init__(self, quote: int | None):
        from .structured.structure import SPECIAL_BASE

        self.base = SPECIAL_BASE
        self.specials: list[int] = []
        self.q = self.token(quote) if quote is not None else re.escape(QUOTE)
        self.quote_cost = 1 if quote is not None else len(QUOTE.encode())

    def token(self, token_id: int) -> str:
        if token_id not in self.specials:
            self.specials.append(token_id)
        return f"\\U{self.base + self.specials.index(token_id):08X}"

    def lit(self, text: str) -> str:
        if any(ord(c) >= self.base for c in text):
            raise UsageError("a tool's schema holds a character of Unicode's plane 16 (U+100000 and above), which a "
                             "call cannot be held to")
        return re.escape(text)

    def seq(self, *parts: str) -> str:
        return "".join(parts)

    def alt(self, name: str, bodies: list[str]) -> str:
        return f"(?:{'|'.join(dict.fromkeys(bodies))})" if len(set(bodies)) > 1 else f"(?:{bodies[0]})"

    def repeat(self, item: str, lo: int, hi: int | None) -> str:
        return f"(?:{item}){{{lo},{hi if hi is not None else ''}}}"

    def optional(self, item: str) -> str:
        return f"(?:{item})?"

    def pattern(self, regex: str) -> str:
        return f"(?:{regex})"

    def string(self, lo: int, hi: int | None) -> str:
        count = f"{{{lo},{hi}}}" if hi is not None else "*" if lo == 0 else f"{{{lo},}}"
        return f"{self.q}[^<\\U{self.base:08X}-\\U0010FFFF]{count}{self.q}"


class _CallRules:
    """The rules of a call for one bound on what is unbounded, in a notation (`_Lark`: call_grammar's, `_Regex`:
    call_regex's): strings of at most `chars` characters, arrays of at most `items` items (None: unbounded, which
    the automaton search can take: it knows how many tokens finishing takes). Each value comes with the most tokens
    it can take (a text token holds at least one byte, or one character of a string; the quote, where the
    vocabulary has its token, is one), the product of its nested counted repetitions (structure.check_grammar holds
    grammars to MAX_REPEAT) and the automaton states its strings' characters take (each is an edge for nearly every
    token of the vocabulary: call_regex's size)."""

    def __init__(self, syntax, chars: int | None, items: int | None):
        self.s, self.chars, self.items = syntax, chars, items

    def value(self, v: Any) -> str:
        """A fixed value (an enum's, a const) in the notation: its strings between quote marks, as the model writes
        them (the quote's text, a control token's, is never spelled by text tokens)."""
        s = self.s
        if isinstance(v, str):
            return s.seq(s.q, s.lit(v), s.q) if v else s.seq(s.q, s.q)
        if isinstance(v, dict):
            items = [s.seq(s.lit(k + ":"), self.value(v[k])) for k in key_order(v)]
            return s.seq(s.lit("{"), *_commas(s, items), s.lit("}"))
        if isinstance(v, list):
            return s.seq(s.lit("["), *_commas(s, [self.value(x) for x in v]), s.lit("]"))
        return s.lit(gemma_value(v))

    def add(self, name: str, alternatives: list[tuple[str, int, int, int]]) -> tuple[str, int, int, int]:
        return (self.s.alt(name, [b for b, _, _, _ in alternatives]), max(a[1] for a in alternatives),
                max(a[2] for a in alternatives), sum(a[3] for a in alternatives))

    def rule(self, schema: Any, name: str) -> tuple[str, int, int, int]:
        """(a value of the prepared `schema` in the notation, its most tokens, its repetition product, its string
        states)."""
        s = self.s
        schema = schema if isinstance(schema, dict) else {}
        for key in ("anyOf", "oneOf"):  # alternatives (oneOf's are not told apart: a value of either is written)
            if key in schema:
                return self.add(name, [self.rule(x, f"{name}_{i}") for i, x in enumerate(schema[key])])
        if "allOf" in schema:  # of one schema (prepare_schema refuses more): pydantic's allOf: [{$ref}]
            return self.rule(schema["allOf"][0] if schema["allOf"] else {}, name)
        if schema.get("nullable") is True:
            rest = {k: v for k, v in schema.items() if k != "nullable"}
            return self.add(name, [self.rule(rest, name + "_v"), (s.lit("null"), 4, 1, 0)])
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            if not isinstance(values, list) or not values:
                raise UsageError("a tool parameter's enum must be a non-empty list")
            return self.add(name, [(self.value(v), len(gemma_value(v).encode()), 1, 0) for v in values])
        kind = schema.get("type")
        if kind is None:  # the type its keywords imply, else any scalar (a value of any type is valid)
            kind = "object" if "properties" in schema or "required" in schema else "array" if "items" in schema \
                else "string" if "minLength" in schema or "maxLength" in schema else list(_SCALARS)
        if isinstance(kind, list):
            kinds = list(dict.fromkeys(kind))
            if len(kinds) == 1:
                kind = kinds[0]
            else:
                return self.add(name, [self.rule({**schema, "type": k}, f"{name}_{k}") for k in kinds])
        if kind == "object":
            props = schema.get("properties") or {}
            parts, worst, rep, states = [], 2 + max(0, len(props) - 1), 1, 0
            for i, k in enumerate(key_order(props)):  # every property, optional ones too (still valid)
                sub, w, r, n = self.rule(props[k], f"{name}_{i}")
                parts.append(s.seq(s.lit(k + ":"), sub))
                worst, rep, states = worst + len(k.encode()) + 1 + w, max(rep, r), states + n
            return self.add(name, [(s.seq(s.lit("{"), *_commas(s, parts), s.lit("}")), worst, rep, states)])
        if kind == "array":
            lo = max(0, min(_bound(schema.get("minItems"), 0), ITEMS_CAP))
            hi = _most(schema.get("maxItems"), lo, ITEMS_CAP, self.items)
            if schema.get("items") is False or hi == 0:
                return self.add(name, [(s.seq(s.lit("["), s.lit("]")), 2, 1, 0)])
            item, w, r, n = self.rule(schema.get("items", {}), name + "_item")
            more = s.repeat(s.seq(s.lit(","), item), max(lo - 1, 0), None if hi is None else hi - 1) \
                if hi is None or hi > 1 else ""
            body = s.seq(s.lit("["), item, more, s.lit("]")) if lo else \
                s.seq(s.lit("["), s.optional(s.seq(item, more)), s.lit("]"))
            copies = 2 if hi is None else hi  # a bounded array's items are each their own states; a loop's, one
            return self.add(name, [(body, 2 + (hi or 1) * w + (hi or 1) - 1, max((hi or 2) - 1, 1) * r,
                                    copies * n)])
        if kind == "integer":
            lo = max(_bound(schema.get("minimum"), -(10**10 - 1)),
                     _bound(math.floor(_bound(schema.get("exclusiveMinimum"), -(10**10))) + 1, -(10**10 - 1)))
            hi = min(_bound(schema.get("maximum"), 10**10 - 1),
                     _bound(math.ceil(_bound(schema.get("exclusiveMaximum"), 10**10)) - 1, 10**10 - 1))
            if lo > hi:
                raise UsageError(f"a tool parameter's integer range [{lo}, {hi}] holds no integer")
            if self.chars is None and not any(k in schema for k in _BOUNDS):  # any integer: the search finishes it
                return self.add(name, [(s.pattern("-?(0|[1-9][0-9]*)"), 11, 1, 0)])
            regex, rep = _integer(lo, hi)  # the walk's: unbounded ones as integers of at most 10 digits
            return self.add(name, [(s.pattern(regex), max(len(str(lo)), len(str(hi))), rep, 0)])
        if kind == "number":
            if self.chars is None:
                return self.add(name, [(s.pattern(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?"), 17, 1, 0)])
            # digits bounded: a walk without lookahead must be able to finish a number
            return self.add(name, [(s.pattern(r"-?(0|[1-9][0-9]{0,8})(\.[0-9]{1,6})?"), 17, 8, 0)])
        if kind == "boolean":
            return self.add(name, [(s.lit("true"), 5, 1, 0), (s.lit("false"), 5, 1, 0)])
        if kind == "null":
            return self.add(name, [(s.lit("null"), 4, 1, 0)])
        if kind != "string":
            raise UsageError(f"a tool parameter has the unknown type {json.dumps(kind)[:40]}")
        # A string's characters: anything but '<', so that no argument spells a control token's text (a quote
        # written as text would end the string early where the vocabulary has no quote token). The closing quote
        # may follow any character: the string can always end, and must within its bound.
        lo = max(0, min(_bound(schema.get("minLength"), 0), STRING_CAP))
        hi = _most(schema.get("maxLength"), lo, STRING_CAP, self.chars)
        return self.add(name, [(s.string(lo, hi), 2 * s.quote_cost + (hi or 0), max(hi or 1, 1),
                                1 if hi is None else hi + 1)])


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _most(given: Any, lo: int, cap: int, room: int | None) -> int | None:
    """The most characters (items) a string (an array) is held to: its schema's bound, at most `cap` and `room`
    (None: no room asked, where a missing bound leaves it unbounded), never under `lo`."""
    most = _bound(given, None)
    if most is None:
        return None if room is None else max(lo, min(cap, room))
    return max(lo, min(most, cap, room if room is not None else cap))


def _commas(s, items: list[str]) -> list[str]:
    """Items separated by commas, in the notation."""
    out: list[str] = []
    for i, x in enumerate(items):
        out += [s.lit(","), x] if i else [x]
    return out


def call_grammar(functions: list[dict], call_start: int, call_end: int, quote: int | None, most: int = 1,
                 max_tokens: int | None = None) -> str:
    """A Lark grammar (llguidance's dialect) for one to `most` calls of `functions`, each with arguments that fit
    its parameters schema, between the call tokens (by id); strings between the quote token (by id) or, where the
    vocabulary has none, its characters. Every property a schema lists is written, in key_order (optional ones
    too: still valid); anyOf / oneOf / a type list are alternatives, null is `null`.

    The grammar walk (constrain.GrammarRowConstraint) does not look ahead: a string or an array is closed only when
    the model prefers closing it, or when its bound leaves nothing else, and a model that never prefers the close
    (the demos never write the quote) would run to max_tokens with no call. So everything is bounded, and bounded
    so that the calls fit in `max_tokens`: integers by their range (10 digits), numbers by 17 characters, strings
    by their maxLength and arrays by their maxItems but never past the most that lets every call finish (at most
    STRING_CAP characters, ITEMS_CAP items), and calls in a row (`most`) only while each keeps strings of ROOM
    characters. A required call that cannot fit at all (max_tokens below its skeleton) runs to "length"."""
    from .structured.structure import MAX_REPEAT

    schemas = [(fn["name"], check_call_parameters(fn["name"], fn["parameters"])) for fn in functions]
    budget = max_tokens if max_tokens is not None else 10**9

    @functools.lru_cache(maxsize=None)
    def build(chars: int, k: int) -> tuple[str, bool]:
        lark = _Lark(quote)
        rules = _CallRules(lark, chars, min(ITEMS_CAP, chars // 8))
        calls, worst, rep = [], 0, 1
        for i, (name, schema) in enumerate(schemas):
            args, w, r, _ = rules.rule({**schema, "type": "object"}, f"args{i}")
            calls.append(lark.seq(lark.lit("call:" + name), args))
            worst, rep = max(worst, len(("call:" + name).encode()) + w), max(rep, r)
        more = "".join(" (call" for _ in range(k - 1)) + ")?" * (k - 1)
        text = "\n".join([f"start: {lark.token(call_start)} call{more} {lark.token(call_end)}",
                          "call: " + " | ".join(calls),
                          *lark.rules]) + "\n"
        return text, 3 + k * worst <= budget and rep <= MAX_REPEAT  # the call tokens, the calls, the end

    @functools.lru_cache(maxsize=None)
    def widest(k: int) -> int:
        """The longest string bound (0..STRING_CAP) with which k calls fit; -1 where none does."""
        if not build(0, k)[1]:
            return -1
        lo, hi = 0, STRING_CAP
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if build(mid, k)[1] else (lo, mid - 1)
        return lo

    one = widest(1)
    k = most if one >= 0 else 1
    while k > 1 and widest(k) < min(ROOM, one):
        k -= 1
    return build(max(widest(k), 0), k)[0]


def call_regex(functions: list[dict], call_start: int, call_end: int, quote: int | None,
               most: int = 1) -> tuple[str, list[int], int]:
    """The language of call_grammar as one regular expression, for the automaton search (constrain.best_path), which
    looks ahead: it knows how many tokens finishing a call takes from each state, so nothing needs a bound to be
    closed in time. Strings, arrays and numbers are bounded only where their schema bounds them (strings by at most
    STRING_CAP characters, arrays by ITEMS_CAP items, as the grammar's), and one to `most` calls follow each other.
    Special tokens (the call tokens, the quote token where the vocabulary has it) are written as the characters
    SPECIAL_BASE + k, k their index in the returned list of ids (structure.outlines_vocabulary spells them).

    Returns (the expression, the special ids, the string states: the automaton states strings' characters take,
    each an edge for nearly every token of the vocabulary, which sizes the automaton before it is built)."""
    schemas = [(fn["name"], check_call_parameters(fn["name"], fn["parameters"])) for fn in functions]
    regex = _Regex(quote)
    rules = _CallRules(regex, None, None)
    calls, states = [], 0
    start, end = regex.token(call_start), regex.token(call_end)
    for i, (name, schema) in enumerate(schemas):
        args, _, _, n = rules.rule({**schema, "type": "object"}, f"args{i}")
        calls.append(regex.seq(regex.lit("call:" + name), args))
        states = max(states, n)
    call = regex.alt("call", calls)
    return f"{start}{regex.repeat(call, 1, most)}{end}", regex.specials, states * max(1, most)
