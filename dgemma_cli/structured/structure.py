"""What a structured answer may be held to, checked before anything is expanded: JSON Schemas, regular expressions and
grammars as text, and their compilation to what the search needs (docs/design.md, Constrained canvases).

The rule: nothing here imports torch or knows the model; the compile worker (worker.py) runs this module
alone in its own process, and `constrain.py` turns what it returns into tensors.

Every structure goes through `Structure.check()` first, on the request's own text, before any expansion: its size
(MAX_SOURCE), the product of nested bounded repetitions (MAX_REPEAT: `(.{1,100}){1,100}` asks for 10,000), and
whether it has a finite instance at all (a `$ref` cycle that a value must follow, an empty anyOf or enum, a grammar
whose start rule never ends). What a check cannot see (a determinization that explodes, a vocabulary-wide automaton
too big for memory) is bounded by the worker's time and memory budget.

A JSON Schema is rewritten before outlines-core compiles it (`prepare_schema`): local `$ref`s inlined (a reference
nested in itself at most REF_DEPTH times; deeper, that branch is not offered), properties that no value can fill
dropped, required properties the schema does not declare declared, and keywords that the compiler would ignore
refused, so that every answer the automaton accepts validates against the schema as given.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import cached_property

from ..errors import UsageError

MAX_SOURCE = 65536  # characters of a schema's JSON text, an expression or a grammar
MAX_REPEAT = 512  # the largest count nested bounded repetitions multiply to ({m,n} inside {m,n}: their product)
MAX_SCHEMA_NODES = 10_000  # subschemas after $ref inlining
MAX_SCHEMA_DEPTH = 64  # subschemas nested in one another
REF_DEPTH = 3  # times one $ref may nest inside itself (a recursive schema's answers are at most this deep)

# Keywords outlines-core's compiler ignores and an answer could break: refused, so that an answer held to a schema
# always validates. (Annotations such as title, description, default and examples are ignored, as they should be.)
_IGNORED_VALIDATORS = ("uniqueItems", "contains", "minContains", "maxContains", "multipleOf", "minProperties",
                       "maxProperties", "dependentRequired", "dependentSchemas", "dependencies", "propertyNames",
                       "unevaluatedProperties", "unevaluatedItems", "not", "if", "then", "else")
_ANNOTATIONS = ("title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
                "readOnly", "writeOnly", "discriminator")
# Formats held: date-time, date and time as RFC 3339 writes them (`date_time_regex`: what JSON Schema means by them,
# and what pydantic's datetime, date and time parse), uuid as outlines-core writes it. Others (outlines-core would
# write uri or email wrongly, letting a backslash or a control character through) are dropped: a format is an
# annotation unless a validator is asked to assert it, and the answer is then any string (`unheld_formats` names
# them, for the server's one warning line).
_FORMATS = ("date-time", "date", "time", "uuid")
_RFC3339 = ("date-time", "date", "time")


@dataclass(frozen=True)
class Structure:
    """A requested answer shape: kind "regex" (source: the expression), "json_schema" (source: the schema as JSON
    text), "json_object" (any JSON object), "grammar" (source: a context-free grammar in llguidance's Lark syntax,
    or llama.cpp's GBNF, which is converted) or "calls" (a required tool call, made by the server: source the JSON
    text of {"regex": tools.call_regex's expression, "specials": the token ids its characters SPECIAL_BASE + k
    stand for})."""

    kind: str
    source: str = ""

    def check_size(self) -> None:
        """The check a server makes in its own process: the kind and the size (constant time). Everything else runs
        in the compile worker, under its budget (worker.py)."""
        if self.kind not in ("regex", "json_schema", "json_object", "grammar", "calls"):
            raise UsageError(f"unknown answer structure {self.kind!r}")
        if len(self.source) > MAX_SOURCE:
            what = {"regex": "expression", "grammar": "grammar"}.get(self.kind, "JSON schema")
            raise UsageError(f"the {what} is too large (over {MAX_SOURCE // 1024} KB)")

    def check(self) -> None:
        """Raise UsageError (one line) when the structure cannot be compiled or has no finite instance. No expansion
        runs here (the size, the repetitions, the schema's references and the grammar's rules are read), but on a
        hostile 64 KB text it may take seconds of Python: a server runs it in the compile worker."""
        self.check_size()
        try:
            if self.kind == "regex":
                check_regex(unanchored(self.source), "--regex")
            elif self.kind == "calls":
                check_regex(self._calls["regex"], "the tool call")
            elif self.kind == "json_schema":
                self.prepared  # noqa: B018 (read: prepare_schema's checks)
            elif self.kind == "grammar":
                check_grammar(lark_text(self.source))
        except RecursionError:
            raise UsageError("the structure nests too deeply") from None

    def schema(self):
        try:
            return json.loads(self.source)
        except json.JSONDecodeError as e:
            raise UsageError(f"the JSON schema is not JSON ({e.msg} at line {e.lineno})") from None
        except ValueError:  # an integer of thousands of digits
            raise UsageError("the JSON schema holds a number too long to read") from None
        except RecursionError:
            raise UsageError("the JSON schema is nested too deeply") from None

    @cached_property
    def _calls(self) -> dict:
        return json.loads(self.source)

    @property
    def specials(self) -> tuple[int, ...]:
        """The special token ids a "calls" expression names (by the characters SPECIAL_BASE + k); () for others."""
        return tuple(int(i) for i in self._calls["specials"]) if self.kind == "calls" else ()

    @cached_property
    def prepared(self):
        """The schema (json_schema, json_object kinds) as `prepare_schema` leaves it, made once per structure."""
        return {"type": "object"} if self.kind == "json_object" else prepare_schema(self.schema())

    def regex(self) -> str:
        """The expression an automaton is built from (regex and schema kinds): for a schema, outlines-core's, which
        may take a while on a large schema (the worker runs it)."""
        self.check()
        if self.kind == "regex":
            return unanchored(self.source)
        if self.kind == "calls":
            return self._calls["regex"]
        regex = schema_regex(self.prepared)
        check_regex(regex, "the JSON schema")
        return regex


# ------------------------------------------------------------------------------------- expressions, bounded


def repeat_product(regex: str) -> int:
    """The largest count that nested bounded repetitions in `regex` multiply to: `(a{1,3}){2}` 6, `a{5,}` 5, `a*` 1.
    A plain scan (escapes, character classes, groups), so that it reads Rust's syntax (outlines-core's) as well as
    Python's and never expands anything."""
    stack = [1]  # per open group: the largest product inside it so far
    i, n = 0, len(regex)
    last = 1  # the product of the atom just read (a group's closes with its own)
    quant = re.compile(r"\{(\d+)(?:,(\d*))?\}")
    while i < n:
        c = regex[i]
        if c == "\\":
            i += 2
            if i <= n and regex[i - 1] in "pPx" and i < n and regex[i] == "{":  # \p{L}, \x{10FFFF}
                close = regex.find("}", i)
                i = n if close < 0 else close + 1
            last = 1
            continue
        if c == "[":  # a class: up to its closing ] (a ] first in it is literal)
            j = i + 1
            if j < n and regex[j] == "^":
                j += 1
            if j < n and regex[j] == "]":
                j += 1
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            i = j + 1
            last = 1
            continue
        if c == "(":
            stack.append(1)
            i += 1
            continue
        if c == ")":
            last = stack.pop() if len(stack) > 1 else 1
            i += 1
        elif c == "{":
            m = quant.match(regex, i)
            if m is None:  # a literal brace
                last = 1
                i += 1
                continue
            last *= max(_count(m.group(2) or m.group(1)), 1)
            i = m.end()
        else:
            last = 1
            i += 1
        # the atom (or group) just read, with any quantifier that follows it
        m = quant.match(regex, i)
        if m is not None:
            last *= max(_count(m.group(2) or m.group(1)), 1)
            i = m.end()
        stack[-1] = max(stack[-1], last)
        if len(stack) > 1000:
            raise UsageError("the expression nests groups over 1,000 deep")
    return max(stack)


