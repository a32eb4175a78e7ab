from collections import Counter

import numpy as np
import pytest

from specllm.engine.auto import AutoDrafter
from specllm.engine.costmodel import CostModel
from specllm.engine.decode import (
    Decoder,
    Done,
    PrefillDone,
    StepDone,
    TokenCommitted,
    fixed_budget,
    generate_plain,
)
from specllm.engine.drafters import ChainDrafter, ModelDrafter, NgramDrafter
from specllm.engine.policy import CostAwarePolicy, Plan
from specllm.engine.sampling import SamplingParams, warp
from specllm.engine.stats import Stats
from tests.fakes import FakeBackend
from tests.stat_helpers import chi_square_pvalue, exact_distribution

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


# `auto` on fakes plans by this GPU-like curve and runs on the virtual clock that it prices: it then
# drafts from both sources (on real time a fake's microseconds would make every draft look lost)
AUTO_COSTS = CostModel({k: 0.01 + 0.0001 * k for k in (1, 2, 4, 8, 16)}, draft_seconds=0.001, draft_token_seconds=0.0001)


def _target(v, seed=0, clock=None, eog=None):
    return FakeBackend(n_vocab=v, seed=seed, eog=eog, clock=clock, pass_seconds=AUTO_COSTS.verify)


def _drafters(kind, v=8, draft_seed=1, clock=None, eog=None):
    """`eog`: the end-of-generation token, which drafts stop at (none by default)."""
    if kind == "off":
        return None
    ends = FakeBackend(eog=eog).is_eog
    if kind == "auto":
        assert clock is not None, "auto on fakes runs on the virtual clock"
        draft = FakeBackend(n_vocab=v, seed=draft_seed, eog=eog, clock=clock, pass_seconds=AUTO_COSTS.catch_up)
        return AutoDrafter(NgramDrafter(1, 3, ends), ModelDrafter(draft, 0.0), CostAwarePolicy(AUTO_COSTS.copy(), has_draft_model=True))
    if kind == "ngram":
        return NgramDrafter(1, 3, ends)
    draft = ModelDrafter(FakeBackend(n_vocab=v, seed=draft_seed, eog=eog), p_min=0.0)
    return draft if kind == "draft" else ChainDrafter([NgramDrafter(2, 3, ends), draft])


def _run(decoder, prompt, n, params, seed=0):
    events = list(decoder.generate(prompt, n, params, np.random.default_rng(seed)))
    return events[-1], events


@pytest.mark.parametrize("kind", ["off", "ngram", "draft", "ngram+draft", "auto"])
@pytest.mark.parametrize("draft_max", [1, 3, 8])
@pytest.mark.parametrize("cut", [None, 2], ids=["whole drafts", "drafts cut where a text would end"])
def test_greedy_speculation_equals_plain(kind, draft_max, cut, virtual_clock):
    target = _target(8, clock=virtual_clock)
    reference = generate_plain(FakeBackend(seed=0), PROMPT, 40, GREEDY, np.random.default_rng(0))
    decoder = Decoder(target, _drafters(kind, clock=virtual_clock), fixed_budget(draft_max))
    events = list(decoder.generate(PROMPT, 40, GREEDY, np.random.default_rng(0), find_text_end=None if cut is None else lambda pieces: cut))
    done = events[-1]
    assert done.tokens == reference
    assert [e.token for e in events if isinstance(e, TokenCommitted)] == reference


