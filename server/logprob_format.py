"""Engine logprobs in OpenAI's two response formats (completions and chat)."""

from __future__ import annotations

from typing import Optional, Sequence

from engine.sampler import TokenLogprobs
from engine.tokenizer import Tokenizer
from server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class LogprobFormatter:
    """Token strings are each token decoded alone (special tokens shown), memoised per id."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def completion(self, entries: Sequence[Optional[TokenLogprobs]], token_ids: Sequence[int],
                   num_top: int, text_offset: int = 0) -> CompletionLogprobs:
        """`entries[i]` scores `token_ids[i]`; None (the first prompt token) scores nothing."""
        out = CompletionLogprobs()
        offset = text_offset
        for entry, token_id in zip(entries, token_ids):
            token = self.token_text(token_id)
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
                top.setdefault(self.token_text(t), lp)
            top[token] = entry.logprob  # the sampled token's own value, as token_logprobs says
            out.top_logprobs.append(top)
        return out

    def chat(self, entries: Sequence[TokenLogprobs], num_top: int) -> ChatLogprobs:
        content = []
        for entry in entries:
            token = self.token_text(entry.token_id)
            content.append(ChatTokenLogprob(
                token=token,
                logprob=entry.logprob,
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=self.token_text(t), logprob=lp, bytes=list(self.token_text(t).encode("utf-8")))
                    for t, lp in entry.top[:num_top]
                ],
            ))
        return ChatLogprobs(content=content)