def shortest_chars(regex: str) -> int:
    """The fewest characters a text matching `regex` holds (Python's parser's width), 0 where the expression is not
    one Python reads (then nothing is refused by it)."""
    try:
        from re import _parser as parser  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as parser
    try:
        return parser.parse(regex).getwidth()[0]
    except (re.error, RecursionError, OverflowError, ValueError):
        return 0


def _count(digits: str) -> int:
    """A repetition count as written; past nine digits, a billion (int() of thousands of digits is refused)."""
    return int(digits) if len(digits) <= 9 else 10**9


def unanchored(regex: str) -> str:
    """A whole-answer regex without the anchors people write around it (`^...$`, `\\A...\\Z`): the answer is
    matched whole already, and an automaton holds no anchors. Only a leading ^ / \\A and a trailing unescaped $ /
    \\Z / \\z go; an anchor anywhere else is refused in words (_unsupported_feature)."""
    for lead in ("^", "\\A"):
        if regex.startswith(lead):
            regex = regex[len(lead):]
            break
    for tail in ("$", "\\Z", "\\z"):
        if regex.endswith(tail):
            body = regex[: -len(tail)]
            escapes = len(body) - len(body.rstrip("\\"))  # an odd run of backslashes escapes the tail's first char
            if escapes % 2 == 0:
                regex = body
            break
    return regex


def check_regex(regex: str, what: str) -> None:
    """Refuse an expression whose automaton would be huge before building it: over MAX_SOURCE characters, or
    nested bounded repetitions over MAX_REPEAT (a schema's maxLength, maxItems, a pattern's counts)."""
    if len(regex) > MAX_SOURCE:
        raise UsageError(f"{what}: the expression is too large (over {MAX_SOURCE // 1024} KB)")
    if what == "--regex":
        try:
            re.compile(regex)
        except re.error as e:
            raise UsageError(f"--regex: not a regular expression ({e})") from None
        except RecursionError:
            raise UsageError("--regex: the expression nests too deeply") from None
        feature = _unsupported_feature(regex)
        if feature:
            raise UsageError(f"--regex: {feature}")
    count = repeat_product(regex)
    if count > MAX_REPEAT:
        if what == "the JSON schema":  # the expression outlines-core wrote: said in the schema's terms
            raise UsageError(f"the JSON schema asks for up to {count:,} repetitions (maxLength, maxItems and pattern "
                             f"counts, multiplied where one holds another), over the limit of {MAX_REPEAT}")
        single = max((_count(m.group(2) or m.group(1)) for m in re.finditer(r"\{(\d+)(?:,(\d*))?\}", regex)),
                     default=1)
        if single >= count:
            raise UsageError(f"{what}: the repeat count {count:,} is over the limit of {MAX_REPEAT} (an unbounded "
                             "+ or * has no limit)")
        raise UsageError(f"{what}: nested repeat counts multiply to {count:,}, over the limit of {MAX_REPEAT} (a "
                         "counted repeat inside another is repeated that many times over)")


# What an answer's automaton cannot hold, as Python's parser names it (re._parser's opcodes), with what to say.
_UNSUPPORTED = {
    "GROUPREF": "backreferences (\\1, (?P=name)) are not supported",
    "GROUPREF_EXISTS": "conditionals ((?(1)...|...)) are not supported",
    "ASSERT": "lookarounds ((?=...), (?<=...)) are not supported",
    "ASSERT_NOT": "lookarounds ((?!...), (?<!...)) are not supported",
    "ATOMIC_GROUP": "atomic groups ((?>...)) are not supported",
}
_UNSUPPORTED_AT = {  # anchors: the whole answer is matched already
    "AT_BEGINNING": "^", "AT_BEGINNING_STRING": "\\A", "AT_END_STRING": "\\Z", "AT_BOUNDARY": "\\b",
    "AT_NON_BOUNDARY": "\\B",
}


def _unsupported_feature(regex: str) -> str | None:
    """What an expression Python reads uses that a finite automaton cannot hold (backreferences, lookarounds,
    conditionals, atomic groups, anchors other than a final $), in one phrase; None when nothing."""
    try:
        from re import _parser as parser  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as parser
    try:
        items = list(parser.parse(regex))
    except (re.error, RecursionError, OverflowError):
        return None
    while items:
        op, av = items.pop()
        name = str(op)
        if name in _UNSUPPORTED:
            return _UNSUPPORTED[name] + "; the answer is held to a plain regular expression"
        if name == "AT" and str(av) in _UNSUPPORTED_AT:
            return (f"anchors and word boundaries ({_UNSUPPORTED_AT[str(av)]}) are not supported: the whole answer "
                    "is matched already, so leave them out")
        for part in av if isinstance(av, (tuple, list)) else ():
            if isinstance(part, parser.SubPattern):
                items += list(part)
            elif isinstance(part, (tuple, list)):  # a branch's alternatives
                items += [x for sub in part if isinstance(sub, parser.SubPattern) for x in sub]
    return None


# ------------------------------------------------------------------------------------ JSON Schema, prepared