@pytest.mark.parametrize("kind", ["ngram", "auto"])
def test_ngram_drafts_never_change_a_seeded_sampled_text(kind, virtual_clock):
    """At temperature > 0 an n-gram token is verified by the target's own draw at its position, the
    one plain decoding makes there with the same seed: whatever the cache drafts (here from every
    earlier generation too) and whatever `auto` has learned to draft, a seed gives plain decoding's
    text, drafts kept and drafts rejected alike."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    ends = FakeBackend().is_eog
    ngram = NgramDrafter(1, 3, ends)
    drafter = ngram if kind == "ngram" else AutoDrafter(ngram, None, CostAwarePolicy(AUTO_COSTS.copy(), has_draft_model=False))
    decoder = Decoder(_target(4, clock=virtual_clock), drafter, fixed_budget(4))
    outcomes = Counter()
    for seed in range(60):
        reference = generate_plain(FakeBackend(n_vocab=4, seed=0), PROMPT, 24, params, np.random.default_rng(seed))
        done, events = _run(decoder, PROMPT, 24, params, seed)
        assert done.tokens == reference, f"seed {seed}"
        outcomes.update("kept" if e.accepted == e.drafted else "rejected" for e in events if isinstance(e, StepDone) and e.drafted)
    assert outcomes["kept"] >= 50 and outcomes["rejected"] >= 50, outcomes


def test_drafts_are_accepted_when_draft_equals_target():
    target = FakeBackend(seed=0)
    decoder = Decoder(target, ModelDrafter(FakeBackend(seed=0), p_min=0.0), fixed_budget(4))
    done, events = _run(decoder, PROMPT, 20, GREEDY)
    stats = Stats()
    for e in events:
        stats.update(e)
    assert stats.acceptance_rate == 1.0
    assert stats.target_passes == 4  # 20 tokens in passes of 5
    assert stats.mean_accepted_length == 5.0


def test_plain_decoding_commits_one_token_a_pass_the_end_token_included(virtual_clock):
    """The pass that chooses the end of the generation is paid and counted with its token: plain
    decoding shows 1.00 token a pass, not tokens / (tokens + 1)."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    decoder = Decoder(_target(5, clock=virtual_clock, eog=4), None)
    ended = 0
    for seed in range(20):
        stats = Stats()
        for event in decoder.generate([1, 2, 3], 12, params, np.random.default_rng(seed)):
            stats.update(event)
        ended += stats.finish_reason == "stop"
        assert stats.mean_accepted_length == 1.0 and stats.target_passes == stats.tokens + (stats.finish_reason == "stop")
    assert ended >= 5


def _exact_distribution(seed, prompt, length, params, v=8):
    return exact_distribution(FakeBackend(n_vocab=v, seed=seed), prompt, length, params)


# The sources each drafter must have drafted from, and drafts both fully accepted and rejected (a draft
# model equal to the target is never rejected): a chi-square over sequences no draft touched proves nothing.
# 8000 sequences are enough to catch a subtly wrong rejection step: a residual max(0, p - q/2) instead
# of max(0, p - q) fails every test here that can reject (checked by hand); resampling from p_target
# instead of the residual gives p-values under 1e-200
SAMPLES = 8000
SOURCES = {"ngram": {"ngram"}, "draft": {"draft"}, "ngram+draft": {"ngram", "draft"}, "agreeing-draft": {"draft"}, "auto": {"ngram", "draft"}}


@pytest.mark.parametrize("kind", ["ngram", "draft", "ngram+draft", "agreeing-draft", "auto"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        # The filtered warp in the full suite; the fast tier has it through llama.cpp (test_lossless_real.py's top-k rows)
        pytest.param(SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05), marks=pytest.mark.slow),
    ],
)
def test_sampled_sequences_follow_the_target_distribution(kind, params, virtual_clock):
    v, length = 5, 3
    prompt = [1, 2, 1, 2, 1]
    expected = _exact_distribution(0, prompt, length, params, v)
    target = _target(v, clock=virtual_clock)
    draft = {"agreeing-draft": ModelDrafter(FakeBackend(n_vocab=v, seed=0), p_min=0.0)}.get(kind) or _drafters(kind, v, clock=virtual_clock)
    decoder = Decoder(target, draft, fixed_budget(3))
    rng = np.random.default_rng(4)  # a seed where `auto` keeps exploring the draft model (in about one seed in four, four early rejections retire it)
    samples, sources, outcomes = [], Counter(), Counter()
    for _ in range(SAMPLES):
        if kind == "ngram+draft":  # a fresh chain: the n-gram cache's memory of earlier samples would leave the draft model nothing
            decoder = Decoder(target, _drafters(kind, v, clock=virtual_clock), fixed_budget(3))
        for event in decoder.generate(prompt, length, params, rng):
            if isinstance(event, StepDone) and event.drafted:
                sources[event.source] += 1
                outcomes["all accepted" if event.accepted == event.drafted else "rejected"] += 1
            elif isinstance(event, Done):
                samples.append(tuple(event.tokens))
    assert all(sources[source] >= 100 for source in SOURCES[kind]), sources
    assert outcomes["all accepted"] >= 100 and (kind == "agreeing-draft" or outcomes["rejected"] >= 100), outcomes
    assert chi_square_pvalue(samples, expected) > 1e-4


