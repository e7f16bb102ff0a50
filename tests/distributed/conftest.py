from tests.reliability.conftest import tiny_model_dir  # noqa: F401 - the session's tiny Llama (4 heads, 2 KV)
