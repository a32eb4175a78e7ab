"""Every prior and constant of `--spec auto`, in one place, each with its reason and its data.

The policy's decisions come from the measured cost curve and from acceptance learned during the
generation; these numbers only say where learning starts and how far a bet may go. None is
per machine. "dev.jsonl" is the project's workload (62 prompts); "recorded text" means plain
decoding's greedy output of the default pair on it, which `scripts/replay_policy.py` replays.
"""

# -- learning -----------------------------------------------------------------------------
PRIOR_WEIGHT = 2.0  # a prior counts as two observed tokens: a few real outcomes outweigh it
THROUGHPUT_DECAY = 0.1  # weight of one step in the running throughput R (about the last 10 steps)
# A draft is chosen only when its worth beats plain decoding's by this many tokens: its estimates are
# noisy, the cost curve is too (two calibrations of one machine differ by 10-15% on some sizes), and
# choosing whatever estimate clears the bar picks overestimates (the optimiser's curse). For n-gram
# drafts 0.2: replayed on three CPU curves (two recorded, one from a live bench) every category stays
# at 0.98x plain or better, where 0.05 left math at 0.963x on the live curve, as the live bench
# measured (0.96x); copies clear it by whole tokens (code edits lose 0-3% of their speedup).
MARGIN = 0.2
# For the draft model 0.05: its losses are bounded apart (the exploration budget), and a wider margin
# stops it from being consulted where it pays (flat curve, coding: 2.11x at 0.05, 1.17x at 0.2).
MODEL_MARGIN = 0.05
RATE_SHRINK = 0.5  # R is shrunk halfway to plain decoding's rate: a lucky streak must not make good drafts look poor

# -- n-gram drafts: the first token -------------------------------------------------------
FIRST_PRIOR = 0.5  # a first token of a kind not seen yet: even odds, then the generation's own record
# Long agreeing spans mean the text is being copied: on recorded text, a span of 8-15 tokens had its
# first drafted token right 90%+ of the time in code edits and summaries, 16+ 95%+.
COPY_PRIOR = {8: 0.9, 16: 0.95}
MIXED_PRIOR = 0.25  # an n-gram followed by different tokens before: the cache's guess is one of several
# A copy of this generation's own output (the model repeating its phrase): on recorded text, 68% of
# such first tokens at spans of 8+ were right, against 96-100% for copies of the prompt in summaries
# and code edits; it starts where a common phrase does.
OWN_PRIOR = 0.5

# -- n-gram drafts: each further token ----------------------------------------------------
# After an accepted token, copies of unique text run on, common phrases soon end (recorded text:
# continuation 88-97% for copies of the prompt, 21-32% of own-output copies ran 3 tokens).
CONTINUATION_PRIOR = {"unique": 0.9, "repeated": 0.6, "own": 0.6}
DEPTH_PRIOR = {32: 0.97, 16: 0.95, 8: 0.9}  # a copy that has agreed this deep runs on more often (prompt copies only)
# Past the end of a sentence a copy runs on by what the generation shows, from even odds: on
# recorded text, copies of the prompt went on after a sentence's end 100% of the time in code
# edits (docstrings, comments), 78% in summaries and 11% in free-form answers, against 99% inside
# sentences in summaries (replay: summaries 73-77% -> 80% of the oracle on the CPU curves).
SENTENCE_END_PRIOR = 0.5
# A draft's first token is judged so too when one of the history's last SENTENCE_START tokens ends a
# sentence: a summary leaves its source as often at the sentence's second token as at its first
# (it keeps "The", then tells its own). On recorded text (dev.jsonl, the check set, the held set),
# where the agreeing span was 8+ tokens, such first tokens were right 76%, 92% (two sets), 0-91% in
# summaries (3 to 17 of each), against 97-99% inside sentences; in code edits 96-100% either way.
# Replay (12 curves, 6 recordings): 93 categories gain, 54 lose, +0.3% a recording on average;
# summaries on the EPYC Zen 2 curve 79.6% -> 84.6% of the oracle (one 31-token draft that failed
# at its first token, after ". The"). Only the first token (the draft's further tokens two into a
# sentence too: summaries +2-5% on two CPU curves, code edits -1% on every curve); one token (just
# after the end alone): summaries -1.5% on the EPYC curve.
SENTENCE_START = 2
# Long drafts are bets: an n-gram draft may risk, should it be all wrong, the extra verification
# time of one single-token pass plus CAP_GROWTH times what n-gram drafts have saved so far (or be
# half the agreeing span when that is longer): on a CPU one early lucky match does not buy a dear
# batch, while on a flat GPU curve, where a wrong long draft costs little, drafts are long at once.
# The same bound stops a draft model's draft from looking past a dear batch size to a cheap one
# beyond (a 7B on 2 cores: 5 tokens cost 0.89 passes more than 4, 16 less than 15) further than one
# pass plus CAP_GROWTH times what the draft model has saved. One token at a time, a draft accepted
# 98% of the time stopped at 3 there; replay on the EPYC 7B twin (workload / check / third set):
# 1.319x / 1.209x / 1.287x -> 1.320x / 1.215x / 1.295x, coding 1.21 / 1.18 / 1.24x -> 1.20 / 1.22 /
# 1.34x, check-set math 1.14x -> 1.21x; the RTX 3090 32B estimate 4.507x / 3.494x / 3.672x ->
# 4.502x / 3.493x / 3.700x; the rest unchanged. Unbounded, the workload's one math answer fell to
# 0.88x (two unlucky long drafts).
CAP_GROWTH = 2
# What n-gram drafts have lost shrinks what a bet may risk, at a quarter of the rate savings grow it:
# a generation whose matches keep failing stops paying for long lottery tickets, while one early
# miss before a long copy still leaves room to find it (replay of the check set, 52 prompts apart
# from dev.jsonl in tests/data/check-streams.json: extraction on the RTX 4090 and M2 Max estimates
# 0.949x -> 0.963x and 0.957x -> 0.967x; dev.jsonl unchanged or within 0.4% on every curve; at the
# full rate code edits lost 2.5% on the M2 Max).
CAP_SHRINK = 0.5

