"""The clients people point at a local model, unmodified, driving a real `dgemma serve` on the bundled demo model
through a real socket: litellm (its `ollama_chat/` and `openai/` providers), instructor, the OpenAI Agents SDK (chat
completions and Responses models), the official openai client's vLLM-style and Responses calls, lm-evaluation-harness
(a generation task scores; a log-likelihood task is refused in words), the official ollama client with tools,
LangChain (langchain-openai, langchain-ollama), pydantic-ai and the `llm` command line.

Each test imports its client with `pytest.importorskip`: a machine without it (`pip install -e .[clients]`) skips
that test cleanly. The demo model upper-cases 16-character text (`upper: hello diffusions` -> `HELLO DIFFUSIONS`)
and writes nonsense elsewhere, so where a client forces a tool call or a structure, what is held is the shape: the
call completes, its arguments validate, the client's loop ends. The whole module takes a minute or more (the clients'
imports alone take tens of seconds): it is `make test-slow`'s, not `make test`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from test_serve import ServerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "upper: hello diffusions"
ANSWER = "HELLO DIFFUSIONS"  # the demo model's answer to PROMPT (seed 0 and greedy alike: tests/test_serve.py)
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("clients"), "--max-batch", "4")
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.fixture
def v1(server) -> str:
    return server.url + "/v1"


# ----------------------------------------------------------------------------------------------------- litellm


def test_litellm_ollama_chat_and_openai_providers(server, v1, monkeypatch):
    """`ollama_chat/demo` posts to /api/chat (without a Content-Type header) and `openai/demo` to
    /v1/chat/completions; both answer the text, streamed too."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else its import fetches a price list from the web
    litellm = pytest.importorskip("litellm")
    for model, base in (("ollama_chat/demo", server.url), ("openai/demo", v1)):
        r = litellm.completion(model=model, api_base=base, api_key="none", messages=MESSAGES, seed=0, timeout=60)
        assert r.choices[0].message.content == ANSWER, model
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens > 0, model
        chunks = list(litellm.completion(model=model, api_base=base, api_key="none", messages=MESSAGES, seed=0,
                                         stream=True, timeout=60))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER, model


# ---------------------------------------------------------------------------------------------------- instructor


def test_instructor_tools_mode_with_an_optional_field(v1):
    """instructor's TOOLS mode forces a call to a function whose parameters are the model's schema; `Optional[str]`
    is an `anyOf` of string and null in it. The call must complete and validate into the object."""
    instructor = pytest.importorskip("instructor")
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel

    class Word(BaseModel):
        word: str
        note: Optional[str] = None

    client = instructor.from_openai(openai.OpenAI(base_url=v1, api_key="none", max_retries=0, timeout=120),
                                    mode=instructor.Mode.TOOLS)
    word = client.chat.completions.create(model="demo", response_model=Word, messages=MESSAGES, max_retries=0,
                                          temperature=0)
    assert isinstance(word, Word) and isinstance(word.word, str)
    assert word.note is None or isinstance(word.note, str)


# ------------------------------------------------------------------------------------------- OpenAI Agents SDK


def _agent_tools():
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def shout(text: str) -> str:
        """Upper-case a text."""
        calls.append(text)
        return text.upper()

    return agents, shout, calls


