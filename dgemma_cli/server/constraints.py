"""What a request holds its answer to: tools (forced calls as a grammar), response_format, vLLM's guided_* fields and
structured_outputs, into the Structure the engine compiles."""

from __future__ import annotations

import json
import sys
from typing import Any

from ..errors import UsageError
from .protocol import ApiError, refuse, type_error


def request_tools(tok, body: dict, kind: str, max_tokens: int | None = None):
    """`tools` and `tool_choice` -> (the offered functions or None, the structure a required call holds the answer
    to or None). tool_choice: "auto" (the default with tools: the model may call), "none" (tools not offered),
    "required" (a call, of any of them), or {"type": "function", "function": {"name": ...}} (that one). max_tokens:
    the answer's (`call_structure`: a walked call's strings and arrays are bounded to fit it); None: checked only."""
    from ..structured.constrain import Structure
    from ..tools import check_call_parameters, check_tools

    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        return None, None
    if kind != "chat":
        raise refuse("tools", "tools are for chat completions")
    if choice == "none":
        return None, None
    try:
        functions = check_tools(tools)
    except UsageError as e:
        raise ApiError(400, str(e), param="tools", code="invalid_value") from None
    if choice in (None, "auto"):
        return functions, None
    if choice == "required":
        wanted = functions
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        wanted = [f for f in functions if f["name"] == name]
        if not wanted:
            raise ApiError(400, f"'tool_choice' names {json.dumps(name)[:60]}, which is not in 'tools'",
                           param="tool_choice", code="invalid_value")
    else:
        raise ApiError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                       "'function': {'name': ...}}", param="tool_choice", code="invalid_value")
    start, end = tok.token_id("<|tool_call>"), tok.token_id("<tool_call|>")
    if start is None or end is None:
        raise ApiError(400, "this model's vocabulary has no tool-call tokens", param="tool_choice",
                       code="invalid_value")
    parallel = choice == "required" and body.get("parallel_tool_calls") is not False
    try:
        if max_tokens is None:  # checked only: the grammar, whose bounds search builds it many times over (seconds
            for fn in wanted:  # of Python for a schema of thousands of nodes), is built once max_tokens is known
                check_call_parameters(fn["name"], fn["parameters"])
            return functions, Structure("grammar")
        return functions, call_structure(tok, wanted, start, end, most=4 if parallel else 1, max_tokens=max_tokens)
    except UsageError as e:
        raise ApiError(400, str(e), param="tools", code="invalid_value") from None


BODY_STATES = 16  # at most, the states of a call string's body automaton (a character's end, UTF-8's middles)


def call_structure(tok, functions: list[dict], start: int, end: int, most: int, max_tokens: int):
    """The structure a required call is held to: its expression (tools.call_regex), searched by the automaton with
    lookahead, so that no string is bounded to fit max_tokens; or, where that automaton would be over the states,
    repetitions or text it may hold (a bounded string's characters are states of its body's automaton each:
    classes.py), the grammar walked left to right (tools.call_grammar: every string and array bounded to fit
    max_tokens). Parallel calls (`most`) that would be too large are offered as one call before the walk is taken."""
    from ..structured.classes import MAX_STATES
    from ..structured.constrain import Structure
    from ..structured.structure import MAX_REPEAT, MAX_SOURCE, repeat_product
    from ..tools import call_grammar, call_regex

    quote = tok.token_id('<|"|>')
    for calls in dict.fromkeys((most, 1)):  # parallel calls multiply the states: one call searched before a walk
        regex, specials, states = call_regex(functions, start, end, quote, most=calls)
        source = json.dumps({"regex": regex, "specials": specials})
        if states * BODY_STATES <= MAX_STATES and len(source) <= MAX_SOURCE and \
                repeat_product(regex) <= MAX_REPEAT:
            return Structure("calls", source)
    return Structure("grammar", call_grammar(functions, start, end, quote, most=most, max_tokens=max_tokens))


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
          "guided_choice": "choice"}
# vLLM's newer form, `structured_outputs: {"json": ...}`: each key -> the guided_* field it stands for
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
                      "choice": "guided_choice", "json_object": "json_object"}
MAX_CHOICES = 1024


