"""A GGUF's own tokenizer (`tokenizer.ggml.*`, `tokenizer.chat_template`) as a `tokenizers` Tokenizer, for a file with
no tokenizer.json beside it.

The `diffusion-gemma` converter writes Gemma 4's tokenizer as model `gemma4`: every token by id (`tokens`), its kind
(`token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 a byte `<0xXX>`), the BPE `merges` ("a b"),
the control ids (`bos_token_id`, `eos_token_id`, `unknown_token_id`, `padding_token_id`) and `add_space_prefix`
(false). That is a SentencePiece-style BPE over pieces that keep their word's "▁": rebuilt here as Gemma's
tokenizer.json has it (a space is "▁" before BPE, words split before their "▁", unknown characters spelled as their
UTF-8 byte tokens, control and unused tokens matched whole and skipped on decode). `agrees` compares two tokenizers
on a text corpus: where a file's metadata and a tokenizer.json both exist, `dgemma doctor` checks them against each
other. Another tokenizer model (`llama`, `gpt2`, ...) is not rebuilt: None.
"""

from __future__ import annotations

MODELS = ("gemma4",)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# texts the check encodes with both tokenizers: prose, code, numbers, other scripts, emoji (byte fallback), spaces,
# and control tokens written in the text
CORPUS = (
    "Why is the sky blue? Sunlight is scattered by the air.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))",
    "  leading spaces, trailing spaces  , tabs\tand\nnewlines\n",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3;",
    "Traduis en français : le café est très bon. Ünïcödé, 日本語のテキスト, العربية, emoji 🙂🚀.",
    "<bos><|turn>user\nhello<turn|>\n<|turn>model\n",
    "1234567890 3.14159 -2e-10 0x1F #$%^&*()[]{}<>~`|\\/",
)


def tokenizer_from_metadata(metadata: dict, origin: str):
    """dgemma's Tokenizer (dgemma_cli/tokenizer.py) from a GGUF's metadata, or None when it holds no tokenizer of a
    model rebuilt here. `origin` names the file (said where its chat template does not compile)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from ..tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer

    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if metadata.get("tokenizer.ggml.model") not in MODELS or tokens is None or merges is None:
        return None
    tokens = list(tokens)
    types = metadata.get("tokenizer.ggml.token_type")  # a list, or a numpy array for a real vocabulary's length
    types = [NORMAL] * len(tokens) if types is None else [int(k) for k in types]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]

    def named(key: str, default: int | None) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}", default)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    unk = named("unknown_token_id", None)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, byte_fallback=True))
    space = [normalizers.Prepend("▁")] if metadata.get("tokenizer.ggml.add_space_prefix") else []
    hf.normalizer = normalizers.Sequence([*space, normalizers.Replace(" ", "▁")])
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("▁"), behavior="merged_with_next")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = [t for t, k in zip(tokens, types) if int(k) in (CONTROL, USER_DEFINED, UNUSED, UNKNOWN)]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    names = {"bos_token": named("bos_token_id", None), "eos_token": named("eos_token_id", None),
             "pad_token": named("padding_token_id", None), "unk_token": unk,
             "mask_token": named("mask_token_id", None)}
    template = metadata.get("tokenizer.chat_template")
    chat, where = (template, f"{origin} (tokenizer.chat_template)") if isinstance(template, str) and template else \
        (FALLBACK_CHAT_TEMPLATE, "the built-in chat template")
    return Tokenizer(hf, chat, {k: v for k, v in names.items() if v is not None}, template_origin=where)


def agrees(ours, reference, corpus=CORPUS) -> str | None:
    """None when two dgemma Tokenizers give the same ids for every text of `corpus` (and the same text back), else
    what differs first."""
    for text in corpus:
        a, b = ours.encode(text), reference.encode(text)
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"{text[:40]!r}: ids differ from token {at} ({a[at:at + 4]} against {b[at:at + 4]})"
        if ours.decode(a) != reference.decode(b):
            return f"{text[:40]!r}: decodes differently"
    return None
