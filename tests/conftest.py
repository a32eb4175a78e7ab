"""Shared fixtures: tiny generated GGUFs, and real models fetched through the project's own code.

Real models come from `specllm.models.store.resolve_model` (the verified cache, downloading on first
use). A failed fetch is an error in the test, never a skip: a real-model test that silently
skips is a gap, not a pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specllm.models.store import resolve_model
from tests.tiny_gguf import write_tiny_gguf

DRAFT_NOISE = 0.1  # the tiny draft's weights: the target's plus this much noise (partial agreement)


def pytest_configure(config):
    config.addinivalue_line("markers", "real: uses real GGUF models fetched into the cache (slow)")


def _fetch(name: str) -> Path:
    return resolve_model(name)  # raises SpecllmError (the test errors) when it cannot be fetched


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _fetch("smollm2-135m")


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    """(target, draft): the default preset's Qwen2.5-Coder 1.5B and 0.5B."""
    return _fetch("qwen2.5-coder-1.5b"), _fetch("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-gguf")


@pytest.fixture(scope="session")
def tiny_pair(tiny_dir, smollm2_path) -> tuple[Path, Path]:
    """(target, draft): tiny random models sharing SmolLM2's tokenizer; the draft mostly agrees."""
    target = write_tiny_gguf(tiny_dir / "tiny-target.gguf", 0, tokenizer_from=smollm2_path)
    draft = write_tiny_gguf(
        tiny_dir / "tiny-draft.gguf", 1, tokenizer_from=smollm2_path, base_seed=0, noise=DRAFT_NOISE
    )
    return target, draft