@pytest.mark.parametrize("kind", ["ngram", "draft", "auto"])
def test_sampled_generations_that_can_end_follow_the_target_distribution(kind, virtual_clock):
    """With an end token in play, drafts stop at it (a stopping rule that depends on the token drawn,
    which rejection sampling allows: every drafted token is still an exact sample of its row), and
    whole generations, ended or cut by the length limit, are distributed as the target's."""
    v, length, end = 5, 3, 4
    prompt = [1, 2, 4, 1, 2, 4, 1, 2]  # the end token sits in the prompt: the n-gram cache copies it
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    truth = FakeBackend(n_vocab=v, seed=0)
    expected: dict = {}

    def walk(context, tokens, prob):
        if len(tokens) == length:
            expected[("length", tuple(tokens))] = prob
            return
        row = warp(truth.logits_after(context), params)
        for token in range(v):
            if token == end:
                expected[("stop", tuple(tokens))] = prob * row[token]
            else:
                walk(context + [token], tokens + [token], prob * row[token])

    walk(list(prompt), [], 1.0)
    decoder = Decoder(_target(v, clock=virtual_clock, eog=end), _drafters(kind, v, clock=virtual_clock, eog=end), fixed_budget(3))
    rng = np.random.default_rng(5)
    samples, drafted = [], 0
    for _ in range(SAMPLES):
        for event in decoder.generate(prompt, length, params, rng):
            if isinstance(event, StepDone):
                drafted += event.drafted
            elif isinstance(event, Done):
                samples.append((event.finish_reason, tuple(event.tokens)))
    assert drafted >= 1000 and sum(reason == "stop" for reason, _ in samples) >= 1000
    assert chi_square_pvalue(samples, expected) > 1e-4


def test_stops_at_end_of_generation_token():
    target = FakeBackend(seed=0, eog=None)
    reference = generate_plain(target, PROMPT, 30, GREEDY, np.random.default_rng(0))
    eog = reference[5]
    target = FakeBackend(seed=0, eog=eog)
    done, _ = _run(Decoder(target, NgramDrafter(1, 3)), PROMPT, 30, GREEDY)
    assert done.finish_reason == "stop"
    assert done.tokens == reference[: reference.index(eog)]


def test_drafts_end_at_an_end_of_generation_token():
    """Nothing after an end of generation can be committed: an n-gram copy that runs past the end of
    a turn in the prompt, and a draft model that drafts one, stop there."""
    end = 7
    ngram = NgramDrafter(2, 3, ends_generation=lambda token: token == end)
    ngram.commit([1, 2, 3, end, 5, 6, 4, 1, 2])
    assert ngram.propose([1, 2, 3, end, 5, 6, 4, 1, 2], 6, GREEDY, None).tokens == [3, end]
    assert NgramDrafter(2, 3).propose([1, 2, 3, end, 5, 6, 4, 1, 2], 6, GREEDY, None).tokens == [3, end, 5, 6, 4, 1]
    assert ngram.proposal_after([4, 1, 2], 6).tokens == [3, end]

    history = [1, 2, 3]
    free = ModelDrafter(FakeBackend(seed=0), p_min=0.0).propose(history, 8, GREEDY, None).tokens
    eog = free[2]
    assert eog not in free[:2], "the fake's greedy draft must reach this token at its third step"
    stopped = ModelDrafter(FakeBackend(seed=0, eog=eog), p_min=0.0).propose(history, 8, GREEDY, None).tokens
    assert len(free) == 8 and stopped == free[:3]