def prepare_schema(schema):
    """A JSON Schema -> the same language with local `$ref`s inlined, unsatisfiable branches removed, and what
    outlines-core would drop made explicit; UsageError (naming where) for what cannot be held or has no finite
    instance. Runs in time linear in MAX_SCHEMA_NODES."""
    if not isinstance(schema, (dict, bool)):
        raise UsageError("a JSON schema must be an object")
    root = schema
    nodes = [0]

    def resolve(ref, path):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UsageError(f"the JSON schema's $ref at {path} must point inside the schema ('#/...'), got "
                             f"{json.dumps(ref)[:80]}")
        node = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise UsageError(f"the JSON schema's $ref {ref[:80]!r} at {path} points nowhere")
        return node

    def walk(node, path: str, refs: tuple):
        """node with refs inlined, or None where no value satisfies it."""
        nodes[0] += 1
        if nodes[0] > MAX_SCHEMA_NODES:
            raise UsageError(f"the JSON schema expands to over {MAX_SCHEMA_NODES:,} subschemas (its $refs inlined)")
        if path.count("/") > MAX_SCHEMA_DEPTH:
            raise UsageError(f"the JSON schema nests subschemas over {MAX_SCHEMA_DEPTH} deep")
        if node is True:
            return {}
        if node is False:
            return None
        if not isinstance(node, dict):
            raise UsageError(f"the JSON schema at {path} is not a schema (an object or a boolean)")
        for key in _IGNORED_VALIDATORS:
            if key in node and not (key == "uniqueItems" and node[key] is False):
                raise UsageError(f"the JSON schema uses '{key}' at {path}, which an answer cannot be held to")
        if "$ref" in node:
            ref = node["$ref"]
            rest = [k for k in node if k not in ("$ref", "$defs", "definitions", *_ANNOTATIONS)]
            if rest:
                raise UsageError(f"the JSON schema at {path} has '{rest[0]}' beside '$ref' (put them in the "
                                 f"referenced schema, or in an allOf)")
            if refs.count(ref) >= REF_DEPTH:
                return None  # recursion this deep is not offered
            return walk(resolve(ref, path), path, refs + (ref,))
        _check_combination(node, path)
        if "pattern" in node:
            if not isinstance(node["pattern"], str):
                raise UsageError(f"the JSON schema's pattern at {path} must be a string")
            check_regex(node["pattern"], f"the JSON schema's pattern at {path}")
        out = {}
        for key, value in node.items():
            if key in ("$defs", "definitions", *_ANNOTATIONS):
                continue
            if key in ("properties", "patternProperties"):
                if not isinstance(value, dict):
                    raise UsageError(f"the JSON schema's {key} at {path} must be an object")
                out[key] = {k: walk(v, f"{path}/{key}/{k}", refs) for k, v in value.items()}
            elif key in ("items", "additionalProperties", "additionalItems") and isinstance(value, (dict, bool)):
                out[key] = walk(value, f"{path}/{key}", refs)
            elif key in ("prefixItems", "anyOf", "oneOf", "allOf") or (key == "items" and isinstance(value, list)):
                if not isinstance(value, list):
                    raise UsageError(f"the JSON schema's {key} at {path} must be a list")
                out[key] = [walk(v, f"{path}/{key}/{i}", refs) for i, v in enumerate(value)]
            else:
                out[key] = value
        return _possible(out, path)

    try:
        prepared = _no_bare_any(walk(schema, "#", ()))
    except UsageError as e:  # a path through long property names: the line stays a line
        text = str(e)
        raise UsageError(text if len(text) <= 400 else text[:400] + "...") from None
    except RecursionError:
        raise UsageError("the JSON schema nests too deeply") from None
    if prepared is None:
        raise UsageError("the JSON schema has no finite instance (a required $ref that refers back to itself, an "
                         "empty anyOf, enum or range): no answer can satisfy it")
    return prepared


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
               "null": type(None)}


def _of_type(value, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(kind, object))


def _check_combination(node: dict, path: str) -> None:
    """Refuse keyword combinations outlines-core compiles to something other than their meaning (it keeps one of
    them, or concatenates): an answer held to its expression would break the schema."""
    def refuse(why: str):
        raise UsageError(f"the JSON schema at {path}: {why}, which an answer cannot be held to")

    if "pattern" in node and any(k in node for k in ("minLength", "maxLength", "format")):
        refuse("'pattern' beside minLength, maxLength or format (write the lengths into the pattern)")
    if "format" in node and any(k in node for k in ("minLength", "maxLength")):
        refuse("'format' beside minLength or maxLength")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        refuse("'allOf' of more than one schema")
    validators = [k for k in node if k not in (*_ANNOTATIONS, "$defs", "definitions")]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in node and len(validators) > 1:
            refuse(f"'{key}' beside {', '.join(repr(k) for k in validators if k != key)} (move them into its "
                   f"branches)")
    for key in ("enum", "const"):
        if key not in node:
            continue
        values = node[key] if key == "enum" else [node[key]]
        if not isinstance(values, list):
            refuse("'enum' that is not a list")
        kinds = node.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        others = [k for k in validators if k not in ("enum", "const", "type")]
        if others:
            refuse(f"'{key}' beside {', '.join(repr(k) for k in others)}")
        if kinds is not None and not all(any(_of_type(v, t) for t in kinds) for v in values):
            refuse(f"'{key}' with a value that is not of its type")


# What an empty subschema ({}: any value) is compiled as: outlines-core writes {} inside an object without the
# parentheses its alternation needs (the object's own closing brace becomes one of the alternatives). Any scalar: a
# subset of "any value", so every answer still validates.
_ANY_SCALAR = {"type": ["string", "number", "boolean", "null"]}


