"""Loading a target (and a draft) and building decoders for a speculation strategy.

This is the one place that turns user choices (paths, strategy, sizes) into engine objects;
the CLI, the chat loop and the benchmark all come through here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

from specllm.backend import DeferredBackend, LlamaBackend, LoadOptions, system_info
from specllm.chat import encode_messages, encode_raw, thinking_variables
from specllm.engine.auto import auto_drafter
from specllm.costs_cache import load_costs, load_learned, save_costs, save_learned
from specllm.engine.costmodel import CALIBRATION_METHOD, CostModel, batch_sizes, measure_costs
from specllm.engine.decode import Decoder, all_the_room, fixed_budget
from specllm.engine.drafters import ChainDrafter, ModelDrafter, NgramDrafter
from specllm.engine.ngram import ends_sentence
from specllm.errors import SpecllmError, UsageError
from specllm.models import gguf, hfnames

STRATEGIES = ("auto", "off", "ngram", "draft", "ngram+draft")
DRAFT_STRATEGIES = ("draft", "ngram+draft", "auto")  # the strategies that load a draft model (where one is given)
VOCAB_SIZE_TOLERANCE = 128  # as llama.cpp's speculative example allows
VOCAB_CHECK_START = 5
AUTO_MAX_BATCH = 32  # auto drafts up to AUTO_MAX_BATCH - 1 tokens: the calibrated range
DRAFT_AUTO_MAX_SHARE = 0.5  # --draft auto: a draft of at most half the target's bytes (a bigger one rarely pays)


@dataclass(frozen=True)
class SpecConfig:
    strategy: str = "auto"
    draft_max: int = 8  # for the fixed strategies; auto sizes drafts itself, up to AUTO_MAX_BATCH - 1
    draft_p_min: float = 0.6
    ngram_min: int = 2
    ngram_max: int = 4

    def validate(self) -> "SpecConfig":
        if self.strategy not in STRATEGIES:
            raise UsageError(f"--spec must be one of {', '.join(STRATEGIES)}; got {self.strategy!r}")
        if not 1 <= self.draft_max <= 256:
            raise UsageError(f"--draft-max must be between 1 and 256, got {self.draft_max}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise UsageError(f"--draft-p-min must be between 0 and 1, got {self.draft_p_min}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 32:
            raise UsageError(
                f"n-gram sizes need 1 <= --ngram-min <= --ngram-max <= 32, got {self.ngram_min} and {self.ngram_max}"
            )
        return self

    @property
    def uses_draft_model(self) -> bool:
        return self.strategy in DRAFT_STRATEGIES


@dataclass(frozen=True)
class ModelPaths:
    target: Path
    draft: Path | None = None


class Engine:
    """A loaded target (and optional draft model), ready to hand out decoders."""

    def __init__(
        self,
        paths: ModelPaths,
        spec: SpecConfig,
        target_options: LoadOptions,
        draft_options: LoadOptions,
        cost_cache: Path | None = None,
    ):
        self.spec = spec.validate()
        self.cost_cache = cost_cache
        target_info = gguf.inspect(paths.target)
        draft_info = None
        if paths.draft is not None and spec.uses_draft_model:
            draft_info = gguf.inspect(paths.draft)
            check_vocab_metadata(target_info, draft_info)
        if spec.strategy == "draft" and draft_info is None:
            raise UsageError("--spec draft needs a draft model: pass --draft PATH or a preset that has one")
        self.target_info, self.draft_info = target_info, draft_info
        self._costs: CostModel | None = None
        self._learned: CostModel | None = None
        self.learned_before = 0  # passes the learned curve had folded in when this engine took it from the cache
        self._learned_key = ""  # the cache entry it was taken from (and goes back to)
        self.target = LlamaBackend(paths.target, target_options)
        # the largest verification: with exact kernels, the largest whose rows equal single tokens'
        self.max_batch = min(AUTO_MAX_BATCH, self.target.exact_batch or AUTO_MAX_BATCH)
        self.draft: DeferredBackend | None = None
        if draft_info is not None:
            # `auto` loads the draft model when it first consults it, and on most CPUs that is never
            self.draft = DeferredBackend(paths.draft, replace(draft_options, n_ctx=self.target.n_ctx))
            try:
                if draft_info.tokens_digest != target_info.tokens_digest:
                    check_vocab_texts(self.target, self.draft.load())
                if spec.strategy != "auto":
                    self.draft.load()  # the fixed strategies draft with it from the first step
            except BaseException:  # a draft that fails to load or to match frees the target now, not at exit
                self.close()
                raise

    def encode(self, text: str, system: str | None = None, raw: bool = False, think: bool = True) -> list[int]:
        """A user prompt as target tokens: through the chat template, or as is with `raw`;
        `think` False asks a thinking model to answer at once (`--no-think`)."""
        if raw:
            return encode_raw(self.target, (system + "\n\n" if system else "") + text)
        # an empty system prompt is one: the template's default (Qwen's "You are Qwen...") is left out
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]
        return encode_messages(self.target, messages, variables=thinking_variables(self.target, think))

    def costs(self) -> CostModel:
        """This machine's cost curve for these models: from the cost cache when it matches, else measured."""
        if not self.costs_known():
            self._costs = measure_costs(self.target, self.draft.load() if self.draft else None, max_batch=self.max_batch)
            if self._costs.steady:  # a curve timed while other work shared the cores serves this run only
                save_costs(self.cost_cache, self._cost_key(self.max_batch), self._costs)
        return self._costs

    def learned_costs(self) -> CostModel:
        """The curve `auto` decides by: the calibrated one, refined by every pass its decoders time
        (a bench's runs, a chat's turns, a server's requests), and by earlier processes' passes where
        they kept what they learned in the cache (`keep_learned`).

        Calibration times each size a few times in three minutes, and two calibrations of one machine
        differ by 10-15% on some sizes; `auto` drafts to whichever sizes look cheap, so it meets exactly
        the sizes calibration underpriced by chance (2-core EPYC, 2026-12-04: a batch of 32 at 14.5
        single passes in the run's calibration, 16.0-18.1 in four others, and drafted to 74 times in
        code edits). Learned within one generation only, that is forgotten at the next; within one
        process only, a user's one-prompt `run`s never gather enough passes to correct it."""
        if self._learned is None:
            calibrated, self._learned_key = self.costs(), self._cost_key(self.max_batch)
            self._learned = load_learned(self.cost_cache, self._learned_key, calibrated) or calibrated.copy()
            self.learned_before = self._learned.passes
        return self._learned

    def keep_learned(self) -> None:
        """Keep what this engine's passes taught the curve in the cache, beside the calibration it
        grew from, for the next process to start from (nothing where no pass was timed, or the
        calibration is not the cache's: measured on a busy machine, or measured again meanwhile).
        A size the passes made too dear is avoided and stays so, which costs a little speed; one
        made too cheap is drafted to, and its passes correct it."""
        if self._learned is not None and self._learned.passes > self.learned_before:
            save_learned(self.cost_cache, self._learned_key, self._costs, self._learned)

    def costs_known(self) -> bool:
        """Whether `costs` can answer without measuring: held already, or cached for this machine and
        these models (then loaded, to be held)."""
        sizes = batch_sizes(self.max_batch, self.target.n_ctx)
        if self._costs is None or max(self._costs.batch_seconds) < sizes[-1]:
            cached = load_costs(self.cost_cache, self._cost_key(self.max_batch))
            # a calibration times every size: one without them all is damaged, and measured again
            self._costs = cached if cached is not None and set(sizes) <= cached.batch_seconds.keys() else None
        return self._costs is not None

    def _cost_key(self, max_batch: int) -> str:
        parts = [self.target_info, self.draft_info]
        files = [f"{info.path.name}:{info.size}:{info.path.stat().st_mtime_ns}" for info in parts if info is not None]
        largest = batch_sizes(max_batch, self.target.n_ctx)[-1]  # a small context times fewer sizes
        if self.target.exact:  # their own KV types, flash attention and batch limit: a curve of their own
            kernels = ["exact kernels"]
        elif self.target.flash_attn != "auto":  # attention's cost at depth, a batch's most (a 2-core EPYC: 16 tokens after 3,072, 810 ms on, 546 off)
            kernels = [f"flash attention {self.target.flash_attn}"]
        else:
            kernels = []
        return "|".join(files + [f"threads={self.target.n_threads}", f"ngl={self.target.n_gpu_layers}", f"max={largest}", CALIBRATION_METHOD, system_info()] + kernels)

    def decoder(self, strategy: str | None = None) -> Decoder:
        """A fresh decoder (empty history, KV caches cleared) for a strategy. Decoders of one engine
        share its models: one that finds the KV caches changed by another reads its history again
        (the same text, at the cost of that reading). Under `auto`, the first decoder measures this
        machine's cost curve (minutes) unless `cost_cache` holds one for these models."""
        spec = replace(self.spec, strategy=strategy or self.spec.strategy).validate()
        if spec.strategy == "draft" and self.draft is None:
            raise UsageError("--spec draft needs a draft model: pass --draft PATH or a preset that has one")
        self.target.rewind(0)
        if self.draft is not None:
            self.draft.rewind(0)
        if spec.strategy == "auto":
            usable = self.draft is not None and self.draft.error is None  # a draft model that failed to load is not tried again
            model = ModelDrafter(self.draft, spec.draft_p_min, self.target.n_vocab, self.target.is_eog) if usable else None
            drafter = auto_drafter(
                self.learned_costs(),  # refined in place: what the passes teach it is kept (`keep_learned`)
                self.max_batch - 1,
                (spec.ngram_min, spec.ngram_max),
                model,
                self.target.is_eog,
                functools.cache(lambda token: ends_sentence(self.target.token_bytes(token))),
            )
            return Decoder(self.target, drafter, all_the_room)
        ngram = NgramDrafter(spec.ngram_min, spec.ngram_max, self.target.is_eog)
        model = ModelDrafter(self.draft.load(), spec.draft_p_min, self.target.n_vocab, self.target.is_eog) if self.draft and spec.uses_draft_model else None
        drafters = {
            "off": [],
            "ngram": [ngram],
            "draft": [model],
            "ngram+draft": [ngram, model] if model else [ngram],
        }[spec.strategy]
        drafter = ChainDrafter(drafters) if len(drafters) > 1 else drafters[0] if drafters else None
        return Decoder(self.target, drafter, fixed_budget(min(spec.draft_max, self.max_batch - 1)))

    def close(self) -> None:
        """Free the models; using them afterwards (this engine, its decoders) raises `SpecllmError`."""
        for model in (self.draft, self.target):
            if model is not None:
                model.close()


