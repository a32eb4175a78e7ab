"""scripts/replay_policy.py: scoring auto against recorded greedy text on a virtual clock."""

import importlib.util
import time
from pathlib import Path

import numpy as np

from specllm.engine import auto, decode, drafters
from specllm.engine.costmodel import CostModel

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "replay_policy.py"


def _load():
    spec = importlib.util.spec_from_file_location("replay_policy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _streams(prompt, generated, category):
    return {"eog": 999, "max_tokens": len(generated), "streams": [
        {"id": "1", "category": category, "prompt": prompt, "tokens": generated, "stopped": False}]}


def test_a_copy_is_drafted_and_costs_less_than_plain_decoding():
    replay = _load()
    source = [(i * 7) % 97 + 3 for i in range(120)]  # no repeated bigrams: every match is unique
    data = _streams(source, source[:100], "copy")  # the answer repeats the prompt
    flat = CostModel({k: 0.010 + 0.0002 * k for k in (1, 2, 4, 8, 16, 32)})
    figures = replay.simulate(data, flat, draft_max=31)["copy"]
    assert figures["prompts"] == 1 and figures["auto"] < figures["plain"] / 2  # the replay also checks the text equals the recording
    assert figures["ngram_oracle"] <= figures["auto"] and figures["oracle"] <= figures["ngram_oracle"] + 1e-12
    assert decode.time is time and auto.time is time and drafters.time is time  # the virtual clock is put back


def test_text_full_of_chance_matches_on_a_steep_curve_costs_what_plain_decoding_costs():
    """Random tokens from 8 symbols: n-gram matches everywhere, continuations by chance. On a CPU-like
    curve no draft pays, and the policy must not lose more than 1% finding that out."""
    replay = _load()
    rng = np.random.default_rng(0)
    prompt, generated = [int(t) for t in rng.integers(3, 11, 60)], [int(t) for t in rng.integers(3, 11, 120)]
    steep = CostModel({1: 0.03, 2: 0.057, 4: 0.1, 8: 0.22, 16: 0.28, 32: 0.45})
    figures = replay.simulate(_streams(prompt, generated, "chance"), steep, draft_max=31)["chance"]
    assert figures["auto"] <= 1.01 * figures["plain"]
    assert figures["oracle"] < figures["plain"]  # some chance matches were right: a policy that knew could have gained