def _no_bare_any(node):
    """Every empty subschema below the root (a property, an item) replaced by _ANY_SCALAR."""
    if node is None or not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties",) and isinstance(value, dict):
            out[key] = {k: (_ANY_SCALAR if v == {} else _no_bare_any(v)) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _ANY_SCALAR if value == {} else _no_bare_any(value)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            out[key] = [_ANY_SCALAR if v == {} else _no_bare_any(v) for v in value]
        else:
            out[key] = value
    return out


def _types(node: dict) -> set[str] | None:
    """A subschema's JSON types (a number's include integer: 3 is both), None where it names none."""
    kind = node.get("type")
    if kind is None:
        return None
    kinds = {kind} if isinstance(kind, str) else set(kind)
    return kinds | {"integer"} if "number" in kinds else kinds


def _values(node: dict) -> set[str] | None:
    """A subschema's const or enum values, as canonical JSON (1.0 as 1), None where it has neither."""
    if "const" in node:
        values = [node["const"]]
    elif isinstance(node.get("enum"), list):
        values = node["enum"]
    else:
        return None

    def canonical(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: canonical(x) for k, x in v.items()}
        return [canonical(x) for x in v] if isinstance(v, list) else v

    return {json.dumps(canonical(v), sort_keys=True) for v in values}


def _apart(a: dict, b: dict) -> bool:
    """Whether no value can satisfy both prepared subschemas, as far as can be read off them: different types,
    different const / enum values, or a property both require with different const / enum values (a discriminated
    union's tag, as pydantic writes it)."""
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not va & vb:
        return True
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    for name in set(a.get("required") or []) & set(b.get("required") or []):
        x, y = _values(pa.get(name) or {}), _values(pb.get(name) or {})
        if x is not None and y is not None and not x & y:
            return True
    return False


def _possible(node: dict, path: str):
    """A subschema whose children were prepared (None: unsatisfiable) -> itself simplified, or None."""
    if node.get("enum") == [] or ("allOf" in node and any(s is None for s in node["allOf"])):
        return None
    for key in ("anyOf", "oneOf"):
        if key in node:
            kept = [s for s in node[key] if s is not None]
            if not kept:
                return None
            node[key] = kept
    branches = node.get("oneOf", [])
    for i, a in enumerate(branches):  # oneOf is compiled as anyOf: held only where no value can match two branches
        for j in range(i + 1, len(branches)):
            if not _apart(a, branches[j]):
                raise UsageError(f"the JSON schema at {path}: 'oneOf' whose branches {i} and {j} a value could both "
                                 "match, which an answer cannot be held to (exactly one); use anyOf, or branches "
                                 "of different types or of different const values")
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > hi:
        return None
    min_items = node.get("minItems", 0) if isinstance(node.get("minItems", 0), (int, float)) else 0
    if isinstance(node.get("maxItems"), (int, float)) and min_items > node["maxItems"]:
        return None
    if "prefixItems" in node:
        first_bad = next((i for i, s in enumerate(node["prefixItems"]) if s is None), None)
        if first_bad is not None:
            if min_items > first_bad:
                return None
            node["prefixItems"] = node["prefixItems"][:first_bad]
            node["maxItems"] = min(node.get("maxItems", first_bad), first_bad)
    if "items" in node and node["items"] is None:  # no item can exist: the array is empty or impossible
        if min_items > len(node.get("prefixItems", [])):
            return None
        node["items"] = False if "prefixItems" in node else {}
        if "prefixItems" not in node:
            node["maxItems"] = 0
    extra = node.get("additionalProperties", True)
    if extra is None:  # no value fits an extra property: none may be written
        extra = node["additionalProperties"] = False
    props = node.get("properties")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise UsageError(f"the JSON schema's required at {path} must be a list of names")
    if "properties" in node or required:
        props = dict(props or {})
        for name in required:
            if name not in props:  # outlines-core would leave out a required property it was not shown
                if extra is False:
                    return None
                props[name] = extra if isinstance(extra, dict) else {}
            elif props[name] is None:
                return None
        node["properties"] = {k: v for k, v in props.items() if v is not None}
    if "patternProperties" in node:  # extras are never written: their schemas only narrow what is not written
        node.pop("patternProperties")
    return node


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def schema_regex(schema) -> str:
    """A JSON Schema -> a regular expression of its JSON texts (outlines-core's), with the integer and number
    ranges it leaves out written in: each ranged subschema is swapped for a placeholder constant, compiled, and the
    placeholder replaced by the range's expression (`integer_regex`, `number_regex`)."""
    from outlines_core.json_schema import build_regex_from_schema

    if not isinstance(schema, (dict, bool)):
        raise UsageError("a JSON schema must be an object")
    ranges: dict[str, str] = {}

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if isinstance(node.get("pattern"), str) and kind in (None, "string"):  # held inside the JSON string
            mark = f"DGEMMARANGE{len(ranges)}X"
            ranges[mark] = pattern_string_regex(node["pattern"])
            return {"const": mark}
        if node.get("format") in _RFC3339 and kind in (None, "string"):
            mark = f"DGEMMARANGE{len(ranges)}X"
            ranges[mark] = '"' + date_time_regex(node["format"]) + '"'
            return {"const": mark}
        if isinstance(kind, list) and "string" in kind and (node.get("format") in _RFC3339 or
                                                            isinstance(node.get("pattern"), str)):  # [.., "null"]
            rest = {k: v for k, v in node.items() if k != "type"}
            return walk({"anyOf": [dict(rest, type=t) if t == "string" else {"type": t} for t in kind]})
        if isinstance(kind, list) and any(k in node for k in _BOUNDS):  # ["integer", "null"] with a range
            rest = {k: v for k, v in node.items() if k != "type"}
            return walk({"anyOf": [dict(rest, type=t) if t in ("integer", "number") else {"type": t} for t in kind]})
        if kind in ("integer", "number") and any(k in node for k in _BOUNDS):
            mark = f"DGEMMARANGE{len(ranges)}X"
            ranges[mark] = integer_regex(*_int_bounds(node)) if kind == "integer" else number_regex(node)
            return {"const": mark}
        out = {}
        for k, v in node.items():
            if k in ("const", "enum", "default", "examples"):
                out[k] = v  # values, not schemas
            elif k == "properties" and isinstance(v, dict):
                out[k] = {name: walk(sub) for name, sub in v.items()}  # a property may be named "default"
            elif k == "format" and v not in _FORMATS:
                continue
            else:
                out[k] = walk(v)
        return out

    rewritten = walk(schema)
    try:
        regex = build_regex_from_schema(json.dumps(rewritten))
    except Exception as e:  # the library raises ValueError / TypeError with its own wording
        raise UsageError(f"the JSON schema cannot be compiled: {str(e).splitlines()[0] if str(e) else e}") from None
    for mark, rx in ranges.items():
        quoted = f'"{mark}"'
        if quoted not in regex:
            raise UsageError("the JSON schema cannot be compiled: a ranged number is used where it cannot be held")
        regex = regex.replace(quoted, f"({rx})")
    return regex


_YEAR = r"(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999: Python's dates start at year 1
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|"
         rf"02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"


# Characters a JSON string never holds raw (a quote, a backslash, the C0 controls) and those outlines-core's own
# string expression leaves out too (DEL and the C1 controls): a pattern's character sets are cut down to the rest,
# and a quote or a backslash the pattern names is written escaped (\" and \\), as JSON writes it.
_UNSAFE = set(range(0x20)) | {0x22, 0x5C} | set(range(0x7F, 0xA0))
_UNSAFE_CLASS = r'"\\\x00-\x1f\x7f-\x9f'
_CATEGORY = {"CATEGORY_DIGIT": "0-9", "CATEGORY_WORD": "a-zA-Z0-9_", "CATEGORY_SPACE": " "}  # ASCII, no controls


def _ascii_set(keep) -> str:
    """The printable ASCII characters `keep` takes, less a quote and a backslash, as a set's body."""
    return "".join(re.escape(chr(c)) if chr(c) in "\\]^-[" else chr(c)
                   for c in range(0x21, 0x7F) if keep(chr(c)) and c not in (0x22, 0x5C))


_NOT_CATEGORY = {"CATEGORY_NOT_DIGIT": _ascii_set(lambda ch: not ch.isdigit()),
                 "CATEGORY_NOT_WORD": _ascii_set(lambda ch: not (ch.isalnum() or ch == "_")),
                 "CATEGORY_NOT_SPACE": _ascii_set(lambda ch: True)}


_UNWRITABLE = {"AT": "an anchor inside it", "GROUPREF": "a backreference", "GROUPREF_EXISTS": "a conditional",
               "ASSERT": "a lookaround", "ASSERT_NOT": "a lookaround", "ATOMIC_GROUP": "an atomic group"}


def pattern_string_regex(pattern: str) -> str:
    """A schema's `pattern` -> the expression of the JSON strings (quotes included) whose text matches it whole:
    every `.`, negated set and range cut to the characters a JSON string holds raw, and a quote or backslash the
    pattern asks for written escaped, so that every answer parses and its string matches. UsageError (naming the
    pattern) for what Python's parser reads and this cannot write (a lookaround, a backreference, a flag)."""
    try:
        from re import _parser as parser  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as parser

    def refuse(what: str):
        raise UsageError(f"the JSON schema's pattern {pattern[:60]!r}: {what} cannot be held inside a JSON string")

    def char(c: int) -> str:  # one character of the string, as the JSON text writes it
        if c == 0x22:
            return r'\\"'
        if c == 0x5C:
            return r"\\\\"
        return re.escape(chr(c))

    def in_class(c: int) -> str:
        return "\\" + chr(c) if chr(c) in "\\]^-[" else chr(c) if 0x20 < c < 0x7F or c > 0x9F else f"\\x{c:02x}" \
            if c < 0x100 else chr(c)

    def charset(items) -> str:
        negate = bool(items) and str(items[0][0]) == "NEGATE"
        parts, escaped = [], []
        for op, av in items[1:] if negate else items:
            name = str(op)
            if name == "LITERAL":
                lo = hi = av
            elif name == "RANGE":
                lo, hi = av
            elif name == "CATEGORY" and str(av) in _CATEGORY:
                parts.append(_CATEGORY[str(av)])
                continue
            elif name == "CATEGORY" and str(av) in _NOT_CATEGORY and not negate:  # \S, \D, \W: their printable
                parts.append(_NOT_CATEGORY[str(av)])  # ASCII (a subset: every answer still matches)
                continue
            else:
                refuse(f"the set item {name} {av}")
            if negate:
                parts.append(in_class(lo) if lo == hi else f"{in_class(lo)}-{in_class(hi)}")
                continue
            run = None
            for c in range(lo, hi + 1):
                if c in _UNSAFE:
                    if c in (0x22, 0x5C):
                        escaped.append(char(c))
                    if run is not None:
                        parts.append(in_class(run) if run == c - 1 else f"{in_class(run)}-{in_class(c - 1)}")
                        run = None
                elif run is None:
                    run = c
                if c - lo > 0x110000:
                    break
            if run is not None:
                parts.append(in_class(run) if run == hi else f"{in_class(run)}-{in_class(hi)}")
        if negate:
            return f"[^{''.join(parts)}{_UNSAFE_CLASS}]"
        alternatives = ([f"[{''.join(parts)}]"] if parts else []) + escaped
        if not alternatives:
            refuse("a set of characters no JSON string holds raw")
        return alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"

    def write(items) -> str:
        out = []
        for op, av in items:
            name = str(op)
            if name == "LITERAL":
                out.append(char(av) if av not in _UNSAFE or av in (0x22, 0x5C) else refuse("a control character"))
            elif name == "NOT_LITERAL":
                out.append(f"[^{in_class(av)}{_UNSAFE_CLASS}]")
            elif name == "ANY":
                out.append(f"[^{_UNSAFE_CLASS}]")
            elif name == "IN":
                out.append(charset(list(av)))
            elif name == "BRANCH":
                out.append("(?:" + "|".join(write(b) for b in av[1]) + ")")
            elif name == "SUBPATTERN":
                if av[1] or av[2]:
                    refuse("an inline flag")
                out.append("(?:" + write(av[3]) + ")")
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, hi, sub = av
                count = f"{{{lo},}}" if hi == parser.MAXREPEAT else f"{{{lo},{hi}}}"
                out.append("(?:" + write(sub) + ")" + count)
            else:
                refuse(_UNWRITABLE.get(name, name.lower().replace("_", " ")))
        return "".join(out)

    try:
        tree = parser.parse(unanchored(pattern))
    except (re.error, RecursionError, OverflowError) as e:
        raise UsageError(f"the JSON schema's pattern {pattern[:60]!r} is not a regular expression ({e})") from None
    return '"' + write(list(tree)) + '"'


def date_time_regex(fmt: str) -> str:
    """RFC 3339's date-time, full-date or full-time (JSON Schema's date-time, date, time) as an expression of the
    string's characters: a 4-digit year from 0001, the days each month has (February's 29th in leap years only),
    hours to 23, seconds to 59 (no leap second: Python's datetime has none), at most 6 fraction digits, and an
    offset (Z or +hh:mm) on a time, as the RFC requires; written upper-case (T, Z)."""
    return {"date-time": f"{_DATE}T{_TIME}", "date": _DATE, "time": _TIME}[fmt]


def unheld_formats(schema) -> set[str]:
    """The `format` values in a schema that are not held (annotations: the answer is then any string)."""
    out, todo = set(), [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            for k, v in node.items():
                if k == "format" and isinstance(v, str) and v not in _FORMATS:
                    out.add(v)
                elif k not in ("const", "enum", "default", "examples"):
                    todo.append(v)
    return out


def _int_bounds(node: dict) -> tuple[int | None, int | None]:
    lo = hi = None
    for key in _BOUNDS:
        v = node.get(key)
        if key in node and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) > 1e18):
            raise UsageError(f"the JSON schema's {key} must be a number within +-1e18")
    if "minimum" in node:
        lo = math.ceil(node["minimum"])
    if "exclusiveMinimum" in node:
        lo = max(lo if lo is not None else -math.inf, math.floor(node["exclusiveMinimum"]) + 1)
    if "maximum" in node:
        hi = math.floor(node["maximum"])
    if "exclusiveMaximum" in node:
        hi = min(hi if hi is not None else math.inf, math.ceil(node["exclusiveMaximum"]) - 1)
    if lo is not None and hi is not None and lo > hi:
        raise UsageError(f"the JSON schema's integer range [{lo}, {hi}] holds no integer")
    return lo, hi


