"""Lossless speculative decoding through llama.cpp.

(a) Temperature > 0 on a tiny GGUF pair (conftest.py's `compact_pair`: a vocabulary of 4096, so
    that thousands of samples take seconds): the sequences the speculative loop generates follow
    the target's exactly computed distribution (chi-square), for n-gram (one-hot q), draft
    model (partly agreeing q) and chained drafts.
(b) Temperature 0 on the default preset (Qwen2.5-Coder 1.5B / 0.5B): every strategy gives the
    tokens of plain decoding. A divergence reports the target's logit margin at that position.
(c) The vocabulary check between a target and a draft.
(d) `auto` loads the draft model when it first consults it, and gives plain decoding's text either way.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specllm.backend import LlamaBackend
from specllm.chat import encode_messages
from specllm.engine.auto import AutoDrafter
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import Decoder, Done, StepDone, fixed_budget, generate_plain
from specllm.engine.sampling import SamplingParams
from specllm.errors import SpecllmError
from specllm.session import Engine, ModelPaths, SpecConfig
from tests.conftest import DEFAULT_PAIR_COSTS
from tests.fakes import LogitsRecorder, Priced
from tests.lossless_helpers import TINY, make_drafter, repeating_prompt, sequence_distribution, tiny_models  # noqa: F401 - fixtures
from tests.stat_helpers import chi_square_pvalue
from tests.tiny_gguf import write_tiny_gguf

# -- (a) temperature > 0 on tiny models ---------------------------------------------------------


@pytest.mark.parametrize(
    "kind, length, top_k, samples",
    [("ngram", 2, 8, 2000), ("draft", 2, 8, 2000), ("draft", 3, 3, 1500), ("ngram+draft", 3, 3, 2000)],
)
def test_sampled_sequences_follow_the_target_distribution(tiny_models, repeating_prompt, kind, length, top_k, samples):
    target, draft, truth = tiny_models
    params = SamplingParams(temperature=1.5, top_k=top_k, top_p=1.0, min_p=0.0)
    expected = sequence_distribution(truth, repeating_prompt, length, params)
    decoder = Decoder(target, make_drafter(kind, draft, target.n_vocab), fixed_budget(4))
    rng = np.random.default_rng(1234)
    outcomes, steps = [], Counter()
    for _ in range(samples):
        for event in decoder.generate(repeating_prompt, length, params, rng):
            if isinstance(event, StepDone) and event.drafted:
                steps["all accepted" if event.accepted == event.drafted else "rejected"] += 1
            elif isinstance(event, Done):
                outcomes.append(tuple(event.tokens))
    assert steps["all accepted"] > samples // 20 and steps["rejected"] > samples // 20, steps
    pvalue = chi_square_pvalue(outcomes, expected)
    top = sorted(expected.items(), key=lambda kv: -kv[1])[:5]
    seen = Counter(outcomes)
    detail = ", ".join(f"{seq}: {seen[seq] / samples:.3f} vs {p:.3f}" for seq, p in top)
    assert pvalue > 1e-3, f"{kind}: generated sequences do not follow the target (p={pvalue:.2e}; {detail})"


# -- (b) temperature 0 on the default preset ----------------------------------------------------

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 48


# A code-edit row of ../shared/workloads/dev.jsonl (question_id 9005), copied so that the test does
# not depend on a file outside the repository: the reply copies the prompt, so the n-gram cache
# drafts long runs; and a free-form question, where the draft model does the drafting. Every
# strategy on both: ten generations of the 1.5B target (two plain) are a third of the full suite's
# time on 2 cores, so each claim is made once, on the text where its drafter works hardest
# (the tiny pair's 1200-token runs in test_long_runs.py cover more texts for every strategy).
PROMPTS = {
    "code-edit-rename": (
        "Rename the function to `splittype_v2` (update any recursive calls too). Keep everything else exactly "
        "the same and reply with the complete function only.\n\n```python\ndef _splittype(url):\n"
        "    \"\"\"splittype('type:opaquestring') --> 'type', 'opaquestring'.\"\"\"\n    global _typeprog\n"
        "    if _typeprog is None:\n        _typeprog = re.compile('([^/:]+):(.*)', re.DOTALL)\n\n"
        "    match = _typeprog.match(url)\n    if match:\n        scheme, data = match.groups()\n"
        "        return scheme.lower(), data\n    return None, url\n```"
    ),
    "free-history": "In three sentences, why did the Roman Empire split into east and west?",
}


def _plain(target: LlamaBackend, prompt: list[int], max_tokens: int) -> tuple[list[int], dict[int, np.ndarray]]:
    recorder = LogitsRecorder(target)
    return generate_plain(recorder, prompt, max_tokens, GREEDY, None), recorder.rows


@pytest.fixture(scope="module")
def plain_outputs():
    return {}  # prompt name -> (prompt tokens, plain tokens, their logits rows), filled on first use


@pytest.mark.real
@pytest.mark.parametrize("strategy", ["ngram", "draft", "ngram+draft", "auto"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_speculation_equals_plain_decoding(qwen_engine, plain_outputs, virtual_clock, name, strategy):
    target = qwen_engine.target
    if name not in plain_outputs:
        prompt = encode_messages(target, [{"role": "user", "content": PROMPTS[name]}])
        plain_outputs[name] = (prompt, *_plain(target, prompt, MAX_TOKENS))
    prompt, plain, plain_rows = plain_outputs[name]
    decoder = qwen_engine.decoder(strategy)
    # passes take the default pair's calibrated times on the clock `auto` reads, whatever else the machine runs
    decoder.target = recorder = LogitsRecorder(Priced(decoder.target, virtual_clock, DEFAULT_PAIR_COSTS.verify))
    if isinstance(decoder.drafter, AutoDrafter) and decoder.drafter.model is not None:
        decoder.drafter.model.model = Priced(decoder.drafter.model.model, virtual_clock, DEFAULT_PAIR_COSTS.catch_up)
    events = list(decoder.generate(prompt, MAX_TOKENS, GREEDY, np.random.default_rng(0)))
    spec = events[-1].tokens
    _check_greedy_path(target, prompt, spec, recorder.rows, plain, plain_rows, strategy)
    if strategy != "auto" or name == "code-edit-rename":  # on a CPU curve auto leaves free-form text to the target
        assert sum(e.accepted for e in events if isinstance(e, StepDone)) > 0, f"--spec {strategy}: no drafted token accepted"


# Batched evaluation of a quantized model takes other kernels than one-token evaluation (f16 flash
# attention, tests/logit_noise.py; quantized dot products whose float block sums run in another
# order), which can flip a near tie. Tolerances are in units of the row's standard deviation (~2 for
# Qwen2.5-Coder 1.5B), the logits' own scale, not absolute. Measured on the same context (Q4_K_M,
# CPU, AVX-512): the top-20 logits of the two paths differ by up to 0.19 std (0.37 absolute), while
# the row of a neighbouring position (a wrong row, position or KV entry) is 2.7 std or more away.
# A divergence passes only when both paths rank the two candidates within NEAR_TIE of each other and
# their top-20 logits agree to ROW_NOISE (4 times the noise seen, under a third of the nearest wrong
# row; a margin of NEAR_TIE needs both logits to move by half that, in opposite directions); the
# output must then equal plain decoding from there.
NEAR_TIE = 0.75
ROW_NOISE = 0.75
MAX_FLIPS = 3


def _check_greedy_path(target, prompt, spec, spec_rows, plain, plain_rows, strategy) -> None:
    done, flips = 0, []  # spec[:done] is checked
    for _ in range(MAX_FLIPS + 1):  # each pass returns, fails, or resumes after one tolerated flip
        at = next((i for i, (a, b) in enumerate(zip(plain, spec[done:])) if a != b), None)
        if at is None and len(plain) == len(spec) - done:
            return
        i = done + (at if at is not None else min(len(plain), len(spec) - done))
        position = len(prompt) + i - 1  # the KV position whose logits chose generated token i
        p_row, s_row = plain_rows[position], spec_rows[position]
        p_choice, s_choice = int(np.argmax(p_row)), int(np.argmax(s_row))
        plain_margin = float(p_row[p_choice] - p_row[s_choice])
        spec_margin = float(s_row[s_choice] - s_row[p_choice])
        top = np.argsort(-p_row)[:20]
        row_gap = float(np.abs(p_row[top] - s_row[top]).max())
        scale = float(np.std(p_row))
        margins = (_top_margin(p_row), _top_margin(s_row), plain_margin, spec_margin, row_gap, scale)
        report = _divergence(target, spec, i, (p_choice, s_choice), margins, strategy, flips)
        if p_choice == s_choice or max(plain_margin, spec_margin) >= NEAR_TIE * scale or row_gap >= ROW_NOISE * scale:
            pytest.fail(report)
        if len(flips) == MAX_FLIPS:
            pytest.fail(f"too many near-tie flips; the last: {report}")
        flips.append(f"token {i}: margins {plain_margin:.3f} / {spec_margin:.3f}")
        warnings.warn(f"tolerated a near-tie flip: {report}", stacklevel=1)
        if target.is_eog(s_choice):  # the speculative run ended on the flipped token
            assert len(spec) == i, report
            return
        done = i + 1
        plain, plain_rows = _plain(target, prompt + spec[:done], MAX_TOKENS - done)
    pytest.fail(f"--spec {strategy}: more than {MAX_FLIPS} near-tie flips")  # not reached: the loop returns or fails


def _top_margin(row: np.ndarray) -> float:
    first, second = np.partition(row, -2)[-2:][::-1]
    return float(first - second)


def _divergence(target, spec, i, choices, margins, strategy, flips) -> str:
    """One paragraph: where the outputs part and the target's logit margins there."""
    (p_choice, s_choice), (p_top, s_top, plain_margin, spec_margin, row_gap, scale) = choices, margins
    text = b"".join(target.token_bytes(t) for t in spec[:i]).decode("utf-8", "replace")
    return (
        f"--spec {strategy} diverged from plain decoding at generated token {i}: plain chose "
        f"{p_choice} {target.token_text(p_choice)!r}, speculative chose {s_choice} {target.token_text(s_choice)!r}. "
        f"Target logit margin top1 - top2 there: {p_top:.4f} in plain (one token per pass), {s_top:.4f} in the "
        f"speculative batch; between the two choices: {plain_margin:.4f} and {spec_margin:.4f} (near-tie tolerance "
        f"{NEAR_TIE * scale:.4f}); the rows' top-20 logits differ by up to {row_gap:.4f} (noise tolerance "
        f"{ROW_NOISE * scale:.4f}; the row's standard deviation is {scale:.3f}). "
        f"Earlier tolerated flips: {flips or 'none'}. Common text: {text!r}"
    )


