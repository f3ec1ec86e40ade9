"""OpenAI's Responses API (`POST /v1/responses`) on `dgemma serve`'s chat path (docs/serve.md, The Responses API).

The rule: nothing here generates. A request is translated into the chat completions body `requests.prepare` checks
(input items -> messages, instructions -> a system message, function tools in the flat shape -> chat tools,
text.format -> response_format, reasoning -> thinking, max_output_tokens -> max_tokens), so both APIs share every
limit, refusal and the batch; the chat answer (`answering.whole`, or the chunks of `answering.stream_chunks`) is translated
back into a response object, or into the Responses event stream (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta, response.output_text.done,
response.content_part.done, response.output_item.done, ..., response.completed).

The server keeps no state: `previous_response_id`, `conversation`, `background` and item references are refused
(send the whole conversation in `input`, as a chat client does); `store` is accepted and nothing is stored (the
response says `"store": false`).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..tools import NAME
from . import answering, protocol, requests

ROLES = ("user", "system", "developer", "assistant")
THINKING_EFFORTS = ("low", "medium", "high", "xhigh")  # reasoning.effort that turns thinking on (none, minimal: off)
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "seed", "steps", "entropy_bound", "image_tokens",
          "thinking", "chat_template_kwargs", "user", "metadata")  # the same meaning in both APIs


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def chat_request(body: dict, origins: list | None = None) -> dict:
    """A Responses request -> the chat completions body (an ApiError for what cannot be). origins: filled, one per
    chat message, with where it came from (`input_messages`), for `renamed`."""
    err, refuse = protocol.ApiError, protocol.refuse
    origins = [] if origins is None else origins
    if body.get("previous_response_id") is not None:
        raise refuse("previous_response_id", "this server keeps no responses; send the whole conversation in "
                     "'input' (earlier output items included)")
    if body.get("conversation") is not None:
        raise refuse("conversation", "this server keeps no conversations; send the whole conversation in 'input'")
    if body.get("background") not in (None, False):
        raise refuse("background", "responses are answered while the request waits")
    if body.get("prompt") is not None:
        raise refuse("prompt", "stored prompt templates are OpenAI's; send 'instructions' and 'input'")
    out: dict[str, Any] = {k: body[k] for k in PASSED if k in body}
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise protocol.type_error("instructions", "a string", instructions)
        messages.append({"role": "system", "content": instructions})
        origins.append(("instructions", {}))
    messages += input_messages(body.get("input"), origins)
    out["messages"] = messages
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = protocol.get_int(body, "max_output_tokens", 1)
    protocol.get_bool(body, "parallel_tool_calls")  # a boolean, as the API types it (echoed as the one in effect)
    stream = protocol.get_bool(body, "stream")
    if stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    tools = body.get("tools")
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise protocol.type_error("tools", "a list", tools)
        out["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise err(400, f"'tools[{i}]': only function tools are served here (got type "
                          f"{json.dumps(kind)[:40]}): hosted tools (web search, file search, ...) are OpenAI's",
                          param=f"tools[{i}].type", code="unsupported_parameter")
            name, params = t.get("name"), t.get("parameters")
            if not isinstance(name, str) or not NAME.fullmatch(name):
                raise err(400, f"'tools[{i}].name' must be a function name of letters, digits, _ . - (at most 64; "
                          f"got {json.dumps(name)[:40]})", param=f"tools[{i}].name", code="invalid_value")
            if params is not None and not isinstance(params, dict):
                raise protocol.type_error(f"tools[{i}].parameters", "a JSON schema object", params)
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            out["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        elif choice not in ("none", "auto", "required"):
            raise err(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': "
                      "...}", param="tool_choice", code="invalid_value")
        out["tool_choice"] = choice
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise protocol.type_error("text", "an object", text)
        fmt = text.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            out["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        elif fmt is not None:
            out["response_format"] = fmt  # {"type": "text"} or {"type": "json_object"}; anything else: 400 there
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise protocol.type_error("reasoning", "an object", reasoning)
        effort = reasoning.get("effort")
        if effort not in (None, "none", "minimal", *THINKING_EFFORTS):
            raise err(400, f"'reasoning.effort' must be one of none, minimal, {', '.join(THINKING_EFFORTS)}",
                      param="reasoning.effort", code="invalid_value")
        if effort is not None and "thinking" not in out:
            out["thinking"] = effort in THINKING_EFFORTS
    top = body.get("top_logprobs")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise protocol.type_error("include", "a list", include)
    if top is not None or "message.output_text.logprobs" in include:
        out["logprobs"] = True
        out["top_logprobs"] = protocol.get_int(body, "top_logprobs", 0, requests.MAX_TOP_LOGPROBS) or 0
    return out


def input_messages(value: Any, origins: list | None = None) -> list[dict]:
    """`input` (a string, or a list of items) -> chat messages. Items: messages (role and content: a string or
    input_text / output_text / input_image parts), function_call (the assistant's call: its message's tool_calls)
    and function_call_output (a tool message); reasoning items are passed over (a thought is not read back, as the
    chat template drops it). origins: appended, per message, (the item it came from, {its tool call's index: the
    function_call item it came from})."""
    err = protocol.ApiError
    origins = [] if origins is None else origins
    if isinstance(value, str):
        origins.append(("input", {}))
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise err(400, "'input' must be a string or a non-empty list of items", param="input", code="invalid_type")
    messages: list[dict] = []
    names: dict[str, str] = {}  # call_id -> the function's name, for the tool message answering it
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise protocol.type_error(where, "an object", item)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise err(400, f"{where}.role must be one of {', '.join(ROLES)} (got {json.dumps(role)[:40]})",
                          param=f"{where}.role", code="invalid_value")
            messages.append({"role": role, "content": message_content(item.get("content"), where)})
            origins.append((where, {}))
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise err(400, f"{where}: a function_call needs 'call_id' and 'name' strings", param=where,
                          code="invalid_value")
            names[call_id] = name
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls right after (or with) the assistant's text
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append((where, {}))
            origins[-1][1][len(messages[-1]["tool_calls"]) - 1] = where
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise err(400, f"{where}: a function_call_output needs a 'call_id' string", param=f"{where}.call_id",
                          code="invalid_value")
            if isinstance(output, list):
                output = "".join(p.get("text", "") for p in output if isinstance(p, dict)
                                 and p.get("type") in ("input_text", "output_text"))
            if not isinstance(output, str):
                raise protocol.type_error(f"{where}.output", "a string", output)
            tool = {"role": "tool", "tool_call_id": call_id, "content": output}
            if call_id in names:
                tool["name"] = names[call_id]
            messages.append(tool)
            origins.append((where, {}))
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise err(400, f"'{where}': item references need stored items, and this server stores none; send the "
                      "item itself", param=where, code="unsupported_parameter")
        else:
            raise err(400, f"'{where}': items of type {json.dumps(kind)[:40]} are not served here (message, "
                      "function_call, function_call_output and reasoning are)", param=f"{where}.type",
                      code="unsupported_parameter")
    if not messages:
        raise err(400, "'input' holds no message", param="input", code="invalid_value")
    return messages


def message_content(content: Any, where: str) -> Any:
    """A message item's content -> chat content: a string, or text and image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise protocol.type_error(f"{where}.content", "a string or a list of content parts", content)
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}.content[{k}]"
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise protocol.ApiError(400, f"{at}: an input_image needs an 'image_url' (a base64 data: URL; uploaded "
                                   "files are OpenAI's)", param=at, code="invalid_image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise protocol.ApiError(400, f"{at}: only input_text, output_text and input_image parts are served here "
                               f"(got {json.dumps(kind)[:40]})", param=at, code="unsupported_parameter")
    return parts