def _same_length(a: str, b: str) -> list[str]:
    """Expressions for the digit strings of len(a) == len(b) from a to b (a <= b; leading zeros allowed)."""
    if a == b:
        return [a]
    i = 0
    while a[i] == b[i]:
        i += 1
    head, a, b = a[:i], a[i:], b[i:]
    if len(a) == 1:
        return [f"{head}[{a}-{b}]"]
    n = len(a) - 1
    out, x, y, tail = [], int(a[0]), int(b[0]), []
    if a[1:] != "0" * n:  # a's first digit with a partial rest
        out += [head + a[0] + r for r in _same_length(a[1:], "9" * n)]
        x += 1
    if b[1:] != "9" * n:
        tail = [head + b[0] + r for r in _same_length("0" * n, b[1:])]
        y -= 1
    if x <= y:
        out.append(head + (str(x) if x == y else f"[{x}-{y}]") + "[0-9]" + (f"{{{n}}}" if n > 1 else ""))
    return out + tail


def _nonnegative(lo: int, hi: int | None) -> list[str]:
    """Alternatives for the integers lo..hi (hi None: unbounded), 0 <= lo, written without leading zeros."""
    if hi is None:
        if lo == 0:
            return ["0", "[1-9][0-9]*"]
        digits = len(str(lo))  # lo up to the last number of its length, then every longer number
        return _same_length(str(lo), "9" * digits) + [f"[1-9][0-9]{{{digits},}}"]
    out = []
    while lo <= hi:
        top = min(hi, 10 ** len(str(lo)) - 1)
        out += _same_length(str(lo), str(top))
        lo = top + 1
    return out