# -- the draft model ----------------------------------------------------------------------
# Per-token acceptance of a small draft of the same family before any outcome: measured offline
# for the default pair (0.5B over the 1.5B's greedy text) it picks the target's token 62% of the
# time on translation, 75% on questions, 84-94% on math, writing and retrieval, 99% on code edits.
# The prior is the lowest of these: pessimistic, so the draft model must earn its place.
DRAFT_PRIOR = 0.6
# How sure the target is of its own tokens says how often a small draft of its family agrees with
# it: on the recorded text of dev.jsonl, the check set and the third set (69 free-form answers of
# 24+ tokens), the target's mean top probability on its first 16 tokens against the 0.5B's agreement
# on the rest: correlation 0.56; under 0.7 the draft agreed 0.70 of the time, 0.7-0.8 0.81, 0.8-0.85
# 0.92, 0.85+ 0.88 (math, coding and reasoning are sure and agreed; translation, writing and
# questions neither). At temperature 0.8 alike: the expected acceptance of sampled drafts (the sum
# of min(p, q) of both warped rows, along the same text) was 0.72 under 0.7, 0.90 from 0.8 on.
# So where the draft model's prior (0.6) leaves it out, the target's mean top
# probability on the first SURE_TARGET_TOKENS tokens may bring it in: at SURE_TARGET or more the
# prior becomes SURE_TARGET_DRAFT_PRIOR (the agreement above 0.8), counting as
# SURE_TARGET_PRIOR_WEIGHT tokens (it rests on many of the target's), and the draft model is not
# retired before those tokens are seen. Its first use may then lose SURE_TARGET_BUDGET times the
# exploration budget: where a 7B verifies on 2 cores a failed 3-token draft costs 2.9 passes, and
# two unlucky drafts must not end a draft model that agrees 93% of the time (a weight of 2, or no
# wider budget, left the workload's one math answer at 0.91-0.95x). 20 tokens: 21 of the 92
# free-form answers recorded end by then, 3 more by 24 (16 lost short answers: a draft model
# reading a 20-token question to draft the 2 tokens left). Replay (workload / check set / third
# set) on the EPYC 7B-shaped twin, where the draft step costs 0.12 of a pass and the prior never
# consults it: 1.285x / 1.184x / 1.243x -> 1.319x / 1.209x / 1.287x; coding 1.05 / 0.99 / 1.00x ->
# 1.21 / 1.18 / 1.24x, math_reasoning 1.00x -> 1.12 / 1.05 / 1.15x, every category >= 0.978x. The
# RTX 4090 and M2 Max estimates +0.4-0.5% on two sets; every other curve and the long sets unchanged.
# (Before the draft model's drafts looked past a dear batch size: see CAP_GROWTH.)
SURE_TARGET_TOKENS = 20
SURE_TARGET = 0.8
SURE_TARGET_DRAFT_PRIOR = 0.88
SURE_TARGET_PRIOR_WEIGHT = 8.0
SURE_TARGET_BUDGET = 3.0
# Consulting the draft model to learn its acceptance is exploration: where it turns out not to pay
# it may cost at most this share of the plain-decoding time of the tokens asked for.
# A first probe is paid from it in proportion to the share of tokens the n-gram cache did not
# commit (half at first): in a 12x copy on a GPU-shaped curve, 2% of the plain time is 30% of the
# generation's real time (replay, flat curve, code edits: 6.87x -> 7.12x, other curves unchanged).
EXPLORATION_SHARE = 0.02
# The tokens over which the draft model's first use must pay back its catch-up, and of which the
# exploration budget is a share: the tokens asked for, but at most this many (a chat asks for
# 2048 and replies with a few hundred; Spec-Bench's answers run 100-400 tokens).
HORIZON = 256
# A generation that has just begun is expected to run at least this many more tokens: how far it
# has run says how far it will (a RAG answer stops after 20, a code edit runs to the limit), but the
# first tokens say nothing yet, and the shortest answers on recorded text run 13-20 tokens (dev.jsonl;
# 2 and 10 in the check set). Replay: the draft model's first use no longer waits for the answer to
# grow as long as the prompt's reading, where it pays: flat curve code edits 84.8% -> 86.0% of the
# oracle, RTX 3090 32B all 4.469x -> 4.507x (check set 3.415x -> 3.494x), CPU curves unchanged;
# 8-20 all gain, 4 and 24-32 lose on one curve or another.
LENGTH_PRIOR = 12
# The draft model's confidence (its top probability) says how likely its token is accepted; learned
# per bucket. Priors: how often the 0.5B's greedy token was the 1.5B's at each confidence on the
# recorded text (dev.jsonl's first 25 prompts, 2,500 positions: 0.32, 0.50, 0.71, 0.87, 0.88, 0.95,
# 0.99, 0.99), rounded down: a greedy token is right more often than its probability says.
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.01)
CONFIDENCE_PRIORS = (0.3, 0.5, 0.7, 0.85, 0.85, 0.93, 0.97, 0.98)