# ----------------------------------------------------------------------------- the answer as a response


class Answer:
    """What the response says about the request, and its output items as the answer comes."""

    def __init__(self, server, body: dict, chat: dict, prep):
        self.body, self.chat, self.prep = body, chat, prep
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.model = prep.model or server.model_id
        self.output: list[dict] = []
        self.usage: dict | None = None
        self.status = "in_progress"
        self.reason: str | None = None
        self.extra: dict = {}

    def response(self) -> dict:
        b = self.body
        tools = [{"type": "function", **t["function"]} for t in self.chat.get("tools") or []]
        fmt = (b.get("text") or {}).get("format") if isinstance(b.get("text"), dict) else None
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
               "error": None, "incomplete_details": {"reason": "max_output_tokens"}
               if self.status == "incomplete" else None,
               "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
               "model": self.model, "output": self.output,
               "parallel_tool_calls": b.get("parallel_tool_calls") is not False,  # null: the default, true
               "previous_response_id": None, "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"),
                                                          "summary": None},
               "store": False, "temperature": b.get("temperature", 1.0), "text": {"format": fmt or {"type": "text"}},
               "tool_choice": b.get("tool_choice") or "auto", "tools": tools, "top_p": b.get("top_p", 1.0),
               "truncation": "disabled", "usage": self.usage, "user": b.get("user"),
               "metadata": b.get("metadata") or {}}
        if self.extra:
            out["dgemma"] = self.extra
        return out

    def finish(self, reason: str | None, usage: dict | None) -> None:
        self.status = "incomplete" if reason == "length" else "completed"
        if usage is not None:
            p, c = usage["prompt_tokens"], usage["completion_tokens"]
            self.usage = {"input_tokens": p, "input_tokens_details": {
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
                "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(text: str, logprobs: list | None, status: str = "completed") -> dict:
    """status: "completed", "incomplete" (cut short by max_output_tokens: the text so far) or "in_progress"."""
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [output_text(text, logprobs)] if status != "in_progress" else []}


def output_text(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def plain_logprobs(content: list | None) -> list:
    """Chat's logprobs.content items as the Responses API's (no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"], "top_logprobs": [
        {"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]} for e in content or []]


def response_of(answer: Answer, chat: dict) -> dict:
    """A chat.completion object -> the response's output and usage."""
    choice = chat["choices"][0]
    message = choice["message"]
    if message.get("reasoning_content"):
        answer.output.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content")
        answer.output.append(message_item(message.get("content") or "", plain_logprobs(logprobs),
                                          "incomplete" if choice["finish_reason"] == "length" else "completed"))
    answer.output += [call_item(c) for c in calls]
    answer.finish(choice["finish_reason"], chat.get("usage"))
    answer.extra = chat.get("dgemma") or {}
    return answer.response()


async def events(answer: Answer, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The chat chunks -> the Responses API's server-sent events."""
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        data = {"type": kind, **fields, "sequence_number": seq}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    yield event("response.created", response=answer.response())
    yield event("response.in_progress", response=answer.response())
    thought = message = None  # the open reasoning / message item: [item, index, text, logprobs]

    def close_thought():
        nonlocal thought
        item, index, text, _ = thought
        thought = None
        done = {**item, "status": "completed", "content": [{"type": "reasoning_text", "text": text}]}
        answer.output[index] = done
        yield event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                    text=text)
        yield event("response.output_item.done", output_index=index, item=done)

    def open_message():
        nonlocal message
        item = message_item("", None, "in_progress")
        answer.output.append(item)
        message = [item, len(answer.output) - 1, "", []]
        yield event("response.output_item.added", output_index=message[1], item=item)
        yield event("response.content_part.added", item_id=item["id"], output_index=message[1], content_index=0,
                    part=output_text("", None))

    def close_message(status: str = "completed"):
        nonlocal message
        item, index, text, logprobs = message
        message = None
        part = output_text(text, logprobs)
        done = {**item, "status": status, "content": [part]}
        answer.output[index] = done
        yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                    text=text, logprobs=logprobs)
        yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                    part=part)
        yield event("response.output_item.done", output_index=index, item=done)

    reason, usage = None, None
    async for chunk in chunks:
        if "error" in chunk:  # the generation failed midway: the API's error event, then the failed response
            e = chunk["error"]
            yield event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
            answer.status = "failed"
            failed = answer.response()
            failed["error"] = {"code": e.get("code") or "server_error", "message": e.get("message")}
            yield event("response.failed", response=failed)
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        if not chunk.get("choices"):
            continue
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        reason = choice.get("finish_reason") or reason
        if delta.get("reasoning_content"):
            if thought is None:
                item = reasoning_item("", "in_progress")
                answer.output.append(item)
                thought = [item, len(answer.output) - 1, "", None]
                yield event("response.output_item.added", output_index=thought[1], item=item)
            thought[2] += delta["reasoning_content"]
            yield event("response.reasoning_text.delta", item_id=thought[0]["id"], output_index=thought[1],
                        content_index=0, delta=delta["reasoning_content"])
        logprobs = plain_logprobs((choice.get("logprobs") or {}).get("content"))
        if delta.get("content") or logprobs:
            if thought is not None:
                for e in close_thought():
                    yield e
            if message is None:
                for e in open_message():
                    yield e
            message[2] += delta.get("content") or ""
            message[3] += logprobs
            yield event("response.output_text.delta", item_id=message[0]["id"], output_index=message[1],
                        content_index=0, delta=delta.get("content") or "", logprobs=logprobs)
        for call in delta.get("tool_calls") or []:
            for e in (close_thought() if thought is not None else ()):
                yield e
            for e in (close_message() if message is not None else ()):
                yield e
            item = call_item(call, "in_progress")
            index = len(answer.output)
            answer.output.append(item)
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"])
            answer.output[index] = {**item, "status": "completed"}
            yield event("response.output_item.done", output_index=index, item=answer.output[index])
    if thought is not None:
        for e in close_thought():
            yield e
    if message is None and not any(o["type"] == "function_call" for o in answer.output):
        for e in open_message():  # an empty answer is still a message, as a whole one is
            yield e
    if message is not None:  # the answer's last item: cut short with it when max_output_tokens ended the answer
        for e in close_message("incomplete" if reason == "length" else "completed"):
            yield e
    answer.finish(reason, usage)
    kind = "response.incomplete" if answer.status == "incomplete" else "response.completed"
    yield event(kind, response=answer.response())


