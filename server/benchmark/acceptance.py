"""Speculative decoding's acceptance over a benchmark run, from the server's counters before and after it.

pagedserve's `pagedserve_spec_decode_*_total` and vLLM's `vllm:spec_decode_*_total` counters are read from
`/metrics`; a server that exposes neither (no speculation, or another server) gives None.
"""

from __future__ import annotations

from typing import Optional

import httpx

PREFIXES = ("pagedserve_spec_decode_", "vllm:spec_decode_")
COUNTERS = ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total")


def spec_decode_counts(base_url: str, api_key: Optional[str]) -> Optional[dict[str, float]]:
    """The server's draft counters summed over their labels, or None when it has none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=30)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    counts: dict[str, float] = {}
    for line in response.text.splitlines():
        for prefix in PREFIXES:
            if line.startswith(prefix):
                name = line[len(prefix) :].split("{")[0].split(" ")[0]
                if name in COUNTERS:
                    counts[name] = counts.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts if len(counts) == len(COUNTERS) else None


def acceptance(before: Optional[dict[str, float]], after: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
    """The run's mean acceptance length (tokens per drafted step: accepted drafts + 1) and acceptance rate."""
    if before is None or after is None:
        return None
    drafts = after["num_drafts_total"] - before["num_drafts_total"]
    drafted = after["num_draft_tokens_total"] - before["num_draft_tokens_total"]
    accepted = after["num_accepted_tokens_total"] - before["num_accepted_tokens_total"]
    if drafts <= 0:
        return None
    return {
        "mean_acceptance_length": 1 + accepted / drafts,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "num_drafts": drafts,
    }