def guided_fields(body: dict | None) -> dict[str, Any]:
    """vLLM's structure fields a request sends, {the field's name: its value}: guided_json, guided_regex,
    guided_grammar, guided_choice, and the keys of structured_outputs (named "structured_outputs.KEY"). What cannot
    be honoured is refused: another guided_* field (guided_whitespace_pattern, ...), another structured_outputs key
    set to anything but null or false (structural_tag, whitespace_pattern, disable_any_whitespace: true, ...).
    guided_decoding_backend (which library compiles it: dgemma has its own) is accepted and ignored."""
    out: dict[str, Any] = {}
    for key, value in (body or {}).items():
        if not key.startswith("guided_") or value is None or key == "guided_decoding_backend":
            continue
        if key not in GUIDED:
            raise refuse(key, f"dgemma takes {', '.join(GUIDED)} and structured_outputs")
        out[key] = value
    so = (body or {}).get("structured_outputs")
    if so is None:
        return out
    if not isinstance(so, dict):
        raise type_error("structured_outputs", "an object", so)
    for key, value in so.items():
        name = f"structured_outputs.{key}"
        if key == "json_object":
            if value is not None and not isinstance(value, bool):
                raise type_error(name, "true or false", value)
            if value:
                out[name] = True
        elif key in STRUCTURED_OUTPUTS:
            if value is not None:
                out[name] = value
        elif value not in (None, False):  # an option left at its default asks for nothing
            raise ApiError(400, f"'{name}' is not supported: structured_outputs takes "
                           f"{', '.join(STRUCTURED_OUTPUTS)}", param=name, code="unsupported_parameter")
    return out


def choice_regex(choices: Any, key: str) -> str:
    """guided_choice's strings -> the expression that is exactly one of them."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise type_error(key, "a non-empty list of strings", choices)
    if len(choices) > MAX_CHOICES:
        raise ApiError(400, f"'{key}' holds {len(choices)} choices; at most {MAX_CHOICES}", param=key,
                       code="invalid_value")
    import re

    return "(" + "|".join(re.escape(c) for c in dict.fromkeys(choices)) + ")"


_WARNED_FORMATS: set[str] = set()  # formats not held, said once each per server process


def schema_structure(schema):
    """A JSON schema (an object or a boolean) -> its Structure; a `format` dgemma does not hold (anything but
    date-time, date, time, uuid) is said once in the server's log: it is an annotation, the answer any string."""
    from ..structured.constrain import Structure
    from ..structured.structure import unheld_formats

    fresh = sorted(unheld_formats(schema) - _WARNED_FORMATS)
    if fresh:
        _WARNED_FORMATS.update(fresh)
        sys.stderr.write(f"dgemma: warning: JSON Schema format {', '.join(repr(f[:40]) for f in fresh)} is not "
                         "held (an annotation: the answer is any string there); held: date-time, date, time, uuid\n")
    return Structure("json_schema", json.dumps(schema))


def response_structure(fmt: Any, body: dict | None = None):
    """OpenAI's response_format -> a constrain.Structure, or None for free text: {"type": "text"},
    {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; or vLLM's
    fields guided_json (a schema), guided_regex, guided_grammar (Lark or GBNF), guided_choice (exactly one of its
    strings), and structured_outputs' json, regex, grammar, choice, json_object, so requests written for vLLM
    work."""
    from ..structured.constrain import Structure

    guided = guided_fields(body)
    if guided:
        key = next(iter(guided))
        if len(guided) > 1 or fmt not in (None, {}, {"type": "text"}):
            raise ApiError(400, "give one of response_format, guided_json, guided_regex, guided_grammar, "
                           "guided_choice, structured_outputs (with one key)", param=key, code="invalid_value")
        value = guided[key]
        field = STRUCTURED_OUTPUTS.get(key.removeprefix("structured_outputs."), key)
        if field == "json_object":
            return Structure("json_object")
        if field == "guided_choice":
            return Structure("regex", choice_regex(value, key))
        if field == "guided_json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except (ValueError, RecursionError):  # not JSON, an integer of thousands of digits, deep nesting
                    raise ApiError(400, f"'{key}' is not JSON (or nests too deeply)", param=key,
                                   code="invalid_value") from None
            if not isinstance(value, (dict, bool)):
                raise type_error(key, "a JSON schema", value)
            return schema_structure(value)
        if not isinstance(value, str) or not value:
            raise type_error(key, "a non-empty string", value)
        return Structure(GUIDED[field], value)
    if fmt in (None, {}):
        return None
    if not isinstance(fmt, dict):
        raise type_error("response_format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ApiError(400, "'response_format.json_schema' must be an object with a 'schema' object",
                           param="response_format", code="invalid_value")
        return schema_structure(spec.get("schema", {}))
    raise ApiError(400, "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                   param="response_format", code="invalid_value")
