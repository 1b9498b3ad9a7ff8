"""The HTTP layer: OpenAI-, Anthropic- and vLLM-compatible routes over one in-process `LLM`.

`pocketjax.serve.http` may import the in-process serving modules (`pocketjax.serve.*`), never the reverse: the
scheduler, handles and LLM serve Python callers without FastAPI (`tests/test_layout.py` enforces it).
"""
