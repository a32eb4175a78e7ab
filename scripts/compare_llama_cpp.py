"""Plain decoding speed: specllm's `--spec off` path against llama-cpp-python's own
`Llama.create_completion`, same model, same prompt tokens, greedy, in the same process.

    python scripts/compare_llama_cpp.py [-m PRESET_OR_PATH] [-n 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from script_inputs import at_least  # beside this script: on the path when it runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    # at least 1: llama-cpp-python reads max_tokens 0 as "until the context is full"
    parser.add_argument("-n", type=at_least(1), default=128)
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("-p", "--prompt", default="Write a Python function that parses an ISO 8601 date string.")
    args = parser.parse_args()

    import llama_cpp

    from specllm.backend import LoadOptions, buffers_left_out
    from specllm.engine.decode import Done
    from specllm.engine.sampling import SamplingParams
    from specllm.errors import SpecllmError
    from specllm.models.store import resolve_model
    from specllm.session import Engine, ModelPaths, SpecConfig

    try:
        path = resolve_model(args.model)
        engine = Engine(ModelPaths(path), SpecConfig("off"), LoadOptions(n_ctx=2048), LoadOptions())
    except SpecllmError as error:
        raise SystemExit(f"Error: {error}") from None
    tokens = engine.encode(args.prompt)
    if buffers_left_out() == "extra":  # the weights' buffers as specllm loads them (llama.cpp's AMX kernels crash)
        default_params = llama_cpp.llama_cpp.llama_model_default_params

        def without_extra_buffers():
            params = default_params()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
    llama = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=engine.target.n_threads, n_batch=512, verbose=False)

    ours, theirs = [], []
    for _ in range(args.rounds):  # interleaved, so drift hits both alike
        started = time.perf_counter()
        out = llama.create_completion(tokens, max_tokens=args.n, temperature=0.0, top_k=1)
        n = out["usage"]["completion_tokens"]
        theirs.append(n / (time.perf_counter() - started))
        llama.reset()
        decoder = engine.decoder("off")
        started = time.perf_counter()
        for event in decoder.generate(tokens, args.n, SamplingParams(temperature=0.0), np.random.default_rng(0)):
            if isinstance(event, Done):
                ours.append(len(event.tokens) / (time.perf_counter() - started))
    print(f"prompt {len(tokens)} tokens, {args.n} new tokens, {args.rounds} rounds (prefill included in both)")
    print(f"llama-cpp-python create_completion: {np.median(theirs):.2f} tok/s  (rounds: {', '.join(f'{x:.2f}' for x in theirs)})")
    print(f"specllm --spec off:                 {np.median(ours):.2f} tok/s  (rounds: {', '.join(f'{x:.2f}' for x in ours)})")
    print(f"ratio specllm / llama-cpp-python:   {np.median(ours) / np.median(theirs):.3f}")


if __name__ == "__main__":
    main()
