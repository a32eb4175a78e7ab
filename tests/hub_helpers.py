"""A local stand-in for the Hugging Face hub (tests/hubserver.py) serving tiny models, shared by
test_hf_hub.py and test_model_cache.py, which import its fixtures: `tiny` (a target, the same
target split in parts, a compatible and an incompatible small model), `home` (a temporary cache,
Hugging Face home and config, nothing offline) and `local_hub` (the server, holding `REPO`'s files
and `SPLIT_REPO`'s parts, stopped when the test ends).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from unittest import mock

import gguf
import pytest

from specllm.models import store, transfer
from tests.hubserver import LocalHub
from tests.tiny_gguf import write_tiny_gguf

REPO, SPLIT_REPO = "org/Tiny-GGUF", "org/Tiny-Split-GGUF"


def write_tiny(path: Path, seed: int, **kwargs) -> Path:
    """tiny_gguf's model; where that version still needs a real tokenizer, SmolLM2's from the cache."""
    if inspect.signature(write_tiny_gguf).parameters["tokenizer_from"].default is inspect.Parameter.empty:
        kwargs["tokenizer_from"] = store.resolve_model("smollm2-135m")
    return write_tiny_gguf(path, seed, **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A target, the same target split in 3 parts, a compatible small draft, an incompatible small model."""
    root = tmp_path_factory.mktemp("hf-tiny")
    out = {
        "target": write_tiny(root / "target.gguf", 0),
        "draft": write_tiny(root / "draft.gguf", 1, width=16, n_heads=2, n_ff=32),
        "other": write_tiny(root / "other.gguf", 2, width=16, n_heads=2, n_ff=32, drop_last_tokens=1000),
    }
    split_dir = root / "split"
    split_dir.mkdir()

    class SplitWriter(gguf.GGUFWriter):  # gguf-py writes NAME-0000k-of-0000n.gguf with split.* keys
        def __init__(self, path, arch, **kwargs):
            super().__init__(path, arch, split_max_tensors=8, **kwargs)

    with mock.patch.object(gguf, "GGUFWriter", SplitWriter):
        write_tiny(split_dir / "tiny-Q4_K_M.gguf", 0)
    out["parts"] = sorted(split_dir.glob("*.gguf"))
    return out


@pytest.fixture
def home(tmp_path, monkeypatch):
    import huggingface_hub.constants

    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SPECLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECLLM_CONFIG", str(tmp_path / "models.toml"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "models.toml").write_text("")
    # huggingface_hub reads these once, at import: an earlier test may have imported it offline
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return tmp_path


@pytest.fixture
def local_hub(home, monkeypatch, tiny):
    monkeypatch.setattr(transfer, "RETRY_PAUSE", 0.0)  # the retries are the claim, not their pacing
    server = LocalHub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    server.add(REPO, "tiny-Q4_K_M.gguf", tiny["target"].read_bytes())
    server.add(REPO, "tiny-Q8_0.gguf", tiny["draft"].read_bytes())
    server.add(REPO, "README.md", b"# tiny\n", lfs=False)
    for part in tiny["parts"]:
        server.add(SPLIT_REPO, part.name, part.read_bytes())
    yield server
    server.stop()
