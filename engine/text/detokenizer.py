"""Incremental detokenization: a growing list of output token ids -> text deltas.

Decoding one token at a time is wrong in two ways: a byte-level BPE token may
hold only part of a UTF-8 character, and sentencepiece-style decoders drop the
leading space of whichever token comes first. So every step decodes a short
window of ids and emits the part of its text beyond what was already settled:

    ids:   [ ...emitted... | context       | pending           ]
                           ^prefix_offset  ^read_offset        ^len(ids)
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]   once new_text is longer than
                                                prefix_text and does not end in U+FFFD

The context tokens (already emitted, or the last few prompt tokens before the
first output token) keep the decoder's view of the pending tokens the same as in
a decode of the whole sequence. After a delta, `prefix_offset` moves to the old
`read_offset` and `read_offset` to the end, so the window stays a few tokens long
and the cost per token does not grow with the output.

Guarantee. Let text(ids) = tokenizer.decode(ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False), P the prompt ids and O the output ids. For
any chunking of O over `add_tokens` calls,

    "".join(deltas) + flush() == text(P + O)[len(text(P)):]

whenever text(P) is a prefix of text(P + O) (the prompt does not end inside a
character that the output completes) and, for sentencepiece byte fallback, every
maximal run of byte tokens (`<0xE4><0xB8><0xAD>`) is valid UTF-8, except that the
output's last run may be a lone unfinished character. This covers the decoders of
LLM tokenizers, which see a token only through its bytes, neighbouring byte tokens
and whether it comes first: ByteLevel (GPT-2, Llama-3, Qwen, SmolLM: UTF-8
decoding resynchronises, so any O qualifies), Metaspace and
Replace/ByteFallback/Fuse/Strip (Llama-2, Mistral). Where decoding
is not prefix-stable in this way (the prompt ends inside a character the output
completes, or a byte-fallback run turns invalid after some of its characters were
emitted, so that the decoder now prints U+FFFD for every byte of the run), the
stream keeps what it emitted and decodes the pending tokens on their own:
`<0xE4><0xB8><0xAD><0x80>` streams "中\ufffd" where the decoder prints four U+FFFD.
(Holding back every open byte run would avoid this, but would stall the stream for
as long as a model spells text in bytes: CJK on Llama-2, even newlines `<0x0A>`.)

Cost per token: one decode of the window (context + pending tokens, usually 2-8
tokens) and, when text is settled, one decode of the next context. Pending tokens
pile up only while the decoded text keeps ending in U+FFFD.

Two paths run this algorithm on the same window. A tokenizer with a Rust
backend (every `PreTrainedTokenizerFast`) steps a `tokenizers.decoders.DecodeStream`,
the same loop in Rust (what TGI and vLLM use), and this class only mirrors the
window's ids: ~1.1 us per token on SmolLM2's tokenizer where the Python loop takes
~1.9 us. The Python loop (`_settle`) serves every other tokenizer, and takes over a
fast tokenizer's window, for the rest of the output, where DecodeStream would go
wrong: the prompt context decodes ending in U+FFFD (DecodeStream would emit the
context's text too), the decoder rewrites settled text (DecodeStream raises
"Invalid prefix"), and `flush` (DecodeStream has no end-of-output call).

`spaces_between_special_tokens` is passed to `tokenizer.decode` for tokenizers
without a Rust backend; the Rust decoders have no such option and ignore it, as
transformers' fast tokenizers do.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import transformers
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
MIN_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token
MAX_PROMPT_CONTEXT = 24  # longest prompt suffix tried when looking for a clean start
_TRIM_AT = 256  # drop emitted ids from the window buffer once this many pile up

DecodeFn = Callable[[list[int]], str]


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Feed output ids with `add_tokens` (any chunking gives the same total text);
    each call returns the newly settled text, possibly "". At the end, `flush`
    releases text still held back (an unfinished UTF-8 character, decoded with
    U+FFFD). See the module docstring for the exact guarantee.
    """

    __slots__ = (
        "_decode",
        "_backend",
        "_stream",
        "_ids",
        "_prefix_offset",
        "_read_offset",
        "_prefix_text",
        "_parts",
        "_text",
    )

    def __init__(
        self,
        tokenizer: transformers.PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self._decode = make_decode_fn(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        context, context_text = prompt_context(self._decode, prompt_token_ids)
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text  # kept by the Python loop only (stale in stream mode)
        self._parts: list[str] = []
        self._text = ""
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Optional[DecodeStream] = None
        if self._backend is not None and not context_text.endswith(REPLACEMENT_CHAR):
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    @property
    def output_text(self) -> str:
        """All text settled so far (the concatenation of every returned delta)."""
        if self._parts:
            self._text += "".join(self._parts)
            self._parts.clear()
        return self._text

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append output ids; return the text they settle (may be "")."""
        deltas = []
        ids = self._ids
        for token_id in new_token_ids:
            ids.append(token_id)
            delta = self._step(token_id) if self._stream is not None else self._settle(final=False)
            if delta:
                deltas.append(delta)
        return "".join(deltas)

    def flush(self) -> str:
        """At the end of the output: release any held-back text, U+FFFD for unfinished bytes."""
        if self._read_offset == len(self._ids):
            return ""
        self._leave_stream()
        return self._settle(final=True)

    def _step(self, token_id: int) -> str:
        """Stream mode: DecodeStream settles the window; `_ids` mirrors it (context, then pending ids)."""
        assert self._stream is not None and self._backend is not None  # stream mode: made from the backend
        try:
            delta = self._stream.step(self._backend, token_id)
        except Exception:  # "Invalid prefix": a real decode error recurs in the Python loop's own decode
            self._leave_stream()
            return self._settle(final=False)
        if delta is None:
            return ""
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._parts.append(delta)
        return delta

    def _leave_stream(self) -> None:
        """Hand the window over to the Python loop (for the rest of this output)."""
        if self._stream is not None:
            self._stream = None
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])

    def _settle(self, final: bool) -> str:
        """Python loop: emit the window's text beyond the settled prefix, if it is ready (or `final`)."""
        ids = self._ids
        if self._read_offset == len(ids):
            return ""
        new_text = self._decode(ids[self._prefix_offset :])
        if new_text.startswith(self._prefix_text):
            delta = new_text[len(self._prefix_text) :]
        else:  # the decoder rewrote settled text: decode the pending tokens on their own
            delta = self._decode(ids[self._read_offset :])
        if not delta or (not final and delta[-1] == REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_text = self._decode(ids[self._prefix_offset :])
        if self._prefix_offset >= _TRIM_AT:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._parts.append(delta)
        return delta


def make_decode_fn(
    tokenizer: transformers.PreTrainedTokenizerBase,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> DecodeFn:
    """ids -> text as `tokenizer.decode` with clean_up_tokenization_spaces=False.

    A Rust-backed tokenizer is called directly (what `PreTrainedTokenizerFast.decode`
    does, minus its Python overhead); any other goes through `tokenizer.decode`.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend_decode = backend.decode
        return lambda ids: backend_decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False,
    )


def prompt_context(decode: DecodeFn, prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
    """The prompt suffix to decode the first output tokens after, and its text.

    The shortest suffix of at least MIN_PROMPT_CONTEXT tokens whose text is non-empty
    (so a sentencepiece decoder does not treat the first output token as the start of
    the text) and does not start with U+FFFD (so it does not start inside a character
    or a byte-fallback run); the last MAX_PROMPT_CONTEXT tokens if none qualifies.
    """
    n = len(prompt_token_ids)
    longest = min(n, MAX_PROMPT_CONTEXT)
    suffix: list[int] = []
    text = ""
    for length in range(min(MIN_PROMPT_CONTEXT, n), longest + 1):
        suffix = list(prompt_token_ids[n - length :])
        text = decode(suffix)
        if text and text[0] != REPLACEMENT_CHAR:
            break
    return suffix, text
