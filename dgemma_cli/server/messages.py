"""A request's messages and prompts into the model's text: roles, images (data: URLs), the chat template with tools and
thinking, tool calls sent back, a completion's prompt (text or token ids)."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from ..errors import UsageError
from ..tokenizer import Control
from .body import BodyError
from .body import parse as parse_body
from .protocol import MAX_MESSAGES, ApiError, type_error

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def has_images(body: dict) -> bool:
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"]) for m in messages)


def image_bytes(part: dict, where: str) -> bytes:
    """An `image_url` content part's image: a data: URL (`data:image/png;base64,...`), as OpenAI's clients send a
    local file. The server fetches nothing from the network, so any other URL is refused."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str):
        raise type_error(f"{where}.image_url", "an object with a 'url' string", ref)
    head, comma, data = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise ApiError(400, f"{where}.image_url: only base64 data: URLs are read (the server fetches nothing); got "
                       f"{url[:40]!r}", param=f"{where}.image_url", code="invalid_image_url")
    try:
        return base64.b64decode(data, validate=True)
    except (ValueError, binascii.Error):
        raise ApiError(400, f"{where}.image_url: the data: URL is not valid base64", param=f"{where}.image_url",
                       code="invalid_image_url") from None


def max_chars(engine) -> int:
    """The most characters a prompt can have and still fit the context: no token spans more characters than the
    vocabulary's longest. Longer text is refused before it is tokenized (which would hold a CPU and memory)."""
    return engine.config.text.max_position_embeddings * engine.tokenizer.max_token_chars


def tok_chat(tok, messages: Any, thinking: bool, placeholder: str | None = None,
             max_chars: int | None = None, tools: list[dict] | None = None) -> tuple[list[int], list[bytes]]:
    """(the conversation's ids through the chat template, the images of its `image_url` parts in order). Each image
    stands in its message as `placeholder` (the tokenizer's image token, expanded later to the image's soft tokens);
    None: the model reads no images. A conversation of more than `max_chars` characters of text is refused before
    anything is tokenized."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"'messages' holds {len(messages)} messages; at most {MAX_MESSAGES} are read",
                       param="messages", code="invalid_value")
    out, images, chars = [], [], 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise type_error(where, "an object", m)
        role = m.get("role")
        if not isinstance(role, str) or (role not in ROLES and role != "tool"):  # a list or object: unhashable
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, tool (got {json.dumps(role)[:40]})",
                           param=f"{where}.role", code="invalid_value")
        content = m.get("content")
        extra: dict[str, Any] = {}
        if role == "tool":  # a tool's result, answering the call with this id
            extra["tool_call_id"] = str(m.get("tool_call_id") or "")
            if isinstance(m.get("name"), str):
                extra["name"] = m["name"]
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise type_error(f"{where}.tool_calls", "a list of calls", calls)
            extra["tool_calls"] = [{"id": str(c.get("id") or ""), "type": "function",
                                    "function": {"name": str(c["function"].get("name") or ""),
                                                 "arguments": call_arguments(c["function"].get("arguments"),
                                                                             f"{where}.tool_calls[{k}]")}}
                                   for k, c in enumerate(calls)]
            if content is None:
                content = ""
        if isinstance(content, list):  # content parts: text, and images as data: URLs
            texts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind == "image_url":
                    if placeholder is None:
                        raise ApiError(400, f"{where}.content[{k}]: this model has no vision tower, so it reads no "
                                       "images", param=f"{where}.content", code="unsupported_parameter")
                    images.append(image_bytes(part, f"{where}.content[{k}]"))
                    texts.append(Control(placeholder))
                else:
                    raise ApiError(400, f"{where}.content[{k}]: only text and image_url parts are supported",
                                   param=f"{where}.content", code="unsupported_parameter")
            content = texts
        elif not isinstance(content, str):
            raise type_error(f"{where}.content", "a string or a list of text and image_url parts", content)
        chars += sum(len(t) for t in ([content] if isinstance(content, str) else content) if not isinstance(t, Control))
        out.append({"role": ROLES.get(role, role), "content": content, **extra})  # text, or text and images
    if max_chars is not None and chars > max_chars:
        raise ApiError(400, f"the messages' {chars} characters cannot fit the model's context", param="messages",
                       code="context_length_exceeded")  # known before tokenizing: no token holds more characters
    try:
        return tok.encode_chat(out, enable_thinking=thinking,
                               tools=[{"type": "function", "function": f} for f in tools] if tools else None), images
    except UsageError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None


def call_arguments(value: Any, where: str) -> dict:
    """A call's arguments as the API sends them (a JSON string, or an object) -> the object, the string parsed as a
    body is (body.py: nesting and size limits, a helper process for a huge one): never a bare json.loads here."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = parse_body(value.encode("utf-8", "surrogatepass"))
        except BodyError as e:
            raise ApiError(400, f"{where}.function.arguments: {e.message}", param=f"{where}.function.arguments",
                           code="invalid_value") from None
    if not isinstance(value, dict):
        raise type_error(f"{where}.function.arguments", "a JSON object (or its text)", value)
    return value


def completion_prompt(value: Any) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids): a string, a list of token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None, list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(400, "one prompt per request (send several requests; they are batched)", param="prompt",
                       code="unsupported_parameter")
    raise type_error("prompt", "a string or a list of token ids", value)
