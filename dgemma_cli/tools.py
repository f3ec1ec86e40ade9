"""Tool calls in Gemma 4's own format (docs/serve.md, Tool calls): rendering a conversation with tools, reading the
calls out of an answer, and the grammar that holds an answer to a call (tool_choice "required" or a named function).

Gemma 4 writes values in its own notation, not JSON: strings between `<|"|>` marks, bare keys, objects `{k:v,...}`
with keys in sorted order, arrays `[...]`, numbers, true, false, null. A call is
`<|tool_call>call:NAME{key:value,...}<tool_call|>`; several calls may follow one another; a tool's answer comes back
as `<|tool_response>response:NAME{value:...}<tool_response|>` inside the model's turn, and the model goes on there.
A checkpoint's chat template renders tools itself when it knows them; for one that does not (the bundled demos,
test fixtures), `render_tool_chat` writes the same format. This module knows text and token ids, not the model.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from .errors import UsageError

QUOTE = '<|"|>'
CALL_START, CALL_END = "<|tool_call>", "<tool_call|>"
RESPONSE_START, RESPONSE_END = "<|tool_response>", "<tool_response|>"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")


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
        return "{" + ",".join(f"{k}:{gemma_value(x)}" for k, x in sorted(v.items())) + "}"
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
                             "...}}}} with a name of letters, digits, _ . - (at most 64)")
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
        m = re.compile(r"true|false|null|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?").match(s, i)
        if not m:
            raise ValueError(f"a value at {i}")
        self.i = m.end()
        return json.loads(m.group(0))


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """An answer decoded with its special tokens -> (the text outside the call blocks, [{"name", "arguments"}]).
    A block that does not parse stays in the text (the caller strips special tokens from it)."""
    calls, pieces, pos = [], [], 0
    for m in re.finditer(re.escape(CALL_START) + r"(.*?)(?:" + re.escape(CALL_END) + r"|$)", text, re.S):
        body, found = m.group(1), []
        try:
            r = _Reader(body)
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
        except (ValueError, json.JSONDecodeError):
            continue
        if not found:
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
# What the call grammar writes: a parameter keyword outside these would be ignored, and a call could break it.
_CALL_KEYWORDS = {"type", "properties", "required", "items", "enum", "const", "minimum", "maximum", "maxLength",
                  "additionalProperties", "description", "title", "default", "examples", "nullable", "format"}


def check_call_parameters(name: str, params: Any) -> None:
    """Refuse (UsageError naming the place) parameters a required call could not be written to or held to: not an
    object schema, a key the call notation cannot write, a keyword the call grammar would ignore."""
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise UsageError(f"tool '{name}': its parameters must be an object schema ({{'type': 'object', "
                         f"'properties': ...}}) for a call to be required")

    def walk(schema: Any, where: str) -> None:
        if not isinstance(schema, dict):
            raise UsageError(f"tool '{name}': the parameter schema at {where} is not an object")
        for key in schema:
            if key not in _CALL_KEYWORDS:
                raise UsageError(f"tool '{name}': '{key}' at {where} cannot be held in a required call (supported: "
                                 f"{', '.join(sorted(_CALL_KEYWORDS))})")
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise UsageError(f"tool '{name}': properties at {where} must be an object")
        for key, sub in props.items():
            if not KEY.fullmatch(key):
                raise UsageError(f"tool '{name}': the parameter name {json.dumps(key)[:80]} at {where} cannot be "
                                 f"written in a call (letters, digits and _ . - $, at most 64)")
            walk(sub, f"{where}/properties/{key}")
        if isinstance(schema.get("items"), dict):
            walk(schema["items"], f"{where}/items")
        if schema.get("type") == "number" and ("minimum" in schema or "maximum" in schema):
            raise UsageError(f"tool '{name}': a number's range at {where} cannot be held in a required call (an "
                             f"integer's can)")
        kind = schema.get("type")
        if kind is not None and not (isinstance(kind, str) or (isinstance(kind, list) and all(
                isinstance(k, str) for k in kind))):
            raise UsageError(f"tool '{name}': type at {where} must be a string or a list of strings")

    walk(params, "parameters")


def call_grammar(functions: list[dict], call_start: int, call_end: int, quote: int | None, most: int = 1) -> str:
    """A Lark grammar (llguidance's dialect) for one to `most` calls of `functions`, each with arguments that fit
    its parameters schema, between the call tokens (by id); strings between the quote token (by id) or, where the
    vocabulary has none, its characters. Every property a schema lists is written, in sorted order (optional ones
    too: still valid). Numbers (10 digits) and the number of calls are bounded, strings by their maxLength: the
    grammar walk does not look ahead, so an unbounded string is closed only when the model prefers closing it."""
    from .structure import integer_regex

    for fn in functions:
        check_call_parameters(fn["name"], fn["parameters"])
    q = f"<[{quote}]>" if quote is not None else json.dumps(QUOTE)
    rules: list[str] = []

    def lit(s: str) -> str:
        return json.dumps(s)

    def value(v: Any) -> str:
        """A fixed value (an enum's, a const) as grammar items: its strings between quote tokens, as the model
        writes them (the quote's text, a control token's, is never spelled by text tokens)."""
        if isinstance(v, str):
            return f"{q} {lit(v)} {q}" if v else f"{q} {q}"
        if isinstance(v, dict):
            items = [f"{lit(k + ':')} {value(x)}" for k, x in sorted(v.items())]
            return lit("{") + (" " + ' "," '.join(items) if items else "") + " " + lit("}")
        if isinstance(v, list):
            return lit("[") + (" " + ' "," '.join(value(x) for x in v) if v else "") + " " + lit("]")
        return lit(gemma_value(v))

    def rule(schema: Any, name: str) -> str:
        """The rule for a value of `schema`; returns its name."""
        schema = schema if isinstance(schema, dict) else {}
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise UsageError("a tool parameter's enum must be a non-empty list")
            body = " | ".join(f"({value(v)})" for v in schema["enum"])
        elif "const" in schema:
            body = value(schema["const"])
        elif kind == "object" or "properties" in schema:
            props = schema.get("properties") or {}
            items = [f"{lit(k + ':')} {rule(props[k], f'{name}_{i}')}" for i, k in enumerate(sorted(props))]
            body = lit("{") + (" " + ' "," '.join(items) if items else "") + " " + lit("}")
        elif kind == "array":
            item = rule(schema.get("items", {}), name + "_item")
            body = f'"[" ({item} ("," {item})*)? "]"'
        elif kind == "integer":  # unbounded ones as numbers of at most 10 digits
            lo = _bound(schema.get("minimum"), -(10**10 - 1))
            hi = _bound(schema.get("maximum"), 10**10 - 1)
            if lo > hi:
                raise UsageError(f"a tool parameter's integer range [{lo}, {hi}] holds no integer")
            body = f"/{integer_regex(lo, hi)}/"
        elif kind == "number":  # digits bounded: a walk without lookahead must be able to finish a number
            body = r"/-?(0|[1-9][0-9]{0,8})(\.[0-9]{1,6})?/"
        elif kind == "boolean":
            body = '"true" | "false"'
        elif kind == "null":
            body = '"null"'
        else:  # strings, and anything unspecified, as a string (of at most maxLength characters where given)
            most = schema.get("maxLength")
            most = None if most is None else max(0, min(_bound(most, 512), 512))
            body = f"{q} /[^<]*/ {q}" if most is None else f"{q} /[^<]{{0,{most}}}/ {q}"
        rules.append(f"{name}: {body}")
        return name

    calls = []
    for i, fn in enumerate(functions):
        args = rule(dict(fn["parameters"], type="object"), f"args{i}")
        calls.append(f"{lit('call:' + fn['name'])} {args}")
    more = "".join(" (call" for _ in range(most - 1)) + ")?" * (most - 1)
    rules.insert(0, f"start: <[{call_start}]> call{more} <[{call_end}]>")
    rules.insert(1, "call: " + " | ".join(calls))
    return "\n".join(rules) + "\n"