def check_vocab_metadata(target: gguf.GGUFInfo, draft: gguf.GGUFInfo) -> None:
    """Cheap checks from the headers: tokenizer type, special tokens, vocabulary size."""
    problem = None
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if target.metadata.get(key) != draft.metadata.get(key):
            problem = f"{key} differs (target {target.metadata.get(key)}, draft {draft.metadata.get(key)})"
            break
    if problem is None and abs(target.n_tokens - draft.n_tokens) > VOCAB_SIZE_TOLERANCE:
        problem = f"vocabulary sizes differ (target {target.n_tokens}, draft {draft.n_tokens})"
    if problem:
        raise SpecllmError(f"draft {draft.path.name} does not share the tokenizer of target {target.path.name}: {problem}")


def check_vocab_texts(target: LlamaBackend, draft: LlamaBackend) -> None:
    """Token texts must agree on every id both vocabularies have."""
    for token in range(VOCAB_CHECK_START, min(target.n_vocab, draft.n_vocab)):
        if target.token_text(token) != draft.token_text(token):
            raise SpecllmError(
                f"draft {draft.path.name} does not share the tokenizer of target {target.path.name}: "
                f"token {token} is {target.token_text(token)!r} in the target, {draft.token_text(token)!r} in the draft"
            )


@dataclass(frozen=True)
class DraftChoice:
    path: Path | None
    reason: str