# -- (c) the vocabulary check ---------------------------------------------------------------------


def _engine(target: Path, draft: Path) -> Engine:
    return Engine(ModelPaths(target, draft), SpecConfig(strategy="ngram+draft"), TINY, TINY)


@pytest.mark.real
def test_smollm2_cannot_draft_for_qwen(qwen_pair, smollm2_path):
    with pytest.raises(SpecllmError) as caught:
        _engine(qwen_pair[0], smollm2_path)
    message = str(caught.value)
    assert qwen_pair[0].name in message and smollm2_path.name in message


def test_vocabulary_sizes_beyond_tolerance_are_refused(tiny_pair, tiny_dir):
    short = write_tiny_gguf(tiny_dir / "tiny-short-200.gguf", 1, drop_last_tokens=200)
    with pytest.raises(SpecllmError, match="vocabulary sizes differ") as caught:
        _engine(tiny_pair[0], short)
    assert tiny_pair[0].name in str(caught.value) and short.name in str(caught.value)


def test_vocabulary_sizes_within_tolerance_pass_when_texts_agree(tiny_pair, tiny_dir):
    short = write_tiny_gguf(tiny_dir / "tiny-short-100.gguf", 1, drop_last_tokens=100)
    engine = _engine(tiny_pair[0], short)
    try:
        assert engine.draft.n_vocab == engine.target.n_vocab - 100
        assert engine.target_info.tokens_digest != engine.draft_info.tokens_digest  # the texts were compared
    finally:
        engine.close()


