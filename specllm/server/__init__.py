"""The OpenAI-compatible HTTP layer over the same engine (`specllm serve`); no decoding logic of its own.

Needs the `server` extra (starlette, uvicorn): `pip install ".[server]"` in the checkout.
"""