def test_agents_sdk_chat_completions_model_runs_its_tool_loop(v1, monkeypatch):
    """An Agent with a function tool of one plain `str` parameter on OpenAIChatCompletionsModel: the first turn
    is forced to call it (tool_choice required), the SDK runs the tool, sends its result back, and the next turn
    (tool_choice reset to auto) ends the loop with a final output."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    agents, shout, calls = _agent_tools()
    import openai

    client = openai.AsyncOpenAI(base_url=v1, api_key="none", max_retries=0, timeout=120)
    agent = agents.Agent(name="shouter", instructions="Use the tool.", tools=[shout],
                         model=agents.OpenAIChatCompletionsModel(model="demo", openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             temperature=0, max_tokens=64))
    result = agents.Runner.run_sync(agent, PROMPT, max_turns=3)
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


def test_agents_sdk_default_responses_model(v1, monkeypatch):
    """The SDK's default model, OpenAIResponsesModel (POST /v1/responses, streamed), pointed at the server: a plain
    Agent gets the answer, and an Agent whose tool call is forced gets the call as a Responses function_call item,
    runs it, and ends on the tool's output (tool_use_behavior "stop_on_first_tool").

    Not held: the turn after a tool result through Responses. The demo model does not stop writing after one, so
    that turn ends at max_output_tokens, which the Responses API reports as `status: incomplete` and the SDK raises
    as ModelBehaviorError (as it does against OpenAI for the same cut)."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    agents, shout, calls = _agent_tools()
    import openai

    client = openai.AsyncOpenAI(base_url=v1, api_key="none", max_retries=0, timeout=120)
    model = agents.OpenAIResponsesModel(model="demo", openai_client=client)
    plain = agents.Agent(name="upper", model=model, model_settings=agents.ModelSettings(temperature=0))
    assert agents.Runner.run_sync(plain, PROMPT, max_turns=2).final_output == ANSWER
    forced = agents.Agent(name="shouter", instructions="Use the tool.", tools=[shout], model=model,
                          tool_use_behavior="stop_on_first_tool",
                          model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                              temperature=0))
    result = agents.Runner.run_sync(forced, PROMPT, max_turns=2)
    assert len(calls) == 1 and isinstance(calls[0], str) and result.final_output == calls[0].upper()


# ------------------------------------------------------------------------- the openai client: vLLM's and others'


