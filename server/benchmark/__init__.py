"""`pagedserve bench serve`: load against any OpenAI-compatible server, measured as vLLM's `bench serve` does.

datasets.py  the prompts (random, prefix-shared, ShareGPT, JSONL), with exact token lengths
client.py    one streamed request, timed chunk by chunk
metrics.py   TTFT, TPOT, ITL, E2E latency, throughputs and goodput from the timed requests
serve.py     the command: arrivals, concurrency, progress, the table and the JSON
"""