def test_a_draft_models_tokens_past_the_targets_end_token_are_never_drafted():
    """A draft model whose end tokens are not the target's stops at the target's (nothing after it
    can be committed, so nothing after it is verified); the step that accepts the end token counts
    it, not the target's token after it."""
    reference = generate_plain(FakeBackend(seed=0), PROMPT, 30, GREEDY, np.random.default_rng(0))
    eog = reference[5]
    target = FakeBackend(seed=0, eog=eog)
    drafter = ModelDrafter(FakeBackend(seed=0), p_min=0.0, ends_generation=target.is_eog)  # the draft model knows no end token
    done, events = _run(Decoder(target, drafter, fixed_budget(8)), PROMPT, 30, GREEDY)
    assert done.finish_reason == "stop" and done.tokens == reference[: reference.index(eog)]
    steps = [e for e in events if isinstance(e, StepDone)]
    assert sum(s.committed for s in steps) == len(done.tokens) + 1  # the end token too, and nothing after it
    assert target.evaluations[1:] == [s.drafted + 1 for s in steps] and all(s.accepted == s.drafted for s in steps)
    assert sum(s.drafted for s in steps) == len(done.tokens) + 1  # the draft ended with the end token


@pytest.mark.parametrize("kind", ["draft", "ngram+draft"])
def test_a_draft_model_with_fewer_tokens_than_the_target_reads_every_history(kind):
    """The vocabulary check lets a draft model lack a few of the target's last ids (a fine-tune's added
    chat tokens): a history holding one made its catch-up fail (llama.cpp refuses an id past the
    vocabulary; the fake's table too), and so the run. The output stays plain decoding's."""
    prompt = [7, 1, 6, 2, 7, 1, 6, 2, 7]  # ids 6 and 7: the target's only
    reference = generate_plain(FakeBackend(seed=0), prompt, 30, GREEDY, np.random.default_rng(0))
    drafter = ModelDrafter(FakeBackend(n_vocab=6, seed=1), p_min=0.0, n_vocab=8)
    if kind == "ngram+draft":
        drafter = ChainDrafter([NgramDrafter(2, 3), drafter])
    done, events = _run(Decoder(FakeBackend(seed=0), drafter, fixed_budget(4)), prompt, 30, GREEDY)
    assert done.tokens == reference and sum(e.drafted for e in events if isinstance(e, StepDone)) > 0
    sampled = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert len(_run(Decoder(FakeBackend(seed=0), drafter, fixed_budget(4)), prompt, 30, sampled)[0].tokens) == 30


def test_an_engines_draft_model_stops_at_the_targets_end_tokens(tiny_pair):
    from specllm.backend import LoadOptions
    from specllm.session import Engine, ModelPaths, SpecConfig

    options = LoadOptions(n_ctx=256, n_threads=1)
    engine = Engine(ModelPaths(*tiny_pair), SpecConfig("auto"), options, options)
    try:
        for strategy in ("auto", "draft", "ngram+draft"):
            drafter = engine.decoder(strategy).drafter
            model = drafter.model if strategy == "auto" else drafter if strategy == "draft" else drafter.drafters[-1]
            assert model.ends_generation == engine.target.is_eog, strategy
    finally:
        engine.close()


def test_max_tokens_is_exact_and_kv_holds_history_minus_last():
    target = FakeBackend(seed=0)
    decoder = Decoder(target, NgramDrafter(1, 3), fixed_budget(8))
    done, _ = _run(decoder, PROMPT, 17, GREEDY)
    assert len(done.tokens) == 17 and done.finish_reason == "length"
    assert target.kv == decoder.history[:-1]


def test_context_full_stops_with_reason_and_keeps_text():
    target = FakeBackend(seed=0, n_ctx=20)
    done, _ = _run(Decoder(target, NgramDrafter(1, 3)), PROMPT, 100, GREEDY)
    assert done.finish_reason == "context"
    assert len(PROMPT) + len(done.tokens) == 21  # every slot used; the last token needs no slot
    assert done.tokens == generate_plain(FakeBackend(seed=0, n_ctx=20), PROMPT, 100, GREEDY, None)[: len(done.tokens)]


def test_prompt_longer_than_context_is_refused():
    from specllm.errors import SpecllmError

    with pytest.raises(SpecllmError, match="context"):
        list(Decoder(FakeBackend(n_ctx=4)).generate(PROMPT, 5, GREEDY, np.random.default_rng()))


