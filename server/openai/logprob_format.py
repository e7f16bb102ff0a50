"""Engine logprobs in OpenAI's two response formats (completions and chat)."""

from __future__ import annotations

from typing import Optional, Sequence

from engine.sampling.sampler import TokenLogprobs
from engine.text.token_bytes import token_bytes_reader
from engine.text.tokenizer import Tokenizer
from server.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)


class LogprobFormatter:
    """Token strings are each token decoded alone (special tokens shown); their bytes the text's UTF-8, or the
    token's raw bytes where it holds part of a character (engine/text/token_bytes.py); memoised per id. With
    `as_ids` (vLLM's return_tokens_as_token_ids) a token's string is "token_id:<id>" instead, so that a client
    can tell apart tokens that decode alike (and its bytes that string's); `as_ids` None takes `default_as_ids`
    (--return-tokens-as-token-ids)."""

    def __init__(self, tokenizer: Tokenizer, default_as_ids: Optional[bool] = None):
        self._tokenizer = tokenizer
        self._default_as_ids = default_as_ids
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._raw_bytes = token_bytes_reader(tokenizer.hf)

    def token_text(self, token_id: int, as_ids: Optional[bool] = None) -> str:
        return self._token(token_id, as_ids)[0]

    def _token(self, token_id: int, as_ids: Optional[bool] = None) -> tuple[str, list[int]]:
        if as_ids if as_ids is not None else self._default_as_ids:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        entry = self._cache.get(token_id)
        if entry is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            data = text.encode("utf-8")
            if "\ufffd" in text and self._raw_bytes is not None:  # part of a character: the token's own bytes
                data = self._raw_bytes(token_id) or data
            entry = self._cache[token_id] = (text, list(data))
        return entry

    def completion(
        self,
        entries: Sequence[Optional[TokenLogprobs]],
        token_ids: Sequence[int],
        num_top: int,
        text_offset: int = 0,
        as_ids: Optional[bool] = None,
    ) -> CompletionLogprobs:
        """`entries[i]` scores `token_ids[i]`; None (the first prompt token) scores nothing."""
        out = CompletionLogprobs()
        offset = text_offset
        for entry, token_id in zip(entries, token_ids):
            token = self.token_text(token_id, as_ids)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            for t, lp in entry.top[:num_top]:  # best first: a text shared by several ids keeps its best
                top.setdefault(self.token_text(t, as_ids), lp)
            top[token] = entry.logprob  # the sampled token's own value, as token_logprobs says
            out.top_logprobs.append(top)
        return out

    def chat(self, entries: Sequence[TokenLogprobs], num_top: int, as_ids: Optional[bool] = None) -> ChatLogprobs:
        content = []
        for entry in entries:
            token, token_bytes = self._token(entry.token_id, as_ids)
            top = [(self._token(t, as_ids), lp) for t, lp in entry.top[:num_top]]
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=entry.logprob,
                    bytes=token_bytes,
                    top_logprobs=[TopLogprob(token=text, logprob=lp, bytes=data) for (text, data), lp in top],
                )
            )
        return ChatLogprobs(content=content)

    def prompt(
        self, entries: Sequence[Optional[TokenLogprobs]], num_top: int, as_ids: Optional[bool] = None
    ) -> PromptLogprobs:
        """vLLM's prompt_logprobs: per position (None where nothing scores it: the first) the prompt's own token with
        its logprob and rank, then the `num_top` best tokens, ranked 1, 2, ... (a token once, at its first place)."""
        out: PromptLogprobs = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            position = {
                entry.token_id: PromptLogprob(
                    logprob=entry.logprob, rank=entry.rank, decoded_token=self.token_text(entry.token_id, as_ids)
                )
            }
            for rank, (token_id, logprob) in enumerate(entry.top[:num_top], start=1):
                position.setdefault(
                    token_id,
                    PromptLogprob(logprob=logprob, rank=rank, decoded_token=self.token_text(token_id, as_ids)),
                )
            out.append(position)
        return out