def integer_regex(lo: int | None, hi: int | None) -> str:
    """An expression matching exactly the integers in [lo, hi] as JSON writes them (None: unbounded that side)."""
    parts = []
    if lo is None or lo < 0:  # negative values -k, k in [max(1, -hi), -lo]
        k_lo = 1 if hi is None or hi >= 0 else -hi
        k_hi = None if lo is None else -lo
        if k_hi is None or k_lo <= k_hi:
            parts.append("-(" + "|".join(_nonnegative(k_lo, k_hi)) + ")")
    if hi is None or hi >= 0:
        parts += _nonnegative(max(lo or 0, 0), hi)
    return "|".join(parts)


def number_regex(node: dict) -> str:
    """A number in [minimum, maximum] (integer bounds, minimum >= 0): an integer part in [lo, hi - 1] with any
    fraction, or hi itself (with zeros after the point). Other ranges are refused in one line."""
    lo, hi = node.get("minimum"), node.get("maximum")
    ok = (not any(k in node for k in ("exclusiveMinimum", "exclusiveMaximum")) and isinstance(lo, (int, float))
          and lo >= 0 and float(lo).is_integer() and (hi is None or (isinstance(hi, (int, float))
                                                                     and float(hi).is_integer() and hi >= lo)))
    if not ok:
        raise UsageError("number ranges are supported with whole-number bounds, minimum >= 0 and no exclusive bounds "
                         "(or use \"type\": \"integer\")")
    lo, hi = int(lo), None if hi is None else int(hi)
    frac = r"(\.[0-9]+)?"
    if hi is None:
        return f"({integer_regex(lo, None)}){frac}"
    if hi == lo:
        return rf"{hi}(\.0+)?"
    return rf"({integer_regex(lo, hi - 1)}){frac}|{hi}(\.0+)?"


# ------------------------------------------------------------------------------------------- grammars (text)


def lark_text(source: str) -> str:
    """A grammar's source -> Lark in llguidance's dialect: Lark as it is, llama.cpp's GBNF (rules with ::=, `root`
    first) converted. UsageError names the first problem."""
    if len(source) > MAX_SOURCE:
        raise UsageError(f"the grammar is too large (over {MAX_SOURCE // 1024} KB)")
    if "::=" not in source:
        return source
    try:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        return gbnf_to_lark(source)
    except Exception as e:  # its own parse errors
        raise UsageError(f"the grammar (GBNF) cannot be read: {_first_line(e)}") from None


def lark_grammar(source: str) -> str:
    """A grammar's source -> llguidance's grammar text, checked (`check_grammar`, then llguidance's own
    validation). UsageError names the first problem."""
    import llguidance

    text = lark_text(source)
    check_grammar(text)
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise UsageError(f"the grammar cannot be compiled: {_grammar_error((messages or [''])[0], source, text)}")
    return grammar


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _grammar_error(message: str, source: str, text: str) -> str:
    """llguidance's error on `text` (lark_text of `source`) in one line: its first line with the regex parser's own
    `error:` lines (the excerpts it quotes left out), at the line of `source` it is about (a GBNF grammar's: the
    converted text has other lines)."""
    lines = message.strip().splitlines() or ["unknown error"]
    head = lines[0].rstrip(":")
    head += "".join(f": {line[len('error: '):]}" for line in lines[1:] if line.startswith("error: "))
    m = re.match(r"at (\d+)\(\d+\): ", head)
    if m:
        quoted = re.search(r'"([^"]+)"', head)
        line = _source_line(int(m[1]), source, text, quoted[1] if quoted else None)
        head = f"line {line}: {head[m.end():]}"
    return head[:500]


def _source_line(line: int, source: str, text: str, piece: str | None = None) -> int:
    """The line of `source` that line `line` of `text` (lark_text of it) comes from: the same in Lark; in GBNF the
    line of the rule it is in (rule names converted as gbnf_to_lark converts them), or the line of that rule that
    holds `piece` (the quoted text that failed), where one does."""
    if text == source:
        return line
    converted, rows = text.splitlines(), source.splitlines()
    name = next((m[1] for k in range(min(line, len(converted)) - 1, -1, -1)
                 if (m := re.match(r"([A-Za-z_][A-Za-z0-9_]*)\s*:", converted[k]))), None)
    rules = [(k, m[1]) for k, row in enumerate(rows) if (m := re.match(r"\s*([A-Za-z0-9_-]+)\s*::=", row))]
    for i, (k, rule) in enumerate(rules):
        lark_name = "start" if rule == "root" else re.sub(r"([a-z])([A-Z])", r"\1_\2", rule.replace("-", "_"))
        if name is not None and lark_name.lower() == name.lower():
            end = rules[i + 1][0] if i + 1 < len(rules) else len(rows)
            return next((j + 1 for j in range(k, end) if piece and piece in rows[j]), k + 1)
    return line