# ----------------------------------------------------------------------------- the route


PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
# a chat message's field (its tool call's), or a chat tool's function: named as the Responses request names them
CHAT_FIELD = re.compile(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function\.(\w+))?)?|tools\[(\d+)\]\.function\.")


def renamed(text: str, origins: list) -> str:
    """The chat request's field names in `text` -> the Responses request's: messages[j] -> the input item it came
    from (or instructions), messages[j].tool_calls[k].function.arguments -> its function_call item's arguments,
    tools[k].function.parameters -> tools[k].parameters."""
    def field(m: re.Match) -> str:
        if m.group(4) is not None:
            return f"tools[{m.group(4)}]."
        j, k, attr = int(m.group(1)), m.group(2), m.group(3)
        where, calls = origins[j] if j < len(origins) else ("input", {})
        if k is not None and int(k) in calls:
            return calls[int(k)] + (f".{attr}" if attr else "")
        return where

    return CHAT_FIELD.sub(field, text)


def routes(server) -> list[Route]:
    """The route, for app.build_app."""

    async def create(request: Request) -> Response:
        server.authorize(request)
        body = await protocol.read_json(request)
        origins: list = []
        chat = chat_request(body, origins)
        try:
            prep = await requests.prepared(server, chat, "chat", request)
        except protocol.ApiError as e:  # named as this API names the field
            head = (e.param or "").split("[")[0].split(".")[0]
            if e.param == "messages":
                e.param = "input"
            elif e.param is not None and head in ("messages", "tools"):
                e.param = renamed(e.param, origins)
            elif head in PARAMS:
                e.param = PARAMS[head] + e.param[len(head):]
            e.message = renamed(e.message, origins).replace("max_tokens", "max_output_tokens").replace(
                "'response_format", "'text.format")
            raise
        answer = Answer(server, body, chat, prep)
        if not prep.stream:
            whole = await answering.whole(server, request, prep)
            if whole is None:
                return Response(status_code=499)
            return JSONResponse(response_of(answer, whole))
        chunks, ticket = answering.stream_chunks(server, prep)
        return protocol.EventStream(events(answer, chunks), ticket)

    return [Route("/v1/responses", create, methods=["POST"])]