def pick_draft(target: Path, candidates: list[tuple[str, Path, bool]]) -> DraftChoice:
    """`--draft auto`: of (label, path, paired by a preset) candidates, one whose vocabulary passes the
    same header check as `--draft` and which is much smaller; the preset's pairing first, then an
    identical token list, then the smallest. Candidates that do not fit are named in the reason."""
    target_info, target_size = gguf.inspect(target), hfnames.bytes_on_disk(target)
    fits, refused = [], []
    for label, path, paired in candidates:
        if path.resolve() == Path(target).resolve():
            continue
        try:
            info = gguf.inspect(path)
            check_vocab_metadata(target_info, info)
        except SpecllmError as exc:
            refused.append(f"{label}: {str(exc).rsplit(': ', 1)[-1]}")
            continue
        size = hfnames.bytes_on_disk(path)
        if size > DRAFT_AUTO_MAX_SHARE * target_size:
            refused.append(f"{label}: not much smaller ({size / target_size:.2f} of the target's size)")
            continue
        same = info.tokens_digest == target_info.tokens_digest
        fits.append((not paired, not same, size, label, path, info.n_tokens))
    if not fits:
        return DraftChoice(None, f"no compatible draft model ({'; '.join(refused) or 'none in the presets or the cache'})")
    not_paired, not_same, size, label, path, n_tokens = min(fits)
    vocabulary = "the same token list" if not not_same else "a compatible vocabulary"
    why = f"{label}: {size / 2**30:.2f} GiB, {size / target_size:.2f} of the target's size, {vocabulary} ({n_tokens} tokens)"
    return DraftChoice(path, why + ("; the preset pairs them" if not not_paired else ""))


