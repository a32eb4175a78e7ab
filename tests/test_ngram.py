from specllm.engine.drafters import NgramDrafter
from specllm.engine.ngram import NgramCache, ends_sentence


def test_proposes_continuation_of_latest_match():
    cache = NgramCache(n_min=2, n_max=3)
    cache.extend([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    proposal = cache.propose(4)
    assert proposal.tokens == [5, 7, 1, 2]  # the most recent earlier "1 2 3" was followed by 5
    assert proposal.match_length == 3


def test_longest_match_wins():
    cache = NgramCache(n_min=1, n_max=3)
    cache.extend([7, 8, 1, 2, 9, 5, 1, 2, 6, 7, 8, 1, 2])
    # "8 1 2" (n=3) matched at the start, followed by 9; "1 2" alone most recently by 6.
    assert cache.propose(1).tokens == [9]


def test_no_match_no_proposal():
    cache = NgramCache(n_min=2, n_max=4)
    cache.extend([1, 2, 3, 4, 5])
    assert cache.propose(4) is None
    assert cache.propose(0) is None


def test_incremental_equals_bulk():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1, 5]
    bulk = NgramCache(2, 4)
    bulk.extend(tokens)
    step = NgramCache(2, 4)
    for t in tokens:
        step.extend([t])
    assert bulk._index == step._index
    assert bulk.propose(5) == step.propose(5)


def test_truncate_forgets_later_tokens():
    cache = NgramCache(2, 2)
    cache.extend([1, 2, 3, 1, 2, 4])
    cache.truncate(3)
    assert cache.tokens == [1, 2, 3]
    cache.extend([1, 2])
    assert cache.propose(2).tokens == [3, 1]


def test_index_size_bounded_by_history():
    cache = NgramCache(2, 4)
    cache.extend([i % 50 for i in range(5000)])
    assert len(cache._index) <= 3 * len(cache)


def test_span_follows_the_agreement_back_beyond_n_max():
    cache = NgramCache(2, 4)
    cache.extend([1, 2, 3, 4, 5, 6, 9, 0, 1, 2, 3, 4, 5, 6])
    proposal = cache.propose(2)
    assert proposal.tokens == [9, 0] and proposal.match_length == 4
    assert proposal.span == 6  # "1 2 3 4 5 6" agrees, the token before differs (none / 0)


def test_proposal_says_how_often_the_ngram_occurred_and_whether_its_followers_agreed():
    cache = NgramCache(2, 2)
    cache.extend([1, 2, 7])
    cache.extend([1, 2])
    first = cache.propose(1)
    assert (first.tokens, first.seen, first.consistent) == ([7], 1, True)
    cache.extend([7, 5, 1, 2])  # "1 2" followed by 7 again
    agreed = cache.propose(1)
    assert (agreed.tokens, agreed.seen, agreed.consistent) == ([7], 2, True)
    cache.extend([8, 1, 2])  # now followed by 8 once
    mixed = cache.propose(1)
    assert (mixed.tokens, mixed.seen, mixed.consistent) == ([8], 3, False)
    cache.truncate(6)  # back to [1, 2, 7, 1, 2, 7]: the rebuilt index forgets the 8
    cache.extend([1, 2])
    assert cache.propose(1).consistent


def test_sentence_ends_are_final_punctuation_not_words_or_code():
    ends = [b".", b".\n\n", b"!", b" ?", b'."', b".)", "\u3002".encode(), "\uff1f\n".encode(), b"..."]
    not_ends = [b"Mr.", b".append", b"3.", b",", b" the", b"\n", b"", b":", b".5"]
    assert all(ends_sentence(piece) for piece in ends)
    assert not any(ends_sentence(piece) for piece in not_ends)


def test_an_older_occurrence_that_the_text_is_copying_is_the_source():
    """A line that recurs (`x = 0` in many places) is continued from where the text is being copied,
    when the history agrees with that place for COPY_SPAN tokens or more; else from its latest place."""
    from specllm.engine.ngram import COPY_SPAN

    line = [1, 2, 3, 4]  # as long as the longest n-gram: every occurrence matches alike
    copied = list(range(100, 100 + COPY_SPAN))  # the text being copied, before the line
    source = copied + line + [50, 51]
    elsewhere = [60] + line + [70, 71]  # the same line later, followed by something else
    cache = NgramCache(2, 4)
    cache.extend(source + elsewhere + copied + line)
    proposal = cache.propose(2)
    assert proposal.tokens == [50, 51] and proposal.span == min(COPY_SPAN + len(line), 32)
    assert proposal.source == len(copied) + len(line) and proposal.seen == 2

    short = NgramCache(2, 4)  # agreeing with the copied place for fewer tokens: the latest place
    short.extend(source + elsewhere + copied[-5:] + line)
    assert short.propose(2).tokens == [70, 71]


def test_a_remembered_answers_span_counts_only_this_generations_agreement():
    """A server's memory of an earlier request whose prompt ended as this one does (the code around a
    gap) but began otherwise (other files beside it): that agreement says nothing of whether the
    answers agree, so a remembered proposal's span counts this generation's tokens that agree with it
    (at least the matched n-gram), not the prompt's."""
    drafter = NgramDrafter(2, 4)
    gap = list(range(100, 140))  # the code around the gap
    answer = list(range(7, 27))
    drafter.start([1, 2, 3] + gap)
    drafter.commit([1, 2, 3] + gap + answer)
    prompt = [4, 5, 6] + gap
    drafter.start(prompt)
    first = drafter.proposal(8)
    assert first.source == -1 and first.tokens == answer[:8]
    assert first.span == first.match_length == 4  # the prompts agree for 40 tokens
    drafter.commit(prompt + answer[:10])  # the new answer follows the remembered one for ten tokens
    later = drafter.proposal(8)
    assert later.source == -1 and later.tokens == answer[10:18] and later.span == 10


def test_a_proposal_tells_when_a_sentence_has_just_begun_before_it():
    """Token 9 ends a sentence. A proposal right after it, or one token later (a summary keeps "The"
    and then tells its own), is marked: the policy judges its first token by how often copies ran
    on past a sentence's end. Two tokens later, or with no sentence end, it is not; the draft
    model's text is judged by its own end, as the history is."""
    source = [1, 2, 3, 9, 4, 5, 6, 7, 8, 10, 11]
    drafter = NgramDrafter(2, 4, sentence_end=lambda token: token == 9)
    marks = {}
    for cut in range(4, 8):  # the history ends with 9 (cut 4), then 4, 5, 6 after it
        drafter.commit(source + source[:cut])
        marks[cut] = drafter.proposal(3).sentence_start
    assert marks == {4: True, 5: True, 6: False, 7: False}
    assert drafter.proposal_after(source + [1, 2, 3, 9], 3).sentence_start
    assert not drafter.proposal_after(source + [2, 3, 9, 4, 5], 3).sentence_start
    plain = NgramDrafter(2, 4)
    plain.commit(source + source[:4])
    assert not plain.proposal(3).sentence_start