def test_next_turn_evaluates_only_new_tokens():
    target = FakeBackend(seed=0)
    decoder = Decoder(target, NgramDrafter(1, 3))
    _run(decoder, PROMPT, 10, GREEDY)
    held = len(decoder.history) - 1  # the KV cache holds all but the last committed token
    turn2 = decoder.history + [4, 5, 6]
    target.evaluations.clear()
    _, events = _run(decoder, turn2, 5, GREEDY)
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    assert prefill.reused_tokens == held
    assert target.evaluations[0] == len(turn2) - 1 - held == 3
    fresh = Decoder(FakeBackend(seed=0), NgramDrafter(1, 3))
    fresh_done, _ = _run(fresh, turn2, 5, GREEDY)
    assert _run(Decoder(FakeBackend(seed=0)), turn2, 5, GREEDY)[0].tokens == fresh_done.tokens


def test_interrupted_generation_leaves_consistent_state():
    target = FakeBackend(seed=0)
    decoder = Decoder(target, NgramDrafter(1, 3), fixed_budget(4))
    calls = iter(range(100))
    events = list(decoder.generate(PROMPT, 50, GREEDY, np.random.default_rng(0), stop=lambda: next(calls) >= 3))
    assert events[-1].finish_reason == "interrupted"
    assert target.kv == decoder.history[:-1]
    turn2 = decoder.history + [4]
    continued = _run(decoder, turn2, 8, GREEDY)[0].tokens
    assert continued == generate_plain(FakeBackend(seed=0), turn2, 8, GREEDY, None)


def test_step_events_account_for_every_token():
    target = FakeBackend(seed=0)
    _, events = _run(Decoder(target, _drafters("ngram+draft")), PROMPT, 30, GREEDY)
    steps = [e for e in events if isinstance(e, StepDone)]
    assert sum(s.committed for s in steps) == 30
    assert all(0 <= s.accepted <= s.drafted for s in steps)
    assert target.evaluations[0] == len(PROMPT) - 1  # the prefill, then one target pass per step
    assert target.evaluations[1:] == [s.drafted + 1 for s in steps]


class _NgramThenModel(CostAwarePolicy):
    """Every step with an n-gram proposal drafts its first token and lets the draft model go on
    after it for up to two more: the mixed draft, whatever it is worth."""

    def plan(self, proposal, pending):
        if proposal is None:
            return Plan(None)
        return Plan("ngram", tuple(self.ngram_keys(proposal, 1)), draft_tokens=2, then_model=True)

    def worth_including(self, acceptance, next_acceptance):
        return True

    def worth_looking_further(self, acceptance):
        return True


def _mixed_drafts(policy, seed, clock, classify) -> None:
    """SAMPLES generations of 3 tokens after [1, 2, 1, 2, 1] at temperature 1 by an `auto` whose policy
    forces one kind of mixed draft; `classify(step, drafter)` names the outcomes of each such step.
    Each outcome must occur 100+ times and the sequences must follow the target's distribution."""
    v, length, prompt = 5, 3, [1, 2, 1, 2, 1]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    expected = _exact_distribution(0, prompt, length, params, v)
    rng = np.random.default_rng(seed)
    samples, outcomes = [], Counter()
    for _ in range(SAMPLES):
        draft = FakeBackend(n_vocab=v, seed=1, clock=clock, pass_seconds=AUTO_COSTS.catch_up)
        drafter = AutoDrafter(NgramDrafter(1, 3), ModelDrafter(draft, 0.0), policy(AUTO_COSTS.copy(), has_draft_model=True))
        decoder = Decoder(_target(v, clock=clock), drafter, fixed_budget(3))
        for event in decoder.generate(prompt, length, params, rng):
            if isinstance(event, StepDone):
                outcomes.update(classify(event, drafter))
            elif isinstance(event, Done):
                samples.append(tuple(event.tokens))
    assert len(outcomes) == 4 and min(outcomes.values()) >= 100, outcomes
    assert chi_square_pvalue(samples, expected) > 1e-4


