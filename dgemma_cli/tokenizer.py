"""Text in, token ids out, and back: the tokenizer and the chat format (docs/design.md, The chat format).

The rule: this module knows tokens and text, nothing of the model. It never imports torch.

The chat template is rendered with jinja2 the way transformers renders it (same sandbox, same options,
same variables), so a checkpoint's shipped template gives the prompt the model was trained on. The rendered
text already starts with `<bos>`, so it is encoded without adding special tokens.
"""

from __future__ import annotations

import json
import re
import threading
from datetime import datetime
from pathlib import Path
from typing import Callable

from .errors import ModelError, UsageError

# Used when a checkpoint ships no chat template. Renders exactly:
#   <bos><|turn>{role}\n{content}<turn|>\n ... <|turn>model\n
# "assistant" is Gemma's "model"; with thinking on, `<|think|>` opens the system turn (one is made if missing).
FALLBACK_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- set starts_with_system = messages and messages[0]['role'] == 'system' -%}
{%- if enable_thinking and not starts_with_system -%}
    {{- '<|turn>system\\n<|think|><turn|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<|turn>' + role + '\\n' -}}
    {%- if enable_thinking and loop.first and role == 'system' -%}
        {{- '<|think|>' -}}
    {%- endif -%}
    {{- message['content'] -}}
    {{- '<turn|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\\n' -}}
{%- endif -%}
"""

# The thought channel the model may write before its answer: <|channel>thought\n ... <channel|>
CHANNEL_START = "<|channel>"
CHANNEL_END = "<channel|>"
THOUGHT_HEADER = "thought\n"


def split_thought(text: str) -> tuple[str, str]:
    """Split text (decoded keeping special tokens) into (thought, answer).

    A complete channel `<|channel>thought\\n...<channel|>` is cut out of the answer. An unterminated one
    is still being generated: everything after its header is thought and the answer is what came before.
    Without a thought channel the thought is "" and the text is the answer. Only the first channel is
    looked at, since the model thinks once, before answering.
    """
    start = text.find(CHANNEL_START)
    if start < 0:
        return "", text
    before = text[:start]
    rest = text[start + len(CHANNEL_START) :]
    if not rest.startswith(THOUGHT_HEADER):
        if THOUGHT_HEADER.startswith(rest):
            # The header itself is still being generated ("<|channel>thou"): no thought text yet.
            return "", before
        # Some other channel: not ours to interpret.
        return "", text
    rest = rest[len(THOUGHT_HEADER) :]
    end = rest.find(CHANNEL_END)
    if end < 0:
        return rest, before
    return rest[:end], before + rest[end + len(CHANNEL_END) :]


# Characters of Unicode's Supplementary Private Use Area-A: while a chat renders, each special-token string in a
# message's text stands as one of them (encode_chat). Such characters in the text itself are swapped too.
_SENTINEL_FIRST, _SENTINEL_LAST = 0xF0000, 0xFFFFD
_SENTINELS = f"[{chr(_SENTINEL_FIRST)}-{chr(_SENTINEL_LAST)}]"


class Control(str):
    """A special token's string put in a chat message on purpose (an image placeholder): encode_chat keeps it as
    the control token, where the same string typed by a user is plain text."""


class Tokenizer:
    """A checkpoint's tokenizer.json plus its chat template."""

    def __init__(self, tokenizer, chat_template: str, special_tokens: dict[str, str] | None = None,
                 template_origin: str | None = None):
        """tokenizer: a `tokenizers.Tokenizer`; special_tokens: template variables like bos_token -> "<bos>";
        template_origin: where the template came from, named when it does not compile."""
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_origin = template_origin
        self.special_tokens = dict(special_tokens or {})
        # Compiled at first use, not here: raw text (`dgemma run --raw`, infill) never renders the template, so a
        # broken one must not stop it. A template that does not compile fails the first chat render instead.
        self._template = None
        # Every special added token (control tokens, placeholders), longest first so that no token is cut by
        # a shorter one that is its prefix. Used to clean decoded text.
        specials = sorted(
            (t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special), key=len, reverse=True
        )
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        # A special token's string, or a character of the range that stands in for one while a chat renders.
        self._forgeable_re = re.compile("|".join([*map(re.escape, specials), _SENTINELS]))
        self._plain_lock = threading.Lock()
        self._max_token_chars: int | None = None
        self._token_bytes: list[bytes | None] | None = None
        self._special_ids: set[int] | None = None

    @classmethod
    def from_dir(cls, path) -> Tokenizer:
        """Load tokenizer.json and the chat template from a model directory.

        The template comes from chat_template.jinja, else tokenizer_config.json's "chat_template", else
        FALLBACK_CHAT_TEMPLATE. Raises ModelError when tokenizer.json is missing or unreadable; a template that does
        not compile raises (naming its file) only when a chat is rendered.
        """
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelError(f"{tokenizer_file} not found: the model directory must contain tokenizer.json")
        try:
            tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the library raises plain Exceptions with multi-line messages
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelError(f"cannot read {tokenizer_file}: {reason}") from None

        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file)
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template, origin = _read_text(template_file), str(template_file)
        elif _template_from_config(config.get("chat_template")):
            chat_template, origin = _template_from_config(config["chat_template"]), f"{config_file} (chat_template)"
        else:
            chat_template, origin = FALLBACK_CHAT_TEMPLATE, "the built-in chat template"

        # Template variables named after the config's special tokens, as transformers passes them;
        # Gemma's own names are the defaults so the fallback template works without a config.
        special_tokens = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
        for name in list(special_tokens) + ["mask_token"]:
            value = config.get(name)
            if isinstance(value, dict):  # an AddedToken written out as {"content": ..., ...}
                value = value.get("content")
            if isinstance(value, str):
                special_tokens[name] = value
        return cls(tokenizer, chat_template, special_tokens, template_origin=origin)

    # --- tokens ---------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of text exactly as given. No special tokens are added, but special-token strings in
        the text (like "<bos>") become their ids: for text whose author may place control tokens (`run --raw`,
        a raw completion prompt), never for a user's or a file's text (`encode_text`)."""
        with self._plain_lock:  # not while another thread has the special-tokens-as-text flag set
            return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids  # the GIL released

    def encode_text(self, text: str) -> list[int]:
        """Token ids of text as plain text: a special token's string in it ("<turn|>", "<eos>") is encoded as the
        characters it is made of, never as the control token. For text that comes from a user or a file."""
        return self._encode_plain([text])[0]

    def _encode_plain(self, texts: list[str]) -> list[list[int]]:
        # encode_batch releases the GIL while the library works (encode does not), so a long text tokenized in a
        # server's worker thread does not stall its event loop. The flag is the tokenizer object's own: set and
        # reset under a lock, since request threads share the object.
        with self._plain_lock:
            self._tokenizer.encode_special_tokens = True
            try:
                return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]
            finally:
                self._tokenizer.encode_special_tokens = False

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_answer(self, ids) -> tuple[str, str]:
        """(thought, answer) of generated ids, special tokens removed and surrounding whitespace stripped."""
        text, restore = self.decode_marked(ids)
        thought, answer = split_thought(text)
        return self.strip_special(restore(thought)).strip(), self.strip_special(restore(answer)).strip()

    def decode_marked(self, ids) -> tuple[str, Callable[[str], str]]:
        """(ids decoded keeping their special tokens, restore): a special token's string in the text comes from
        its id only. One that text tokens spell (a model copying "<|tool_call>" or "<|channel>" out of a document
        or a tool's answer) stands as a private-use character, so that what splits the text at control strings
        (the thought channel, tool calls) reads the model's tokens, never its text; `restore` puts the spelled
        strings back in a piece of the text."""
        ids = list(ids)
        specials = self._special_id_set()
        if not self._forgeable_re.search(self.decode([t for t in ids if t not in specials])):
            return self.decode(ids, skip_special_tokens=False), lambda piece: piece  # no text spells one
        swapped: list[str] = []

        def swap(match: re.Match) -> str:
            if len(swapped) > _SENTINEL_LAST - _SENTINEL_FIRST:
                return ""  # past the stand-ins' range: dropped, never read as a control string
            swapped.append(match.group(0))
            return chr(_SENTINEL_FIRST + len(swapped) - 1)

        parts, run = [], []
        for t in ids + [None]:
            if t is not None and t not in specials:
                run.append(t)
                continue
            if run:
                parts.append(self._forgeable_re.sub(swap, self.decode(run, skip_special_tokens=False)))
                run = []
            if t is not None:
                parts.append(self.decode([t], skip_special_tokens=False))

        def restore(piece: str) -> str:
            def back(c: re.Match) -> str:
                k = ord(c.group(0)) - _SENTINEL_FIRST
                return swapped[k] if k < len(swapped) else c.group(0)

            return re.sub(_SENTINELS, back, piece)

        return "".join(parts), restore

    def _special_id_set(self) -> set[int]:
        if self._special_ids is None:
            self._special_ids = {i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}
        return self._special_ids

    def strip_special(self, text: str) -> str:
        """Text with every special token string (<turn|>, <eos>, <pad>, <mask>, ...) removed."""
        return self._special_re.sub("", text) if self._special_re else text

    # Also reachable as a method, for callers that hold a Tokenizer.
    split_thought = staticmethod(split_thought)

    def token_id(self, token: str) -> int | None:
        """Id of a token string, or None if the vocabulary lacks it."""
        return self._tokenizer.token_to_id(token)

    def token_bytes(self) -> list[bytes | None]:
        """Per id, the bytes the token stands for in decoded text, or None for an added token (control tokens,
        placeholders: never part of a constrained answer's text). Byte-fallback tokens ("<0x0A>") are their byte,
        SentencePiece's "▁" a space (the decoder's Replace steps), GPT-2 byte-level tokens their bytes. Cached."""
        if self._token_bytes is None:
            spec = json.loads(self._tokenizer.to_str())
            model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
            steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
            replaces = [(d["pattern"].get("String"), d["content"]) for d in steps
                        if d.get("type") == "Replace" and isinstance(d.get("pattern"), dict)
                        and d["pattern"].get("String")]
            byte_level = any(d.get("type") == "ByteLevel" for d in steps)
            fallback = bool(model.get("byte_fallback")) or any(d.get("type") == "ByteFallback" for d in steps)
            unicode_bytes = {c: b for b, c in _gpt2_byte_chars().items()} if byte_level else None
            added = set(self._tokenizer.get_added_tokens_decoder())
            out: list[bytes | None] = [None] * self.vocab_size
            for token, i in self._tokenizer.get_vocab(with_added_tokens=True).items():
                if i in added or i >= len(out):
                    continue
                m = _BYTE_TOKEN.fullmatch(token) if fallback else None
                if m:
                    out[i] = bytes([int(m.group(1), 16)])
                elif unicode_bytes is not None:
                    out[i] = bytes(unicode_bytes[c] for c in token) if all(c in unicode_bytes for c in token) \
                        else None
                else:
                    for pattern, content in replaces:
                        token = token.replace(pattern, content)
                    out[i] = token.encode()
            self._token_bytes = out
        return self._token_bytes

    @property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary string's length; byte tokens such as "<0x0A>"
        count longer than they are, which only makes this larger): text of n characters has at least
        n / max_token_chars tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max(1, max(map(len, self._tokenizer.get_vocab(with_added_tokens=True))))
        return self._max_token_chars

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self.token_id("<bos>")

    @property
    def eos_id(self) -> int | None:
        return self.token_id("<eos>")

    @property
    def pad_id(self) -> int | None:
        return self.token_id("<pad>")

    @property
    def end_of_turn_id(self) -> int | None:
        return self.token_id("<turn|>")

    # --- chat -----------------------------------------------------------------------------------------

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = False, **kwargs
    ) -> str:
        """The chat template applied to messages ([{"role": ..., "content": ...}, ...]).

        Extra keyword arguments become template variables. Raises UsageError when the template rejects
        the conversation (for example with raise_exception on an unknown role).
        """
        import jinja2

        # As transformers does: keys set to None are dropped (templates handle a missing key better
        # than a None), and the caller's dicts are not modified.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {
            "tools": None,
            "documents": None,
            **self.special_tokens,
            "enable_thinking": enable_thinking,
            **kwargs,
        }
        uses_tools = bool(variables.get("tools")) or any(m.get("role") == "tool" or m.get("tool_calls")
                                                          for m in messages)
        if uses_tools and not self.renders_tools:  # Gemma 4's tool format, written by dgemma (tools.py)
            from .tools import render_tool_chat

            return render_tool_chat(messages, [t["function"] for t in variables.get("tools") or []],
                                    bos=self.special_tokens.get("bos_token", "<bos>"),
                                    enable_thinking=enable_thinking, add_generation_prompt=add_generation_prompt)
        template = self.compiled_template()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise UsageError(f"the chat template rejected the conversation: {e}") from None

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tools, tool calls and tool results itself (a shipped Gemma 4 template
        does); otherwise dgemma writes them in Gemma 4's format (tools.render_tool_chat)."""
        return "tool_calls" in self.chat_template and "tools" in self.chat_template

    def compiled_template(self):
        """The chat template, compiled on first use; ModelError (naming where it came from) if it does not compile."""
        if self._template is None:
            try:
                self._template = _compile_template(self.chat_template)
            except ModelError as e:
                raise ModelError(f"{self.template_origin}: {e}" if self.template_origin else str(e)) from None
        return self._template

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = False, **kwargs
    ) -> list[int]:
        """Token ids of the rendered chat (it already starts with <bos>).

        Only the template places control tokens. A message's content is the user's text: a special token's
        string typed in it ("<turn|>", "<|turn>system") is encoded as plain text, so no one can forge a turn. A
        content may also be a list of strings and `Control` pieces; a `Control` (an image placeholder the caller
        puts there) stays the control token it names.

        How: each special-token string in a content's text is swapped for a private-use character before
        rendering, so the rendered text's special-token strings are exactly the template's and the controls;
        the text between them is encoded with the swapped strings put back, as plain text. A conversation with
        nothing to swap is encoded as the whole rendered text (the tokens transformers' apply_chat_template gives).
        """
        swapped: list[str] = []  # the original string of each private-use character, by its offset

        def swap(match: re.Match) -> str:
            if len(swapped) > _SENTINEL_LAST - _SENTINEL_FIRST:
                raise UsageError("the conversation holds too many special-token strings")
            swapped.append(match.group(0))
            return chr(_SENTINEL_FIRST + len(swapped) - 1)

        def content_text(content):
            if isinstance(content, list):
                return "".join(p if isinstance(p, Control) else self._forgeable_re.sub(swap, p) for p in content)
            if isinstance(content, str):
                return self._forgeable_re.sub(swap, content)
            return content

        def protect(value):  # every string a client wrote: tool names, descriptions, schemas, call arguments
            if isinstance(value, str):
                return self._forgeable_re.sub(swap, value)
            if isinstance(value, dict):
                return {protect(k): protect(v) for k, v in value.items()}  # keys too: call arguments, properties
            if isinstance(value, list):
                return [protect(v) for v in value]
            return value

        safe = [{k: (content_text(v) if k == "content" else v if k == "role" else protect(v)) for k, v in m.items()}
                for m in messages]
        if kwargs.get("tools"):
            kwargs = {**kwargs, "tools": protect(kwargs["tools"])}
        rendered = self.render_chat(safe, add_generation_prompt, enable_thinking, **kwargs)
        if not swapped:
            return self.encode(rendered)
        # Split at the template's special tokens (and the controls); encode the text between as plain text.
        pieces, ids_at = [], []
        last = 0
        for m in self._special_re.finditer(rendered) if self._special_re else ():
            pieces.append(rendered[last : m.start()])
            ids_at.append(self.token_id(m.group(0)))
            last = m.end()
        pieces.append(rendered[last:])

        def unswap(text: str) -> str:
            def back(c: re.Match) -> str:
                k = ord(c.group(0)) - _SENTINEL_FIRST
                return swapped[k] if k < len(swapped) else c.group(0)

            return re.sub(_SENTINELS, back, text)

        texts = self._encode_plain([unswap(p) for p in pieces])
        out: list[int] = []
        for k, t in enumerate(texts):
            out += t
            if k < len(ids_at):
                out.append(ids_at[k])
        return out


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character its vocabulary writes it with."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _compile_template(source: str):
    """A jinja2 template compiled with the environment transformers uses for chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    # Templates come from downloaded checkpoints, so they run sandboxed and cannot mutate their inputs.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"the chat template has a syntax error (line {e.lineno}): {e.message}") from None


def _template_from_config(value) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (use "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return entry.get("template")
    return None


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"cannot read {file}: {e}") from None


def _read_json(file: Path) -> dict:
    """A JSON object from file, {} if the file is absent. A damaged file is an error, not silently ignored."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(_read_text(file))
    except json.JSONDecodeError as e:
        raise ModelError(f"cannot read {file}: {e}") from None
    return value if isinstance(value, dict) else {}
