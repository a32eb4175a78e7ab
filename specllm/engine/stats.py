"""Statistics as a reducer over decode events: no I/O, no clocks of its own."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from specllm.engine.decode import Done, PrefillDone, StepDone, TokenCommitted


@dataclass
class SourceStats:
    steps: int = 0  # target passes that verified a draft from this source
    drafted: int = 0
    accepted: int = 0
    lengths: dict[int, int] = field(default_factory=dict)  # draft length chosen -> how many steps

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefill_seconds: float = 0.0
    tokens: int = 0  # generated tokens committed
    committed: int = 0  # tokens the passes chose: the generated ones and an end-of-generation token
    target_passes: int = 0
    draft_steps: int = 0  # target passes that verified a draft: one each, however many sources the draft mixed
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0  # generation wall time (prefill apart)
    draft_seconds: float = 0.0
    model_seconds: float = 0.0  # the part of draft_seconds spent in the draft model
    verify_seconds: float = 0.0
    by_source: dict[str, SourceStats] = field(default_factory=dict)
    # position i: [drafted tokens at position i, accepted tokens at position i]
    per_position: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None

    def update(self, event) -> "Stats":
        if isinstance(event, StepDone):
            self._step(event)
        elif isinstance(event, TokenCommitted):
            self.tokens += event.token >= 0
        elif isinstance(event, PrefillDone):
            self.prompt_tokens += event.prompt_tokens
            self.reused_tokens += event.reused_tokens
            self.prefill_seconds += event.seconds
        elif isinstance(event, Done):
            self.finish_reason = event.finish_reason
        return self

    def _step(self, step: StepDone) -> None:
        self.target_passes += 1
        self.committed += step.committed
        self.seconds += step.seconds
        self.draft_seconds += step.draft_seconds
        self.model_seconds += step.model_seconds
        self.verify_seconds += step.verify_seconds
        if not step.drafted:
            return
        self.draft_steps += 1
        self.drafted += step.drafted
        self.accepted += step.accepted
        for name, drafted, accepted in _parts(step):
            source = self.by_source.setdefault(name, SourceStats())
            source.steps += 1
            source.drafted += drafted
            source.accepted += accepted
            source.lengths[drafted] = source.lengths.get(drafted, 0) + 1
        while len(self.per_position) < step.drafted:
            self.per_position.append([0, 0])
        for i in range(step.drafted):
            self.per_position[i][0] += 1
            self.per_position[i][1] += i < step.accepted

    def merge(self, other: "Stats") -> "Stats":
        """Add another generation's statistics to these (a benchmark's runs of one strategy)."""
        for name in (f.name for f in fields(self)):
            value = getattr(other, name)
            if isinstance(value, (int, float)):  # the counts and seconds; not the finish reason
                setattr(self, name, getattr(self, name) + value)
        for name, source in other.by_source.items():
            mine = self.by_source.setdefault(name, SourceStats())
            mine.steps += source.steps
            mine.drafted += source.drafted
            mine.accepted += source.accepted
            for length, count in source.lengths.items():
                mine.lengths[length] = mine.lengths.get(length, 0) + count
        for i, (drafted, accepted) in enumerate(other.per_position):
            if i == len(self.per_position):
                self.per_position.append([0, 0])
            self.per_position[i][0] += drafted
            self.per_position[i][1] += accepted
        return self

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def undrafted_passes(self) -> int:
        """Plain passes: no draft to verify. (Not passes less the sources' steps: a draft `auto` mixed
        from both sources counts one step for each.)"""
        return self.target_passes - self.draft_steps

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target verify pass (1.0 for plain decoding: the pass that chose the end
        of the generation counts its token, not only its time)."""
        return self.committed / self.target_passes if self.target_passes else 0.0

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        by_source = {
            name: {"drafted": s.drafted, "accepted": s.accepted, "steps": s.steps, "lengths": dict(sorted(s.lengths.items()))}
            for name, s in sorted(self.by_source.items())
        }
        for name in ("ngram", "draft"):
            by_source.setdefault(name, {"drafted": 0, "accepted": 0, "steps": 0, "lengths": {}})
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tok_per_s": round(self.tok_per_s, 2),
            "target_passes": self.target_passes,
            "undrafted_passes": self.undrafted_passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "model_seconds": round(self.model_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "by_source": by_source,
            "per_position": [
                {"drafted": d, "accepted": a, "rate": round(a / d, 4) if d else 0.0} for d, a in self.per_position
            ],
            "finish_reason": self.finish_reason,
        }


def _parts(step) -> list[tuple[str, int, int]]:
    """(source, tokens drafted, tokens accepted) for each source of a step's draft: one, or where
    `auto` mixed them in one draft each source's share, so the draft model's tokens are counted as its own."""
    if not step.sources:
        return [(step.source, step.drafted, step.accepted)]
    parts: dict[str, list[int]] = {}
    for i, name in enumerate(step.sources):
        part = parts.setdefault(name, [0, 0])
        part[0] += 1
        part[1] += i < step.accepted
    return [(name, drafted, accepted) for name, (drafted, accepted) in parts.items()]
