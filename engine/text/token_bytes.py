"""A token's own bytes, as OpenAI's logprobs `bytes` give them: what the token adds to the UTF-8 text, also when
that is only part of a character (a byte-level token of an emoji decodes alone to U+FFFD, whose bytes say
nothing of the character; the raw bytes of consecutive tokens join into it).

Read from the token's vocabulary entry through the tokenizer's decoder: ByteLevel (GPT-2, Llama-3, Qwen,
SmolLM) spells each byte as one printable character; sentencepiece with byte fallback (Llama-2, Mistral,
Gemma) spells a lone byte `<0xE4>` and a space `▁`. Added and special tokens, and other decoders, have no
reader: their decoded text stands.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokenBytes = Callable[[int], Optional[bytes]]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """The character GPT-2's byte-level BPE writes for each byte -> that byte: printable Latin-1 bytes stand
    for themselves, the others (controls, space, ...) take the code points from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(printable)
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in kept:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


def token_bytes_reader(hf: "PreTrainedTokenizerBase") -> Optional[TokenBytes]:
    """A function from a token id to its raw bytes (None for a token it cannot read), or None for a tokenizer
    whose decoder is neither byte-level nor sentencepiece with byte fallback."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return None
    decoder, id_to_token = backend.decoder, backend.id_to_token
    spec = json.loads(decoder.__getstate__())
    kinds = {part["type"] for part in (spec.get("decoders") or [spec])}
    added = set(getattr(hf, "added_tokens_decoder", {}) or {})
    if "ByteLevel" in kinds:
        alphabet = byte_level_alphabet()

        def byte_level(token_id: int) -> Optional[bytes]:
            piece = None if token_id in added else id_to_token(token_id)
            if piece is None or any(c not in alphabet for c in piece):
                return None
            return bytes(alphabet[c] for c in piece)

        return byte_level
    if "ByteFallback" in kinds:

        def byte_fallback(token_id: int) -> Optional[bytes]:
            piece = None if token_id in added else id_to_token(token_id)
            if piece is None:
                return None
            match = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode("utf-8")

        return byte_fallback
    return None