def test_openai_client_guided_choice_responses_and_logprobs(server):
    """What a request written for vLLM or for the newer OpenAI endpoints sends: `guided_choice` (and vLLM's newer
    `structured_outputs: {choice}`) answer one of the choices; `client.responses.create` answers, whole and
    streamed; `logprobs` / `top_logprobs` come back for every answer token."""
    client = server.client()
    choices = ["HELLO", "WORLD", "DIFFUSIONS"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        for seed in (0, 1):
            r = client.chat.completions.create(model="demo", messages=MESSAGES, seed=seed, extra_body=extra)
            assert r.choices[0].message.content in choices, (extra, seed)
        r = client.completions.create(model="demo", prompt=PROMPT, seed=0, extra_body=extra)
        assert r.choices[0].text in choices, extra

    r = client.responses.create(model="demo", input=PROMPT, temperature=0)
    assert r.status == "completed" and r.output_text == ANSWER
    events = list(client.responses.create(model="demo", input=MESSAGES, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER

    r = client.chat.completions.create(model="demo", messages=MESSAGES, seed=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content == ANSWER
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    r = client.completions.create(model="demo", prompt=PROMPT, seed=0, max_tokens=16, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(p <= 0 for p in lp.token_logprobs) and all(len(top) <= 2 for top in lp.top_logprobs)


# -------------------------------------------------------------------------------------- lm-evaluation-harness


def _lm_eval_tasks(tmp_path: Path) -> Path:
    """Two tiny tasks on a local JSON Lines file (nothing downloaded): a generate_until one scored by exact match,
    and a multiple-choice one (log-likelihoods of each choice)."""
    data = tmp_path / "upper.jsonl"
    data.write_text("".join(json.dumps({"text": t, "answer": t.upper()}) + "\n"
                            for t in ("hello diffusions", "abc def 12 ghijk")))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gen.yaml").write_text(
        "task: dgemma_upper\n" + common +
        'output_type: generate_until\ndoc_to_text: "upper: {{text}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 32\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (tasks / "mc.yaml").write_text(
        "task: dgemma_upper_mc\n" + common +
        'output_type: multiple_choice\ndoc_to_text: "upper: {{text}}\\nAnswer:"\n'
        'doc_to_choice: ["{{answer}}", "{{text}}"]\ndoc_to_target: 0\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return tasks


def test_lm_eval_generation_scores_and_loglikelihood_is_refused_in_words(v1, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    requests = pytest.importorskip("requests")
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(_lm_eval_tasks(tmp_path)))
    out = lm_eval.simple_evaluate(model="local-chat-completions", tasks=["dgemma_upper"], task_manager=tm,
                                  model_args=f"model=demo,base_url={v1}/chat/completions,tokenizer_backend=None",
                                  apply_chat_template=True)
    assert out["results"]["dgemma_upper"]["exact_match,none"] == 1.0  # lm-eval sends temperature 0: greedy

    # local-completions' loglikelihood requests send echo + logprobs: a 400 whose message says why, in words (lm-eval
    # logs the body, then raises the HTTPError); the tokenizer is the model directory's (dgemma serves no remote one)
    args = (f"model=demo,base_url={v1}/completions,tokenizer_backend=huggingface,"
            f"tokenizer={ROOT / 'dgemma_cli' / 'demo_model'},max_retries=1")
    with pytest.raises(requests.HTTPError) as e:
        lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["dgemma_upper_mc"],
                                task_manager=tm)
    assert e.value.response.status_code == 400
    error = e.value.response.json()["error"]
    assert error["param"] == "echo" and "loglikelihood tasks cannot run here" in error["message"]


# ------------------------------------------------------------------------------------------- the ollama client


def test_ollama_client_chat_with_tools(server):
    """The official client with a Python function as a tool (it derives the schema), then a conversation holding
    the model's call (arguments as an object) and the tool's result: both answered in Ollama's shape. Ollama's API
    has no tool_choice, so whether the demo model calls is its own affair; `show` says the model takes tools."""
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.url, timeout=120)
    assert "tools" in client.show("demo").capabilities

    def shout(text: str) -> str:
        """Upper-case a text.

        Args:
          text: the text to upper-case
        """
        return text.upper()

    r = client.chat(model="demo", messages=MESSAGES, tools=[shout], options={"seed": 0, "num_predict": 64})
    assert r.done and r.message.role == "assistant"
    assert r.message.content or r.message.tool_calls
    for call in r.message.tool_calls or []:
        assert call.function.name == "shout" and isinstance(call.function.arguments, dict)
    history = [*MESSAGES,
               {"role": "assistant", "content": "",
                "tool_calls": [{"function": {"name": "shout", "arguments": {"text": "hello diffusions"}}}]},
               {"role": "tool", "tool_name": "shout", "content": ANSWER}]
    r = client.chat(model="demo", messages=history, tools=[shout], options={"seed": 0, "num_predict": 32})
    assert r.done and r.done_reason in ("stop", "length") and isinstance(r.message.content, str)


# --------------------------------------------------------------------------- LangChain, pydantic-ai, llm (optional)


def test_langchain_openai_and_ollama(server, v1):
    pytest.importorskip("langchain_openai")
    pytest.importorskip("langchain_ollama")
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama
    from langchain_openai import ChatOpenAI

    assert ChatOpenAI(model="demo", base_url=v1, api_key="none", seed=0, max_retries=0).invoke(PROMPT).content == ANSWER
    assert ChatOllama(model="demo", base_url=server.url, seed=0).invoke(PROMPT).content == ANSWER

    @tool
    def shout(text: str) -> str:
        """Upper-case a text."""
        return text.upper()

    forced = ChatOpenAI(model="demo", base_url=v1, api_key="none", temperature=0, max_retries=0,
                        timeout=120).bind_tools([shout], tool_choice="shout")
    calls = forced.invoke(PROMPT).tool_calls
    assert [c["name"] for c in calls] == ["shout"] and isinstance(calls[0]["args"]["text"], str)


def test_pydantic_ai_text_and_structured_output(v1):
    pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Word(BaseModel):
        word: str
        note: Optional[str] = None

    model = OpenAIChatModel("demo", provider=OpenAIProvider(base_url=v1, api_key="none"))
    assert Agent(model).run_sync(PROMPT, model_settings={"seed": 0}).output == ANSWER
    # structured output: pydantic-ai forces a call to its output tool, whose parameters are Word's schema
    word = Agent(model, output_type=Word).run_sync(PROMPT, model_settings={"temperature": 0}).output
    assert isinstance(word, Word)


def test_llm_cli_with_an_extra_openai_model(v1, tmp_path):
    """the `llm` command line, configured as its docs say for an OpenAI-compatible server
    (extra-openai-models.yaml in its user directory), run as a command."""
    pytest.importorskip("llm")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f'- model_id: dgemma-demo\n  model_name: demo\n  api_base: "{v1}"\n')
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path)}
    for stream in ([], ["--no-stream"]):
        r = subprocess.run([sys.executable, "-m", "llm", "-m", "dgemma-demo", "-o", "seed", "0", "--no-log",
                            *stream, PROMPT], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == ANSWER, r.stderr
