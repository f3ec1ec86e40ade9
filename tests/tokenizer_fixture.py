"""A small but real Gemma-4-style tokenizer, built in a temporary directory for tests.

The files look like a model repository's: `tokenizer.json` (a `tokenizers` BPE with byte fallback, trained
here on a few lines of English and code), `tokenizer_config.json` and, optionally, `chat_template.jinja`.
Gemma 4's control tokens sit at their real ids, and the vocabulary has exactly the size asked for, so a
tiny test model's embedding table can match it.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Control tokens at the ids the real checkpoints use; every other id below FIRST_FREE_ID is a placeholder.
CONTROL_TOKENS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
FIRST_FREE_ID = 107

# A Gemma-4-style template written the way shipped templates are (namespace, role checks, `is defined`).
# It renders exactly what the built-in fallback in dgemma_cli.tokenizer renders.
CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- set ns = namespace(has_system=false) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set ns.has_system = true -%}
{%- endif -%}
{%- if enable_thinking is defined and enable_thinking and not ns.has_system -%}
    {{- '<|turn>system\\n<|think|><turn|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = 'model' -%}
    {%- elif message['role'] in ['system', 'user', 'model'] -%}
        {%- set role = message['role'] -%}
    {%- else -%}
        {{- raise_exception('Unknown role: ' + message['role']) -}}
    {%- endif -%}
    {{- '<|turn>' + role + '\\n' -}}
    {%- if loop.first and role == 'system' and enable_thinking is defined and enable_thinking -%}
        {{- '<|think|>' -}}
    {%- endif -%}
    {{- message['content'] -}}
    {{- '<turn|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\\n' -}}
{%- endif -%}
"""

# Enough text for BPE to learn common English and Python pieces; kept short so training takes milliseconds.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered the most.",
    "A diffusion model starts from a canvas of masked tokens and fills it in over several steps.",
    "Please write a short poem about the sea, the wind and the stars at night.",
    "You are a helpful assistant. Answer the question in one sentence.",
    "The answer is 42. Let me think about it step by step before I answer.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import json\n\nwith open('config.json') as f:\n    config = json.load(f)\n",
    "class Model:\n    def __init__(self, dim: int) -> None:\n        self.dim = dim\n",
    "if x > 0 and y < 0:\n    result = [x, y]\nelse:\n    result = {'x': x}\n",
    "int main(void) { printf(\"%d\\n\", 1 + 2); return 0; }",
    "SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name;",
    "1 2 3 4 5 6 7 8 9 0 # @ $ % ^ & ~ ` | \\ / ? ! ; : ' \"",
]


def build_tokenizer_files(directory, vocab_size: int = 512, with_template: bool = True) -> Path:
    """Write tokenizer.json, tokenizer_config.json and (if with_template) chat_template.jinja into directory.

    Returns the directory as a Path. Raises ValueError if vocab_size is too small to hold the control
    tokens, the 256 byte tokens and the corpus's characters.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    reserved = [CONTROL_TOKENS.get(i, f"<unused{i}>") for i in range(FIRST_FREE_ID)]
    # Byte fallback: a character missing from the vocabulary is spelled as its UTF-8 bytes, so any text
    # round-trips. These are ordinary (not special) tokens, as in the real tokenizer.
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    room = vocab_size - len(reserved) - len(byte_tokens)

    # Spaces become "▁" and each word keeps the "▁" in front of it, as SentencePiece-style tokenizers do.
    normalizer = normalizers.Replace(" ", "▁")
    pre_tokenizer = pre_tokenizers.Split(Regex("▁"), behavior="merged_with_next")

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizer
    trainer_tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=max(room, 1), show_progress=False, limit_alphabet=max(room, 1))
    trainer_tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    trained = json.loads(trainer_tokenizer.to_str())["model"]

    # Trained pieces come after the reserved and byte tokens, in the trainer's order.
    vocab = {token: i for i, token in enumerate(reserved + byte_tokens)}
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small: the fixture needs at least {len(vocab)}")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])

    # Control tokens and placeholders are special added tokens: matched whole in the input, skipped on decode.
    # They are already in the model's vocabulary, so they keep their ids; the tail padding gets the next ids.
    padding = [f"<unused{i}>" for i in range(len(vocab), vocab_size)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved + padding])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    tokenizer.save(str(directory / "tokenizer.json"))

    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if with_template:
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return directory