def test_an_ngram_draft_the_draft_model_continues_keeps_the_target_distribution(virtual_clock):
    """One verification over a copied token (one-hot q) and the draft model's tokens after it (their
    own q rows): the sequences follow the target's distribution, with drafts accepted and rejected."""

    def classify(step, drafter):
        if step.source != "ngram" or step.drafted <= 1:  # the model drafted after the copy
            return []
        return ["copy accepted" if step.accepted >= 1 else "copy rejected", "all accepted" if step.accepted == step.drafted else "rejected"]

    _mixed_drafts(_NgramThenModel, 12, virtual_clock, classify)


class _ModelThenCopy(_NgramThenModel):
    """Every step asks the draft model, which stops as soon as the text it writes has become a copy
    the n-gram cache can go on with (up to two copied tokens): the other mixed draft."""

    def plan(self, proposal, pending):
        return Plan("draft", draft_tokens=3)

    def ngram_draft(self, proposal):
        return self.ngram_keys(proposal, min(len(proposal.tokens), 2))

    def copy_beats_model(self, acceptance, copy):
        return True


def test_a_copy_after_the_draft_models_tokens_keeps_the_target_distribution(virtual_clock):
    """One verification over the draft model's tokens (their q rows) and the copy they ran into
    (one-hot, no rows): the sequences follow the target's distribution, copies accepted and rejected."""

    def classify(step, drafter):
        model = drafter._model_drafted
        if step.source != "draft" or step.drafted <= model:  # a copy followed the model's tokens
            return []
        return ["copy reached" if step.accepted >= model else "copy not reached", "all accepted" if step.accepted == step.drafted else "rejected"]

    _mixed_drafts(_ModelThenCopy, 13, virtual_clock, classify)


@pytest.mark.parametrize("policy, first", [(_NgramThenModel, "ngram"), (_ModelThenCopy, "draft")], ids=["copy then model", "model then copy"])
def test_a_mixed_drafts_tokens_are_counted_by_their_own_source(virtual_clock, policy, first):
    """In a draft of both sources each token is counted as its source's: the draft model's tokens
    after a copy counted as the n-gram cache's, and a copy after the model's as the model's."""
    draft = FakeBackend(seed=1, clock=virtual_clock, pass_seconds=AUTO_COSTS.catch_up)
    drafter = AutoDrafter(NgramDrafter(1, 3), ModelDrafter(draft, 0.0), policy(AUTO_COSTS.copy(), has_draft_model=True))
    _, events = _run(Decoder(_target(8, clock=virtual_clock), drafter, fixed_budget(8)), PROMPT, 60, GREEDY)
    steps = [e for e in events if isinstance(e, StepDone)]
    mixed = [step for step in steps if step.sources]
    assert mixed and all(step.sources[0] == first and set(step.sources) == {"ngram", "draft"} for step in mixed)
    stats, committed = Stats(), Counter()
    for event in events:
        stats.update(event)
        if isinstance(event, TokenCommitted):
            committed[event.source] += 1
    def share(step, name):  # (drafted, accepted) of `name`'s tokens in a step
        sources = step.sources or (step.source,) * step.drafted
        return sources.count(name), sources[: step.accepted].count(name)

    for name in ("ngram", "draft"):
        own = [share(step, name) for step in steps if name in (step.sources or (step.source,))]
        assert (stats.by_source[name].drafted, stats.by_source[name].accepted) == tuple(map(sum, zip(*own)))
        assert committed[name] == stats.by_source[name].accepted  # every accepted drafted token is committed here (no end token)
    assert stats.drafted == sum(s.drafted for s in steps) and stats.accepted == sum(s.accepted for s in steps)


def test_an_ngram_draft_the_draft_model_continues_is_greedy_text_unchanged(virtual_clock):
    reference = generate_plain(FakeBackend(seed=0), PROMPT, 40, GREEDY, np.random.default_rng(0))
    draft = FakeBackend(seed=1, clock=virtual_clock, pass_seconds=AUTO_COSTS.catch_up)
    drafter = AutoDrafter(NgramDrafter(1, 3), ModelDrafter(draft, 0.0), _NgramThenModel(AUTO_COSTS.copy(), has_draft_model=True))
    done, events = _run(Decoder(_target(8, clock=virtual_clock), drafter, fixed_budget(8)), PROMPT, 40, GREEDY)
    assert done.tokens == reference
    assert any(isinstance(e, StepDone) and e.source == "ngram" and e.drafted > 1 and e.model_seconds > 0 for e in events)


