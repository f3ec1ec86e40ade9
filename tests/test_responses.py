"""OpenAI's Responses API on `dgemma serve` (dgemma_cli/server/responses_api.py), through the official `openai` client's
`client.responses`: answers equal the chat path's for the same conversation and seed, streaming sends the API's
event sequence, a function tool loop runs, and what the server cannot honour gets one 400."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from dgemma_cli.server import responses_api  # noqa: E402
from dgemma_cli.engine import load  # noqa: E402
from test_serve import ServerProcess  # noqa: E402

PROMPT = "upper: hello diffusions"
SHOUT = {"type": "function", "name": "shout", "description": "Shout the text",
         "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 16}},
                        "required": ["text"]}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("responses"), "--max-batch", "4")
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def engine():
    return load("demo", device="cpu", dtype="float32")


def test_a_response_is_the_chat_answer(server, engine):
    client = server.client()
    alone = engine.generate(PROMPT, seed=0)
    r = client.responses.create(model="demo", input=PROMPT, extra_body={"seed": 0})
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == alone.texts[0] == "HELLO DIFFUSIONS"
    [item] = r.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    assert [(c.type, c.text, c.annotations) for c in item.content] == [("output_text", "HELLO DIFFUSIONS", [])]
    assert r.usage.input_tokens == len(alone.prompt_token_ids[0])
    assert r.usage.output_tokens == len(alone.token_ids[0])
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # instructions and input items (text parts) are the chat path's system and user messages
    messages = [{"role": "system", "content": "be loud"}, {"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="demo", messages=messages, seed=3, max_tokens=64)
    r = client.responses.create(model="demo", instructions="be loud", max_output_tokens=64, extra_body={"seed": 3},
                                input=[{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    # a short max_output_tokens: incomplete, as the chat path's finish_reason "length"
    r = client.responses.create(model="demo", input=PROMPT, max_output_tokens=5, extra_body={"seed": 0})
    assert (r.status, r.incomplete_details.reason, r.output_text) == ("incomplete", "max_output_tokens", "HELLO")


def test_streamed_events_in_the_apis_order(server):
    client = server.client()
    whole = client.responses.create(model="demo", input=PROMPT, max_output_tokens=64, extra_body={"seed": 0})
    events = list(client.responses.create(model="demo", input=PROMPT, max_output_tokens=64, stream=True,
                                          extra_body={"seed": 0}))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [k for i, k in enumerate(kinds) if k != "response.output_text.delta" or
            kinds[i - 1] != "response.output_text.delta"] == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text == "HELLO DIFFUSIONS"
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # the client's own stream helper assembles the same response
    with client.responses.stream(model="demo", input=PROMPT, max_output_tokens=64, extra_body={"seed": 0}) as s:
        assert s.get_final_response().output_text == whole.output_text


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_a_function_tool_loop(server):
    """A required call in the flat tool shape, its result sent back as function_call_output items: the same turns
    as the chat path's tool_calls and tool messages, streamed or not."""
    client = server.client()
    first = client.responses.create(model="demo", input=PROMPT, tools=[SHOUT], tool_choice="required",
                                    max_output_tokens=64, extra_body={"seed": 0})
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and first.status == "completed"
    for c in calls:
        assert c.name == "shout" and c.call_id and c.status == "completed"
        args = json.loads(c.arguments)
        assert set(args) == {"text"} and len(args["text"]) <= 16
    streamed = list(client.responses.create(model="demo", input=PROMPT, tools=[SHOUT], tool_choice="required",
                                            max_output_tokens=64, stream=True, extra_body={"seed": 0}))
    kinds = [e.type for e in streamed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    args_done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in args_done] == [c.arguments for c in calls]
    # the tool's result goes back; the answer equals the chat path's for the same conversation
    follow = [{"role": "user", "content": PROMPT}, *[c.model_dump(exclude_none=True) for c in calls],
              *[{"type": "function_call_output", "call_id": c.call_id, "output": "DONE"} for c in calls]]
    second = client.responses.create(model="demo", input=follow, tools=[SHOUT], max_output_tokens=64,
                                     extra_body={"seed": 4})
    messages = [{"role": "user", "content": PROMPT},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]},
                *[{"role": "tool", "tool_call_id": c.call_id, "content": "DONE"} for c in calls]]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=64, seed=4,
                                          tools=[{"type": "function", "function": {
                                              k: v for k, v in SHOUT.items() if k != "type"}}])
    assert second.output_text == (chat.choices[0].message.content or "")
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_text_format_and_logprobs(server):
    client = server.client()
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5}}, "required": ["word"],
              "additionalProperties": False}
    r = client.responses.create(model="demo", input=PROMPT, max_output_tokens=64, extra_body={"seed": 0},
                                text={"format": {"type": "json_schema", "name": "w", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"word"}
    r = client.responses.create(model="demo", input=PROMPT, top_logprobs=2, extra_body={"seed": 0},
                                include=["message.output_text.logprobs"])
    lp = r.output[0].content[0].logprobs
    assert "".join(x.token for x in lp) == r.output_text and all(len(x.top_logprobs) == 2 for x in lp)
    r = client.responses.create(model="demo", input=PROMPT, reasoning={"effort": "low"}, extra_body={"seed": 0})
    assert r.status == "completed"  # thinking asked for (the demo model does not think)


def test_what_a_stateless_server_cannot_honour_is_refused(server):
    http = httpx.Client(base_url=server.url, timeout=60)
    ok = {"model": "demo", "input": PROMPT}
    cases = [
        ({**ok, "previous_response_id": "resp_1"}, "unsupported_parameter", "previous_response_id"),
        ({**ok, "conversation": "conv_1"}, "unsupported_parameter", "conversation"),
        ({**ok, "background": True}, "unsupported_parameter", "background"),
        ({**ok, "tools": [{"type": "web_search"}]}, "unsupported_parameter", "tools[0].type"),
        ({**ok, "input": [{"type": "item_reference", "id": "msg_1"}]}, "unsupported_parameter", "input[0]"),
        ({**ok, "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "unsupported_parameter", "input[0].content[0]"),
        ({**ok, "input": []}, "invalid_type", "input"),
        ({**ok, "max_output_tokens": 10**6}, "context_length_exceeded", "input"),
        ({**ok, "max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
        ({**ok, "text": {"format": {"type": "grammar"}}}, "invalid_value", "text.format"),
        ({**ok, "text": {"format": [1]}}, "invalid_type", "text.format"),  # named as this API names it
    ]
    for body, code, param in cases:
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert (err["code"], err["param"]) == (code, param), err
        assert err["type"] == "invalid_request_error" and "max_tokens" not in err["message"]
        assert "response_format" not in err["message"], err
    r = http.post("/v1/responses", json={**ok, "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        server.client().responses.create(model="demo", input=PROMPT, previous_response_id="resp_1")
    assert "keeps no responses" in str(e.value)
    assert server.health()["failed"] == 0


def test_reasoning_and_a_failure_midway_as_events():
    """The translation of chat chunks into events, without a server: a thought becomes a reasoning item before the
    message, calls come after it, and a generation that fails midway ends in `error` and `response.failed`."""

    class Prep:
        model, stream = "demo", True

    class Srv:
        model_id = "demo"

    def run(chunks):
        async def gen():
            for c in chunks:
                yield c

        async def collect():
            answer = responses_api.Answer(Srv(), {"input": "x"}, {"messages": []}, Prep())
            return [json.loads(e.split("data: ", 1)[1]) async for e in responses_api.events(answer, gen())]

        return asyncio.run(collect())

    delta = lambda **d: {"choices": [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None}]}  # noqa
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events = run([delta(role="assistant", content=""), delta(reasoning_content="hmm"), delta(content="Hi"),
                  delta(tool_calls=[call]), {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}])
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                     "response.output_item.done",
                     *TEXT_EVENTS[2:-1],
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert final["output"][2]["call_id"] == "call_1" and final["usage"]["total_tokens"] == 7
    failed = run([delta(content="Hi"), {"error": {"message": "generation failed", "code": "generation_failed"}}])
    assert [e["type"] for e in failed][-2:] == ["error", "response.failed"]
    assert failed[-1]["response"]["status"] == "failed"


def test_an_incomplete_answer_says_so_in_its_message_item(server):
    """Cut short by max_output_tokens: the response is "incomplete" and so is its message item (streamed or not), as
    OpenAI's API says it; the text written so far is still the item's."""
    http = httpx.Client(base_url=server.url, timeout=60)
    body = {"model": "demo", "input": PROMPT, "max_output_tokens": 4, "seed": 0}
    r = http.post("/v1/responses", json=body).json()
    assert (r["status"], r["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"}), r
    [item] = r["output"]
    assert (item["type"], item["status"]) == ("message", "incomplete"), item
    assert item["content"][0]["text"] and item["content"][0]["type"] == "output_text"
    events = list(server.client().responses.create(model="demo", input=PROMPT, max_output_tokens=4, stream=True,
                                                   extra_body={"seed": 0}))
    assert events[-1].type == "response.incomplete"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [("message", "incomplete")]
    assert [(o.type, o.status) for o in events[-1].response.output] == [("message", "incomplete")]
    assert done[0].content[0].text == item["content"][0]["text"]
    # a whole answer's item is completed
    r = http.post("/v1/responses", json={**body, "max_output_tokens": 64}).json()
    assert (r["status"], r["output"][0]["status"]) == ("completed", "completed")


def test_parallel_tool_calls_is_echoed_as_the_boolean_in_effect(server):
    http = httpx.Client(base_url=server.url, timeout=60)
    body = {"model": "demo", "input": PROMPT, "max_output_tokens": 8, "seed": 0}
    for sent, echoed in ((None, True), (True, True), (False, False)):
        r = http.post("/v1/responses", json={**body, "parallel_tool_calls": sent})
        assert r.status_code == 200 and r.json()["parallel_tool_calls"] is echoed, (sent, r.text)
    assert http.post("/v1/responses", json=body).json()["parallel_tool_calls"] is True
    r = http.post("/v1/responses", json={**body, "parallel_tool_calls": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls", r.text


def test_errors_name_the_responses_own_fields(server):
    """What the chat path refuses is named as the Responses request names it: an input item's `arguments` (not a
    chat message's tool_calls[].function.arguments), a flat function tool (not chat's nested shape)."""
    http = httpx.Client(base_url=server.url, timeout=60)
    call = {"type": "function_call", "call_id": "c1", "name": "shout", "arguments": '{"text": "HI"}'}
    ok = {"model": "demo", "input": [{"role": "user", "content": PROMPT}, call,
                                     {"type": "function_call_output", "call_id": "c1", "output": "DONE"}],
          "tools": [SHOUT], "max_output_tokens": 8, "seed": 0}
    assert http.post("/v1/responses", json=ok).status_code == 200
    cases = [
        ({**ok, "input": [ok["input"][0], {**call, "arguments": "{not json"}]}, "input[1].arguments"),
        ({**ok, "input": [ok["input"][0], {**call, "arguments": "[1, 2]"}]}, "input[1].arguments"),
        ({**ok, "input": [ok["input"][0], {"role": "assistant", "content": "x"}, {**call, "arguments": "7"}]},
         "input[2].arguments"),  # a call merged into the assistant's message before it is still its own item
        ({**ok, "instructions": "be loud", "input": [ok["input"][0], {**call, "arguments": "[1]"}]},
         "input[1].arguments"),
        ({**ok, "tools": [{**SHOUT, "name": "no spaces allowed"}]}, "tools[0].name"),
        ({**ok, "tools": [SHOUT, {"type": "function"}]}, "tools[1].name"),
        ({**ok, "tools": [{**SHOUT, "parameters": "text"}]}, "tools[0].parameters"),
        ({**ok, "tool_choice": "sometimes"}, "tool_choice"),
    ]
    for body, param in cases:
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (param, err)
        assert param.split(".")[0].split("[")[0] in err["message"], err
        for chat_word in ("messages", "tool_calls", "function.", "'function': {", "}}"):
            assert chat_word not in err["message"], (chat_word, err)
    assert server.health()["failed"] == 0
