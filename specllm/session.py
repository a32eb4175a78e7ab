"""Loading a target (and a draft) and building decoders for a speculation strategy.

This is the one place that turns user choices (paths, strategy, sizes) into engine objects;
the CLI, the chat loop and the benchmark all come through here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from specllm import ggufinfo
from specllm.backend import LlamaBackend, LoadOptions
from specllm.decode import Decoder, fixed_budget
from specllm.drafters import ChainDrafter, ModelDrafter, NgramDrafter
from specllm.errors import SpecllmError, UsageError

STRATEGIES = ("auto", "off", "ngram", "draft", "ngram+draft")
VOCAB_SIZE_TOLERANCE = 128  # as llama.cpp's speculative example allows
VOCAB_CHECK_START = 5  # ids below this are control tokens that families renumber freely


@dataclass(frozen=True)
class SpecConfig:
    strategy: str = "auto"
    draft_max: int = 8
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
        return self.strategy in ("auto", "draft", "ngram+draft")


@dataclass(frozen=True)
class ModelPaths:
    target: Path
    draft: Path | None = None


class Engine:
    """A loaded target (and optional draft model), ready to hand out decoders."""

    def __init__(self, paths: ModelPaths, spec: SpecConfig, target_options: LoadOptions, draft_options: LoadOptions):
        self.spec = spec.validate()
        target_info = ggufinfo.inspect(paths.target)
        draft_info = None
        if paths.draft is not None and spec.uses_draft_model:
            draft_info = ggufinfo.inspect(paths.draft)
            check_vocab_metadata(target_info, draft_info)
        if spec.strategy == "draft" and draft_info is None:
            raise UsageError("--spec draft needs a draft model: pass --draft PATH or a preset that has one")
        self.target_info, self.draft_info = target_info, draft_info
        self.target = LlamaBackend(paths.target, target_options)
        self.draft = None
        if draft_info is not None:
            self.draft = LlamaBackend(paths.draft, replace(draft_options, n_ctx=self.target.n_ctx))
            if draft_info.tokens_digest != target_info.tokens_digest:
                check_vocab_texts(self.target, self.draft)

    def decoder(self, strategy: str | None = None) -> Decoder:
        """A fresh decoder (empty history, KV caches cleared) for a strategy."""
        strategy = strategy or self.spec.strategy
        spec = replace(self.spec, strategy=strategy).validate()
        self.target.rewind(0)
        if self.draft is not None:
            self.draft.rewind(0)
        drafters = []
        if strategy in ("auto", "ngram", "ngram+draft"):
            drafters.append(NgramDrafter(spec.ngram_min, spec.ngram_max))
        if strategy in ("auto", "draft", "ngram+draft") and self.draft is not None:
            drafters.append(ModelDrafter(self.draft, spec.draft_p_min, self.target.n_vocab))
        if strategy == "draft" and self.draft is None:
            raise UsageError("--spec draft needs a draft model: pass --draft PATH or a preset that has one")
        drafter = None if not drafters else drafters[0] if len(drafters) == 1 else ChainDrafter(drafters)
        return Decoder(self.target, drafter, fixed_budget(spec.draft_max))

    def close(self) -> None:
        for model in (self.draft, self.target):
            if model is not None:
                model.close()


def check_vocab_metadata(target: ggufinfo.GGUFInfo, draft: ggufinfo.GGUFInfo) -> None:
    """Cheap checks from the headers: tokenizer type, special tokens, vocabulary size."""
    problem = None
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if target.metadata.get(key) != draft.metadata.get(key):
            problem = f"{key} differs ({target.metadata.get(key)} vs {draft.metadata.get(key)})"
            break
    if problem is None and abs(target.n_tokens - draft.n_tokens) > VOCAB_SIZE_TOLERANCE:
        problem = f"vocabulary sizes differ ({target.n_tokens} vs {draft.n_tokens})"
    if problem:
        raise SpecllmError(f"draft {draft.path.name} does not share the tokenizer of target {target.path.name}: {problem}")


def check_vocab_texts(target: LlamaBackend, draft: LlamaBackend) -> None:
    """Token texts must agree on every id both vocabularies have."""
    for token in range(VOCAB_CHECK_START, min(target.n_vocab, draft.n_vocab)):
        if target.token_text(token) != draft.token_text(token):
            raise SpecllmError(
                f"draft {draft.path.name} does not share the tokenizer of target {target.path.name}: "
                f"token {token} is {target.token_text(token)!r} vs {draft.token_text(token)!r}"
            )
