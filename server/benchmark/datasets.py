"""The benchmark's requests: prompts of known token length and the output length each asks for.

Prompts are text (every OpenAI-compatible server takes text; not all take token ids), made from the
served model's tokenizer so that their length is exact: random token ids are decoded, the text is
encoded again, and ids are added or dropped until the text encodes to exactly the asked length
(decoding and encoding do not round-trip token for token).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from engine.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens of `prompt`, by the tokenizer the benchmark was given
    output_len: int  # max_tokens


def _ordinary_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of ordinary tokens that decode to whole characters on their own (no special or added tokens, no
    byte pieces of a multi-byte character), from which random prompts are drawn."""
    special = set(tokenizer.hf.all_special_ids) | set(tokenizer.hf.get_added_vocab().values())
    return [
        i
        for i in range(tokenizer.vocab_size)
        if i not in special and "\ufffd" not in tokenizer.decode([i], skip_special_tokens=False)
    ]


def text_of_length(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    length: int,
    pool: Sequence[int],
    rng: random.Random,
    max_rounds: int = 200,
) -> tuple[str, int]:
    """Text that encodes (without special tokens) to `length` tokens, from the ids of `pool` given: while
    the decoded text encodes longer, the last id is dropped; while shorter, a random one is added. The
    text and its length (== length unless no text of that exact length was found in `max_rounds`)."""
    ids = list(ids)
    best = None
    for _ in range(max_rounds):
        text = tokenizer.decode(ids)
        encoded = len(tokenizer.encode(text, add_special_tokens=False))
        if encoded == length:
            return text, length
        if best is None or abs(encoded - length) < abs(best[1] - length):
            best = (text, encoded)
        if encoded > length and len(ids) > 1:
            ids.pop()
        else:
            ids.append(rng.choice(pool))
    assert best is not None  # the loop ran at least once
    return best


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)] (at least 1)."""
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, max(low, high)))


def random_requests(
    tokenizer: Tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[BenchRequest]:
    """`num` prompts of random tokens, lengths uniform around input_len / output_len (range_ratio 0: exact)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    pool = _ordinary_ids(tokenizer)
    requests = []
    for _ in range(num):
        length = _lengths(rng, input_len, range_ratio)
        text, actual = text_of_length(tokenizer, [rng.choice(pool) for _ in range(length)], length, pool, rng)
        requests.append(BenchRequest(text, actual, _lengths(rng, output_len, range_ratio)))
    return requests


def prefix_shared_requests(
    tokenizer: Tokenizer, num: int, prefix_len: int, suffix_len: int, output_len: int, seed: int = 0
) -> list[BenchRequest]:
    """`num` prompts sharing one random `prefix_len`-token prefix, each with its own random suffix (what a
    prefix cache serves: a long system prompt, few-shot examples, a shared document)."""
    rng = random.Random(seed)
    pool = _ordinary_ids(tokenizer)
    prefix, prefix_actual = text_of_length(
        tokenizer, [rng.choice(pool) for _ in range(prefix_len)], prefix_len, pool, rng
    )
    requests = []
    for _ in range(num):
        suffix, _ = text_of_length(tokenizer, [rng.choice(pool) for _ in range(suffix_len)], suffix_len, pool, rng)
        text = prefix + " " + suffix
        requests.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), output_len))
    return requests


def sharegpt_requests(
    path: Path, tokenizer: Tokenizer, num: int, output_len: Optional[int] = None, seed: int = 0
) -> list[BenchRequest]:
    """From a ShareGPT JSON file (a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
    ...}]}): each conversation's first turn is the prompt, the reply's token length the output length
    (unless `output_len` is given), as vLLM samples it; conversations shuffled by `seed`."""
    data = json.loads(Path(path).read_text())
    conversations = [c.get("conversations") or c.get("conversation") or [] for c in data]
    pairs = [(c[0]["value"], c[1]["value"]) for c in conversations if len(c) >= 2]
    random.Random(seed).shuffle(pairs)
    requests: list = []
    for prompt, reply in pairs:
        if len(requests) == num:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        reply_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 4 or reply_len < 4:  # vLLM drops these too
            continue
        requests.append(BenchRequest(prompt, prompt_len, reply_len))
    return _enough(requests, num, path)


def jsonl_requests(path: Path, tokenizer: Tokenizer, num: int, output_len: Optional[int] = None) -> list[BenchRequest]:
    """From a JSONL file of {"prompt": str, "output_len": int (optional)} lines, in order."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompt = record["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f'{path}:{number}: expected {{"prompt": ..., "output_len": ...}} ({exc})') from None
        length = output_len or int(record.get("output_len", 128))
        requests.append(BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), length))
        if len(requests) == num:
            break
    return _enough(requests, num, path)


def _enough(requests: list[BenchRequest], num: int, path: Path) -> list[BenchRequest]:
    if not requests:
        raise ValueError(f"{path}: no usable prompts")
    found = len(requests)
    while len(requests) < num:  # fewer in the file than asked: cycle through them
        requests.append(requests[len(requests) % found])
    return requests