def test_a_stop_while_the_prompt_is_read_is_heard_between_batches():
    """Ctrl-C (or a client leaving) during a long prompt's reading stops it after the batch in hand,
    not after the whole prompt; what was read is reused by the next prompt, whose text is unchanged."""
    prompt = [i % 7 for i in range(40)]
    target = FakeBackend(seed=0)
    target.n_batch = 8
    decoder = Decoder(target, NgramDrafter(2, 4, target.is_eog), fixed_budget(4))
    events = list(decoder.generate(prompt, 10, GREEDY, None, stop=lambda: len(target.evaluations) >= 2))
    assert target.evaluations == [8, 8] and target.kv == prompt[:16]
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "interrupted" and events[-1].tokens == []
    again = list(decoder.generate(prompt, 10, GREEDY, None))
    assert again[0].reused_tokens == 16 and target.evaluations[2:5] == [8, 8, 7]
    assert again[-1].tokens == generate_plain(FakeBackend(seed=0), prompt, 10, GREEDY, None)


def test_nothing_from_where_the_shown_text_ends_is_verified():
    """`find_text_end` says at which drafted token the caller's text ends (a stop string completed, an
    editor's short line begun): the draft is cut after it, so the batch holds nothing that would be
    thrown away; the text is plain decoding's."""
    reference = generate_plain(FakeBackend(seed=0), PROMPT, 40, GREEDY, None)
    offered = []

    def ends_at_third(pieces):
        offered.append(len(pieces))
        return 2

    decoder = Decoder(FakeBackend(seed=0), NgramDrafter(1, 3), fixed_budget(16))
    events = list(decoder.generate(PROMPT, 40, GREEDY, np.random.default_rng(0), find_text_end=ends_at_third))
    drafted = [e.drafted for e in events if isinstance(e, StepDone) and e.drafted]
    assert events[-1].tokens == reference
    assert max(offered) > 3 and drafted and max(drafted) == 3  # longer drafts were offered, three verified


@pytest.mark.parametrize("kind", ["draft", "auto"])
def test_sampled_generations_cut_where_the_text_ends_follow_the_target_distribution(kind, virtual_clock):
    """A cut that depends on the drafted tokens themselves (after the first "d", as a stop string
    would) is a stopping rule on the draft: every verified token is still an exact sample of its row,
    so whole generations keep the target's distribution. (Cut before the "d" instead, leaving that
    position to the target's own draw, and the p-value falls under 1e-100.)"""
    v, length = 5, 3
    prompt = [1, 2, 1, 2, 1]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    expected = _exact_distribution(0, prompt, length, params, v)
    decoder = Decoder(_target(v, clock=virtual_clock), _drafters(kind, v, clock=virtual_clock), fixed_budget(3))
    rng, samples, cut = np.random.default_rng(4), [], Counter()

    def at_d(pieces):
        end = next((i for i, piece in enumerate(pieces) if piece == "d"), None)
        cut[end is not None] += 1
        return end

    for _ in range(SAMPLES):
        events = list(decoder.generate(prompt, length, params, rng, find_text_end=at_d))
        samples.append(tuple(events[-1].tokens))
    assert cut[True] >= 500 and cut[False] >= 500, cut
    assert chi_square_pvalue(samples, expected) > 1e-4


def test_the_text_of_a_draft_is_read_without_moving_the_stream():
    from specllm.engine.decode import _TextStream

    class Bytes:
        def token_bytes(self, token):
            return {0: b"a", 1: "é".encode()[:1], 2: "é".encode()[1:], 3: b"b"}[token]

    stream = _TextStream(Bytes())
    assert stream.push(1) == ""  # half a character, held
    assert stream.peek([2, 3, 0]) == ["é", "b", "a"]
    assert stream.peek([0]) == ["\ufffda"]  # "a" cannot continue the held lead byte
    assert stream.push(2) == "é" and stream.text == "é"
