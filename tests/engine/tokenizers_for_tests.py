"""Small real tokenizers trained in memory (no network, well under a second each).

- `make_byte_level_tokenizer()`: GPT-2 / Llama-3 style byte-level BPE. Its base
  alphabet is the 256 bytes, so an accented letter, a CJK character or an emoji
  is often spread over several tokens.
- `make_sentencepiece_tokenizer()`: Llama-2 style: "▁" marks word starts, BPE with
  byte fallback (`<0x00>`..`<0xFF>` stand for raw UTF-8 bytes of characters the
  vocabulary lacks), and the decoder Replace("▁", " ") -> ByteFallback -> Fuse ->
  Strip(one leading space).

Both come wrapped as `transformers.PreTrainedTokenizerFast`. Builders are pure:
cache them in a session-scoped fixture.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BYTE_LEVEL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SENTENCEPIECE_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a streaming test of the detokenizer!",
    "Stop strings end the generation; the rest is never shown.",
    "Numbers like 12345 and 3.14159 appear in text, as do URLs: https://example.com/a?b=c.",
    "def add(a, b):\n    return a + b\n",
    "Café au lait, naïve façade, crème brûlée, Ångström, São Paulo, Łódź, Straße.",
    "Über, smörgåsbord, jalapeño, déjà vu, coöperate, résumé.",
    "中文分词很难。我喜欢吃饺子和面条。今天天气很好。",
    "日本語のテキストも少しあります。こんにちは世界。",
    "한국어 문장도 있습니다. 안녕하세요 세계.",
    "Emoji: 😀 😃 😄 👍 👍🏽 🎉 🚀 ❤️ 🇫🇷 👨‍👩‍👧 and more 🙂.",
    "Mixed: naïve 中文 😀 café 日本 🎉 résumé 한국 👍🏽 end.",
)


def training_corpus() -> list[str]:
    """The text both tokenizers are trained on (also handy as test input)."""
    return list(_SENTENCES) * 4


def make_byte_level_tokenizer(vocab_size: int = 340) -> PreTrainedTokenizerFast:
    """Byte-level BPE with three special tokens; ids 0..2 are the specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BYTE_LEVEL_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=list(BYTE_LEVEL_SPECIAL_TOKENS[1:]),
        clean_up_tokenization_spaces=False,
    )


def make_sentencepiece_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """Llama-2 style BPE: specials 0..2, byte pieces 3..258, then learned pieces."""
    pieces = _train_metaspace_pieces(vocab_size)
    vocab: dict[str, int] = {}
    for token in SENTENCEPIECE_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in pieces["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in pieces["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def _train_metaspace_pieces(vocab_size: int) -> dict:
    """Learn pieces from the Latin-1 part of the corpus: CJK and emoji need byte fallback."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    latin = ["".join(ch for ch in line if ord(ch) < 0x100) for line in training_corpus()]
    tok.train_from_iterator(latin, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    ordered = sorted(model["vocab"], key=model["vocab"].__getitem__)
    return {"vocab": ordered, "merges": model["merges"]}


def byte_level_ids(tokenizer: PreTrainedTokenizerFast, data: bytes) -> list[int]:
    """One base token per byte of `data` in a byte-level vocabulary (GPT-2's byte alphabet)."""
    alphabet = _gpt2_byte_alphabet()
    return [tokenizer.convert_tokens_to_ids(alphabet[b]) for b in data]


def byte_fallback_ids(tokenizer: PreTrainedTokenizerFast, data: bytes) -> list[int]:
    """One `<0x..>` token per byte of `data` in a byte-fallback vocabulary."""
    return [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in data]


def partial_character_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids whose text alone is not valid UTF-8 (a piece of a multi-byte character)."""
    return [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]


def _gpt2_byte_alphabet() -> list[str]:
    """byte -> the printable character standing for it in byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
