"""Stoker's engine: one process serving one snapshot over vLLM's OpenAI-compatible HTTP surface.

It exists for machines without a GPU (development, tests, the embedded default model; the platform
runs it as the "cpu" engine) and runs on a CUDA GPU too (`--device`), by the same code. It speaks
exactly what the platform expects of vLLM: the OpenAI routes, `/health`, `/metrics` with vLLM's
metric names, and `/sleep`, `/wake_up`, `/is_sleeping`. Generation is transformers' continuous
batching; this package adds admission, streaming, stop strings, sleep and metrics around it, and a
per-request draw step inside it (`draw.py`) for what OpenAI's API asks per request and transformers
does not give: greedy or seeded draws, penalties, `logit_bias`, `min_tokens`, `top_k`, logprobs
(`logprobs.py`) and structured output (`structured.py`). `protocol.py` says what is honoured and
what is refused.
"""
