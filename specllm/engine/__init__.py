"""The lossless engine: sampling, verification, drafters, the cost-aware policy and the decode loop.

No I/O, no terminal, no network: it talks to models through `protocol.Backend` and reports through
the events of `decode`. Nothing here imports from the rest of specllm but `specllm.errors`.
"""
