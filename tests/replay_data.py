"""The recordings and cost curves that scripts/replay_policy.py and replay_session.py are checked on
(shared by test_replay_script.py, test_replay_session.py and test_scripts_input.py): `DATA`, the
folder under tests/ that holds them, and the curves' file names: `CHECKED_CURVES` (those the check
set's promise is held to), `CPU_CURVES` (every CPU curve) and `CURVES` (all, the 7B-shaped
target's, `SEVEN_B`, last).
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
# The recordings: plain greedy text of the default pair on all 62 prompts of dev.jsonl (-n 128), with
# what the draft model proposes after every position (`replay_policy.py record`), and the same for
# the check set (`check-prompts.jsonl`: 52 prompts of the workload's kinds that are not in it).
# The curves: the machine the policy was validated on, a measured 2-core AVX2 CPU, a synthetic flat
# GPU curve, the same machine on a steeper day whose curve is not monotone (a batch of 16 cheaper
# than 12 to 15), another 2-core AVX2 CPU, steeper still (a batch of 16 at 8.7 tokens), and a 2-core
# Xeon with AMX, whose curves no constant was tuned on: as specllm loads models there (llama.cpp's
# repacked layouts, its AMX ones left out), and with no extra buffer types at all (where AMX cannot
# be left out alone): dear at first (a batch of 2 at 1.33 tokens, 4 at 2.09), then nearly flat (16
# at 3.36, 32 at 4.73); and the same Xeon with `--exact`'s batch-invariant kernels, the steepest
# (16 at 5.99, 32 at 11.8); then a 2-core AMD EPYC of the Zen 2 family (AVX2), as its first run
# calibrated it and as one bench's passes refined it (dearer batches beside one token: 2 at 1.64
# tokens, 16 at 7.32), and calibrated again that evening on a steady machine (2 at 1.45, 16 at 6.56);
# then another 2-core Xeon, whose VM shows AVX-512 but no AMX (llama.cpp's repacked AVX-512 layouts):
# a batch of 3 dearer than 4 (1.94 and 1.62 tokens), 16 at 3.94, the draft step 0.54 of a pass.
# Last, a 7B-shaped target (`scripts/gguf_twin.py`) with the 0.5B on the 2-core
# AVX2 EPYC: a pass 0.21 s, the draft step 0.12 of one, the only curve where the draft model pays
# but not at its prior (it needs about 0.8 acceptance), so only a target sure of itself brings it in.
# The recordings also keep the target's top probability on every generated token (what `auto`
# reads of how sure it is).
SEVEN_B = "epyc-avx2-2core-7b-shaped-twin.json"
CHECKED_CURVES = (
    "this-machine-avx512-2core.json",
    "zen3-avx2-2core.json",
    "this-machine-avx512-2core-2026-12-04.json",
    "epyc-avx2-2core-2026-12-04.json",
    "xeon-amx-2core-repack-2026-12-05.json",
    "xeon-amx-2core-exact-2026-12-05.json",
    "epyc-zen2-avx2-2core-2026-12-06.json",
    "epyc-zen2-avx2-2core-2026-12-06-learned.json",
    "epyc-zen2-avx2-2core-2026-12-06-evening.json",
    "xeon-avx512-2core-2026-12-07.json",
)
CPU_CURVES = (*CHECKED_CURVES, "xeon-amx-2core-2026-12-05.json")
CURVES = (*CPU_CURVES, "flat-gpu-synthetic.json", SEVEN_B)