def test_a_differing_token_text_is_refused(tiny_pair, tiny_dir):
    renamed = write_tiny_gguf(
        tiny_dir / "tiny-renamed.gguf", 1, token_edits={30000: "specllm-renamed"}
    )
    with pytest.raises(SpecllmError, match="token 30000") as caught:
        _engine(tiny_pair[0], renamed)
    assert tiny_pair[0].name in str(caught.value) and renamed.name in str(caught.value)


def test_identical_tokenizers_pass(tiny_pair):
    engine = _engine(*tiny_pair)
    try:
        assert engine.draft is not None
        assert engine.target_info.tokens_digest == engine.draft_info.tokens_digest
    finally:
        engine.close()


# -- (d) the draft model, loaded when `auto` first consults it -----------------------------------

# A 2-core CPU's curve, where the draft model cannot pay (its step costs 0.6 of a target pass), and a
# GPU-shaped one, where it does (nearly flat batches, a step a third of a pass): tests/test_policy.py's.
CPU_CURVE = CostModel({1: 0.0311, 2: 0.0569, 4: 0.0919, 8: 0.1745, 16: 0.1782, 32: 0.3286},
                      draft_seconds=0.0184, depth=256, context_seconds=4.95e-06, draft_token_seconds=0.0060)  # fmt: skip
FLAT_CURVE = CostModel({k: 0.012 * (1 + 0.02 * (k - 1)) for k in (1, 2, 4, 8, 16, 32)}, draft_seconds=0.0042, draft_token_seconds=0.00013)


@pytest.mark.parametrize("curve, consulted", [(CPU_CURVE, False), (FLAT_CURVE, True)], ids=["cpu", "flat"])
def test_auto_loads_the_draft_model_only_when_it_first_consults_it(tiny_pair, curve, consulted):
    engine = Engine(ModelPaths(*tiny_pair), SpecConfig(strategy="auto"), TINY, TINY, cost_cache=None)
    engine.costs = lambda max_batch=None: curve.copy()
    try:
        assert engine.draft is not None and not engine.draft.loaded
        prompt = engine.target.tokenize("The quick brown fox jumps over the lazy dog, then naps in the sun.")
        plain, plain_rows = _plain(engine.target, prompt, MAX_TOKENS)
        decoder = engine.decoder("auto")
        assert not engine.draft.loaded
        decoder.target = recorder = LogitsRecorder(decoder.target)
        events = list(decoder.generate(prompt, MAX_TOKENS, GREEDY, np.random.default_rng(0)))
        drafted = sum(e.drafted for e in events if isinstance(e, StepDone) and e.model_seconds > 0)
        assert engine.draft.loaded == consulted and (drafted > 0) == consulted
        _check_greedy_path(engine.target, prompt, events[-1].tokens, recorder.rows, plain, plain_rows, "auto")
    finally:
        engine.close()
