"""HTTP: the OpenAI-compatible FastAPI server, metrics and the `pagedserve` CLI."""