_LARK_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r]+|//[^\n]*|\\\n)
  | (?P<nl>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*(?:"i?)?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+(?:/[a-z]*)?)
  | (?P<special><[^>\n]*>?)
  | (?P<range>\d+\.\.\d+)
  | (?P<number>\d+)
  | (?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<directive>%[a-z_]+)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?)
  | (?P<op>[:|()\[\]?*+~{},])
""", re.X)


# Each of these tokens also matches up to the end of its line when left open (one pass, linear: a scan that fails
# there would restart at every quote); whether it closed is checked apart.
_CLOSED = {"string": re.compile(r'"(?:[^"\\\n]|\\.)*"i?'), "regex": re.compile(r"/(?:[^/\\\n]|\\.)+/[a-z]*"),
           "special": re.compile(r"<[^>\n]*>")}


class _LarkRules:
    """A Lark grammar read far enough to answer two questions without expanding it: does its start rule derive a
    finite sentence (`productive`), and how far do nested counted repetitions multiply (`repeats`). Constructs it
    does not know (llguidance's %json {...} and the like) count as productive terminals."""

    def __init__(self, text: str):
        self.rules: dict[str, list] = {}  # name -> alternatives, each a list of (atom, low, high)
        toks = []
        line_start = True
        covered, unterminated = 0, False
        for m in _LARK_TOKEN.finditer(text):
            kind = m.lastgroup
            covered += len(m.group())
            if kind in _CLOSED and not _CLOSED[kind].fullmatch(m.group()):
                unterminated = True  # a string, regex or token left open: llguidance says what is wrong
            if kind == "nl":
                line_start = True
                continue
            if kind != "ws":
                toks.append((kind, m.group(), line_start))
                line_start = False
        self.toks, self.i = toks, 0
        self.complete = covered == len(text) and not unterminated  # all read: the analysis may judge the grammar
        while self.i < len(toks):
            kind, value, first = toks[self.i]
            if first and kind == "name" and self._at(1) == (":"):
                name = value.lstrip("?!").split(".")[0]
                self.i += 2
                self.rules.setdefault(name, []).extend(self._alternatives())
            elif kind == "directive":  # %llguidance {...}, %ignore ..., %import ...: skipped to the next rule
                self.i += 1
                self._skip_braces()
                while self.i < len(toks) and not toks[self.i][2]:
                    self.i += 1
            else:
                self.complete = False
                self.i += 1

    def _at(self, k: int):
        j = self.i + k
        return self.toks[j][1] if j < len(self.toks) else None

    def _skip_braces(self) -> None:
        if self._at(0) != "{":
            return
        depth = 0
        while self.i < len(self.toks):
            v = self.toks[self.i][1]
            depth += v == "{"
            depth -= v == "}"
            self.i += 1
            if depth == 0:
                return

    def _alternatives(self) -> list:
        alts = [self._sequence()]
        while self._at(0) == "|":
            self.i += 1
            alts.append(self._sequence())
        return alts

    def _sequence(self) -> list:
        seq = []
        while self.i < len(self.toks):
            kind, value, first = self.toks[self.i]
            if value in ("|", ")", "]") or (first and kind == "name" and self._at(1) == ":") or \
                    (first and kind == "directive"):
                break
            atom = self._atom()
            if atom is None:
                self.complete = False
                self.i += 1
                continue
            low, high = 1, 1
            while self.i < len(self.toks):
                kind, value, _ = self.toks[self.i]
                if value in ("?", "*"):
                    low, high = 0, high
                elif value == "+":
                    pass
                elif kind == "count":
                    a, _, b = (x.strip() for x in value.strip("{}").partition(","))
                    low, high = low * _count(a), high * (_count(b) if b else max(_count(a), 1))
                elif value == "~" and self._at(1) is not None:
                    self.i += 1
                    rng = self.toks[self.i][1]
                    a, _, b = rng.partition("..")
                    if not a.isdigit():
                        self.complete = False
                        break
                    low, high = low * _count(a), high * _count(b or a)
                else:
                    break
                self.i += 1
            seq.append((atom, low, high))
        return seq

    def _atom(self):
        kind, value, _ = self.toks[self.i]
        if value in ("(", "["):  # a group, or an optional one
            self.i += 1
            alts = self._alternatives()
            if self._at(0) == {"(": ")", "[": "]"}[value]:
                self.i += 1
            return ("group" if value == "(" else "optional", alts)
        self.i += 1
        if kind == "name":
            return ("rule", value.lstrip("?!").split(".")[0])
        if kind == "regex":
            return ("regex", value)
        if kind in ("string", "special"):
            return ("terminal", value)
        if kind == "directive":  # %json {...}, %regex {...}: a terminal of llguidance's
            self._skip_braces()
            return ("terminal", value)
        return None

    def productive(self, start: str) -> bool:
        """Whether `start` derives a finite sentence (the least fixed point of 'some alternative is made of
        productive items')."""
        done: set[str] = set()

        def atom_ok(atom) -> bool:
            kind, value = atom
            if kind == "rule":
                return value in done or value not in self.rules  # an unknown name: llguidance's own error
            if kind in ("group", "optional"):
                return kind == "optional" or any(seq_ok(s) for s in value)
            return True

        def seq_ok(seq) -> bool:
            return all(low == 0 or atom_ok(atom) for atom, low, _ in seq)

        changed = True
        while changed:
            changed = False
            for name, alts in self.rules.items():
                if name not in done and any(seq_ok(s) for s in alts):
                    done.add(name)
                    changed = True
        return start in done or start not in self.rules

    def repeats(self) -> int:
        """The largest count that nested repetitions multiply to, through rule references (a rule's own recursion
        counts once)."""
        memo: dict[str, int] = {}

        def rule(name: str, seen: frozenset) -> int:
            if name in memo:
                return memo[name]
            if name in seen or name not in self.rules:
                return 1
            value = max((seq(s, seen | {name}) for s in self.rules[name]), default=1)
            memo[name] = value
            return value

        def seq(s, seen) -> int:
            return max((max(high, 1) * atom(a, seen) for a, _, high in s), default=1)

        def atom(a, seen) -> int:
            kind, value = a
            if kind == "rule":
                return rule(value, seen)
            if kind in ("group", "optional"):
                return max((seq(s, seen) for s in value), default=1)
            if kind == "regex":
                return repeat_product(value[1 : value.rindex("/")])
            return 1

        return max((rule(name, frozenset()) for name in self.rules), default=1)


def check_grammar(text: str) -> None:
    """Refuse a Lark grammar (llguidance's dialect) whose counted repetitions multiply past MAX_REPEAT (the regex
    path's limit: `[a-z]{100000}` is refused on both) or whose start rule derives no finite sentence (`root ::=
    root`, `start: "a" start`)."""
    try:
        rules = _LarkRules(text)
        count = rules.repeats()
        productive = rules.productive("start")
    except RecursionError:
        raise UsageError("the grammar nests rules or groups too deeply") from None
    if count > MAX_REPEAT:
        raise UsageError(f"the grammar's repetitions multiply to {count:,} (nested counts multiply); at most "
                         f"{MAX_REPEAT} are supported")
    if rules.complete and not productive:
        raise UsageError("the grammar has no finite sentence: its start rule never ends (every alternative refers "
                         "back to a rule that cannot finish)")


# ------------------------------------------------------------------------------------- the automaton's tables

MAX_EDGES = 20_000_000  # token transitions an automaton may hold (about 320 MB of tensors)
BIG_GROUP = 4096  # tokens above which a group is searched by its mask and complement, not token by token


def automaton_tables(transitions: dict[int, dict[int, int]], start: int, finals, vocab_size: int,
                     big_group: int = BIG_GROUP) -> dict:
    """outlines-core's token DFA -> the compact tables `constrain.TokenAutomaton` is made of, as numpy arrays and
    plain numbers (the worker sends them to the server as they are; no torch here). States 0..S-1 (0 the start) are
    those from which an accepting one can be reached; edges are grouped by (source, target) state, group g holding
    the tokens tokens[offsets[g]:offsets[g + 1]] when it is small, or naming one of `masks` (a big group: a
    string's characters, most of the vocabulary) when it is not. dist[s]: the fewest tokens from s to acceptance.

    Each state's edges are read into arrays at once (a string's state has an edge for nearly every token of the
    vocabulary: millions of edges in all, which a loop in Python would take seconds over)."""
    from collections import deque

    import numpy as np

    back: dict[int, list[int]] = {}
    for s, edges in transitions.items():
        for t in set(edges.values()):
            back.setdefault(t, []).append(s)
    dist = {f: 0 for f in finals}
    todo = deque(finals)
    while todo:
        s = todo.popleft()
        for p in back.get(s, ()):
            if p not in dist:
                dist[p] = dist[s] + 1
                todo.append(p)
    if start not in dist:
        raise UsageError("the constraint accepts no text this vocabulary can spell")
    order = [start] + sorted(s for s in dist if s != start)
    top = max(max(transitions, default=0), max(order)) + 1
    ids = np.full(top + 1, -1, dtype=np.int64)  # outlines' state -> ours (-1: dropped)
    ids[np.array(order, dtype=np.int64)] = np.arange(len(order))
    src_l, dst_l, tokens, offsets, big, masks = [], [], [], [0], [], []
    seen: dict[bytes, int] = {}
    size = edges_kept = 0
    for i, s in enumerate(order):
        edges = transitions.get(s)
        if not edges:
            continue
        tok = np.fromiter(edges.keys(), dtype=np.int64, count=len(edges))
        dst = ids[np.minimum(np.fromiter(edges.values(), dtype=np.int64, count=len(edges)), top)]
        keep = (dst >= 0) & (tok >= 0) & (tok < vocab_size)
        tok, dst = tok[keep], dst[keep]
        if not tok.size:
            continue
        by = np.lexsort((tok, dst))  # by target, then token
        tok, dst = tok[by], dst[by]
        cut = np.flatnonzero(np.diff(dst)) + 1
        edges_kept += int(tok.size)
        for members, target in zip(np.split(tok, cut), dst[np.concatenate(([0], cut))].tolist()):
            src_l.append(i)
            dst_l.append(target)
            if members.size > big_group:
                key = members.tobytes()
                if key not in seen:
                    seen[key] = len(masks)
                    masks.append(members)
                big.append((len(src_l) - 1, seen[key]))
            else:
                tokens.append(members)
                size += int(members.size)
            offsets.append(size)
    return {"S": len(order), "vocab_size": vocab_size, "dist": [dist[s] for s in order], "src": src_l,
            "dst": dst_l, "tokens": np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64),
            "offsets": offsets, "big": big, "masks": masks, "edges": edges_kept}


def regex_tables(regex: str, vocabulary, vocab_size: int, big_group: int = BIG_GROUP) -> dict:
    """An expression over a vocabulary (outlines-core's `Vocabulary`) -> `automaton_tables`; UsageError when the
    vocabulary cannot spell it or the automaton is over MAX_EDGES."""
    from outlines_core import Index

    try:
        index = Index(regex, vocabulary)
    except Exception as e:  # ValueError: an expression this vocabulary cannot spell, or one it cannot compile
        if "following characters: []." in str(e):  # a state no character leads on from: no text, not the vocabulary
            raise UsageError("the constraint cannot be compiled: the expression, or a branch of it, matches no text "
                             "(as a character class with no character in it does: [^\\s\\S])") from None
        raise UsageError(f"the constraint cannot be compiled for this model's vocabulary: {_first_line(e)}") from None
    transitions = index.get_transitions()
    if sum(len(edges) for edges in transitions.values()) > MAX_EDGES:
        raise UsageError(f"the constraint is too large for this vocabulary (over {MAX_EDGES // 1_000_000} million "
                         f"token transitions)")
    return automaton_tables(transitions, index.get_initial_state(), index.get_final_states(), vocab_size, big_group)


# One character of a JSON string as outlines-core writes it: its automaton has a state per character a bounded string
# may still take, each with an edge for nearly every token of the vocabulary.
_STRING_CHAR = re.compile(re.escape(r'([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])') + r"(\{(\d+)(?:,(\d*))?\}|\*)?")


def estimated_edges(regex: str, vocab_size: int) -> int:
    """About how many token edges outlines-core's automaton of a schema's expression holds: a vocabulary's worth per
    string character state (measured: within 10% on forms of 50 properties at 262,144 tokens). Read off the text,
    so that a schema whose automaton would not fit is known before it is built."""
    states = 0
    for m in _STRING_CHAR.finditer(regex):
        if m.group(1) is None or m.group(1) == "*":
            states += 1
        else:
            states += _count(m.group(3) or m.group(2))
    return states * vocab_size


def schema_grammar(schema) -> str:
    """A prepared JSON Schema as an llguidance grammar (its own JSON Schema compiler, built lazily as a sentence is
    walked): for a schema whose token automaton would be too large (`estimated_edges`)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults={"whitespace_flexible": False})
    except Exception as e:  # its own wording
        raise UsageError(f"the JSON schema cannot be compiled: {_first_line(e)}") from None


def ll_tokenizer(words, vocab_size: int, encode, eos_id: int | None = None, bos_id: int | None = None):
    """llguidance's tokenizer over these token bytes (None: a special token, which no grammar spells; ids past the
    list are special too), text encoded by `encode(str) -> ids`: the server's (constrain.ll_tokenizer) and the
    compile worker's are both made here."""
    import llguidance

    spelled = [b if b is not None else b"\xff[%d]" % i for i, b in enumerate(words[:vocab_size])]  # 0xFF: special
    spelled += [b"\xff[%d]" % i for i in range(len(spelled), vocab_size)]

    class _Words:  # what llguidance.TokenizerWrapper reads
        eos_token_id = eos_id if eos_id is not None else 1
        bos_token_id = bos_id
        tokens = spelled
        special_token_ids = [i for i, b in enumerate(words[:vocab_size]) if b is None]

        def __call__(self, text):
            return encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Words()), n_vocab=vocab_size)


SPECIAL_BASE = 0x100000  # special token k of a "calls" expression is the character SPECIAL_BASE + k
_PLANE_16 = 0xF4  # the leading byte of every UTF-8 character from U+100000 on, and of none before


def outlines_vocabulary(words, vocab_size: int, specials=()):
    """A tokenizer's token bytes (None: special) -> outlines-core's Vocabulary. Its end-of-sequence id is one no
    text token has (every id past the vocabulary is one): the search adds the model's own end ids itself.

    specials: token ids spelled by the characters SPECIAL_BASE + k (a "calls" structure's). The text tokens that hold
    a byte 0xF4 are left out then (they spell plane 16's characters, or, byte by byte, begin one), so that no text
    spells a special token's character and the special token is written only as its own id."""
    from outlines_core import Vocabulary

    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(words):
        if b and i < vocab_size and not (specials and _PLANE_16 in b):
            by_bytes.setdefault(b, []).append(i)
    for k, i in enumerate(specials):
        if 0 <= i < vocab_size:
            by_bytes.setdefault(chr(SPECIAL_BASE + k).encode(), []).append(int(i))
    return Vocabulary(vocab_size, by_bytes)
