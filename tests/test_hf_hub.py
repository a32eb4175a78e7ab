"""`hf:` names, split GGUFs and `--draft auto`, against a local hub server (tests/hubserver.py;
the fixtures that start it: tests/hub_helpers.py).

Everything lives under a temporary cache, Hugging Face home and config; the server listens on
127.0.0.1 and stops when each test ends. No test reaches the real hub.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specllm.errors import SpecllmError
from specllm.models import hfnames, hub, store, transfer
from specllm.models.hfnames import HfName, RemoteFile
from tests.cli_helpers import specllm_here
from tests.hub_helpers import REPO, SPLIT_REPO, home, local_hub, tiny  # noqa: F401 - fixtures


def cache_files(home: Path) -> list[str]:
    root = home / "cache" / "models"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`specllm ARGS` through its entry point in this process (specllm reads HF_ENDPOINT and the
    Hugging Face folders from the environment on each call, so the test's settings hold)."""
    return specllm_here(env or dict(os.environ), *args, timeout=120)


def cli_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m specllm ARGS` in a real process: the local hub reached from a process of its own."""
    return subprocess.run([sys.executable, "-m", "specllm", *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ), stdin=subprocess.DEVNULL)  # fmt: skip


# ---------------------------------------------------------------- names (no server)


def test_names_parse_and_pick_files():
    assert hfnames.parse("hf:Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M") == HfName("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF", quant="Q4_K_M")
    assert hfnames.parse("hf:org/repo@v2/sub/x.gguf") == HfName("org/repo", "v2", file="sub/x.gguf")
    for bad in ("hf:", "hf:repo", "hf:org/repo/x.bin", "hf:org/../x.gguf"):
        with pytest.raises(SpecllmError, match="is not a hub name"):
            hfnames.parse(bad)
    files = [RemoteFile(n, 1) for n in ("m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf", "m-Q4_K_S.gguf",
                                        "m-IQ4_K_M.gguf", "mmproj-Q4_K_M.gguf", "m-Q8_0.gguf")]  # fmt: skip
    assert [f.path for f in hfnames.select(HfName("o/r"), files)] == [files[0].path, files[1].path]  # Q4_K_M by default
    assert [f.path for f in hfnames.select(HfName("o/r", quant="q8_0"), files)] == ["m-Q8_0.gguf"]
    assert [f.path for f in hfnames.select(HfName("o/r", file=files[1].path), files)] == [files[0].path, files[1].path]
    with pytest.raises(SpecllmError, match="no GGUF file in the repository matches Q2_K"):
        hfnames.select(HfName("o/r", quant="Q2_K"), files)
    with pytest.raises(SpecllmError, match="lacks part"):
        hfnames.select(HfName("o/r"), files[:1])
    with pytest.raises(SpecllmError, match="several GGUF files match Q4"):
        hfnames.select(HfName("o/r", quant="Q4"), [RemoteFile("a-Q4.gguf", 1), RemoteFile("b-Q4.gguf", 1)])


# ---------------------------------------------------------------- downloads


def test_a_name_resolves_downloads_verifies_and_is_then_cached(home, local_hub, tiny):
    events = []
    path = store.resolve_model(f"hf:{REPO}:Q4_K_M", progress=lambda d, done, total: events.append((d, done, total)))
    assert path.read_bytes() == tiny["target"].read_bytes()
    assert cache_files(home) == ["hf/org/Tiny-GGUF/tiny-Q4_K_M.gguf", "hf/org/Tiny-GGUF/tiny-Q4_K_M.gguf.verified"]
    size = tiny["target"].stat().st_size
    assert (f"hf:{REPO}:Q4_K_M", size, size) in events  # the download bar reached its end
    asked = len(local_hub.requests)
    assert store.resolve_model(f"hf:{REPO}:Q4_K_M") == path  # from the cache: the hub is not asked
    assert store.resolve_model(f"hf:{REPO}/tiny-Q4_K_M.gguf") == path and len(local_hub.requests) == asked


def test_pull_of_a_name_through_the_cli(home, local_hub, tiny):
    done = cli_process("pull", f"hf:{REPO}:Q8_0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr.startswith(f"hf:{REPO}:Q8_0: ") and " ok  " in done.stderr
    assert (home / "cache/models/hf/org/Tiny-GGUF/tiny-Q8_0.gguf").read_bytes() == tiny["draft"].read_bytes()


def test_split_parts_are_all_fetched_and_the_model_loads(home, local_hub, tiny):
    assert len(tiny["parts"]) == 3
    path = store.resolve_model(f"hf:{SPLIT_REPO}:Q4_K_M")
    assert path.name == "tiny-Q4_K_M-00001-of-00003.gguf"
    assert [f for f in cache_files(home) if f.endswith(".gguf")] == [f"hf/{SPLIT_REPO}/{p.name}" for p in tiny["parts"]]
    assert len(local_hub.downloads(".gguf")) == 3
    # llama.cpp loads it from the first part with the others beside it, and it is the unsplit model
    split = cli("run", "-m", f"hf:{SPLIT_REPO}:Q4_K_M", "-p", "def add(a, b):", "-n", "8", "--temp", "0", "--spec", "off", "--raw")
    whole = cli("run", "-m", str(tiny["target"]), "-p", "def add(a, b):", "-n", "8", "--temp", "0", "--spec", "off", "--raw")
    assert split.returncode == 0 and whole.returncode == 0, split.stderr + whole.stderr
    assert split.stdout == whole.stdout and split.stdout


def test_a_split_preset_is_fetched_part_by_part_from_its_repository(home, local_hub, tiny):
    files = ", ".join(f'"{p.name}"' for p in tiny["parts"])
    (home / "models.toml").write_text(f'[[model]]\nname = "mine"\nhf_repo = "{SPLIT_REPO}"\nfiles = [{files}]\napprox_size = 1000\n')
    done = cli("pull", "mine")
    assert done.returncode == 0, done.stderr
    assert [f for f in cache_files(home) if f.endswith(".gguf")] == [p.name for p in tiny["parts"]]
    listing = cli("models", "--json")
    mine = next(m for m in __import__("json").loads(listing.stdout)["models"] if m["name"] == "mine")
    assert mine["cached"] and mine["verified_by"] == "the hub's LFS metadata" and len(mine["files"]) == 3
    offline = cli("run", "-m", "qwen2.5-coder-32b", "-p", "hi", env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 1 and offline.stderr.count("\n") == 1
    assert offline.stderr.startswith("Error: model 'qwen2.5-coder-32b' is not downloaded (3 of 3 file(s) missing, e.g. ")
    assert offline.stderr.rstrip().endswith("and HF_HUB_OFFLINE is set; run `specllm pull qwen2.5-coder-32b` with network")


@pytest.mark.parametrize("fault", ["corrupt", "truncate"])
def test_a_corrupt_or_truncated_file_is_refused_and_not_cached(home, local_hub, tiny, fault):
    if fault == "corrupt":
        local_hub.faults.corrupt.add("tiny-Q4_K_M.gguf")
        expected = "sha256 "
        detail = "does not match the hub's LFS metadata"
    else:
        local_hub.faults.truncate["tiny-Q4_K_M.gguf"] = 5000
        expected = "the hub served 5000 bytes, its metadata says "
        detail = str(tiny["target"].stat().st_size)
    done = cli("pull", f"hf:{REPO}:Q4_K_M")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"Error: {REPO}/tiny-Q4_K_M.gguf refused: {expected}") and detail in done.stderr
    assert done.stderr.rstrip().endswith("nothing was cached")
    assert cache_files(home) == []  # no file, no .part, no sidecar


def test_an_interrupted_download_resumes(home, local_hub, tiny):
    size = tiny["target"].stat().st_size
    local_hub.faults.drop["tiny-Q4_K_M.gguf"] = (size // 3, 1)  # the first answer breaks off at a third
    path = store.resolve_model(f"hf:{REPO}:Q4_K_M")
    assert path.read_bytes() == tiny["target"].read_bytes()
    first, resumed = [r for _, _, r in local_hub.downloads("tiny-Q4_K_M.gguf")]
    assert first is None and 0 < int(resumed.removeprefix("bytes=").rstrip("-")) <= size // 3


def test_a_download_broken_in_every_try_keeps_its_part_and_the_next_run_resumes(home, local_hub, tiny):
    size = tiny["target"].stat().st_size
    local_hub.faults.drop["tiny-Q4_K_M.gguf"] = (size // 2, 99)
    with pytest.raises(SpecllmError, match=r"broke off after \d+ of \d+ bytes .*run the same command again to resume"):
        store.resolve_model(f"hf:{REPO}:Q4_K_M")
    assert cache_files(home) == ["hf/org/Tiny-GGUF/tiny-Q4_K_M.gguf.part"]
    kept = (home / "cache/models/hf/org/Tiny-GGUF/tiny-Q4_K_M.gguf.part").stat().st_size
    assert 0 < kept <= size // 2
    local_hub.faults.drop.clear()
    local_hub.requests.clear()
    path = store.resolve_model(f"hf:{REPO}:Q4_K_M")
    assert path.read_bytes() == tiny["target"].read_bytes()
    assert [r for _, _, r in local_hub.downloads("tiny-Q4_K_M.gguf")] == [f"bytes={kept}-"]
    assert cache_files(home) == ["hf/org/Tiny-GGUF/tiny-Q4_K_M.gguf", "hf/org/Tiny-GGUF/tiny-Q4_K_M.gguf.verified"]


def test_hf_token_is_sent_and_a_gated_repository_says_what_to_do(home, local_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_for_tests")
    store.resolve_model(f"hf:{REPO}:Q4_K_M")
    assert local_hub.authorizations and set(local_hub.authorizations) == {"Bearer hf_secret_for_tests"}
    local_hub.gated.add(SPLIT_REPO)
    with pytest.raises(SpecllmError, match=f"^{SPLIT_REPO} is gated on the hub: accept its terms there, then set HF_TOKEN$"):
        store.resolve_model(f"hf:{SPLIT_REPO}:Q4_K_M")


def test_a_file_already_in_the_hugging_face_cache_is_linked_not_downloaded(home, local_hub, tiny):
    from tests.hubserver import COMMIT

    snapshot = home / "hf" / "hub" / "models--org--Tiny-GGUF" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "tiny-Q4_K_M.gguf").write_bytes(tiny["target"].read_bytes())
    path = store.resolve_model(f"hf:{REPO}:Q4_K_M")
    assert path.read_bytes() == tiny["target"].read_bytes() and local_hub.downloads(".gguf") == []
    assert path.stat().st_ino == (snapshot / "tiny-Q4_K_M.gguf").stat().st_ino  # one copy on disk


def test_a_resumed_part_linked_from_the_hugging_face_cache_never_writes_into_it(tmp_path):
    """A part adopted by a hard link from the Hugging Face cache, then short of the hub's file (changed
    since): the rest is appended to a copy of its own, and the cache's file stays as it was."""

    class Answer:
        status_code = 206

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def iter_bytes(self):
            yield b"-rest"

    client = SimpleNamespace(stream=lambda method, url, headers, follow_redirects, timeout: Answer())
    blob, part = tmp_path / "hf-blob", tmp_path / "model.gguf.part"
    blob.write_bytes(b"head")
    os.link(blob, part)
    transfer.download(client, "http://hub/file", {}, part, 9, lambda done: None, timeout=1.0, transient=(OSError,))
    assert part.read_bytes() == b"head-rest" and blob.read_bytes() == b"head"


def test_offline_mode_uses_the_cache_and_fails_in_one_line_without_it(home, local_hub, monkeypatch):
    store.resolve_model(f"hf:{REPO}:Q4_K_M")
    local_hub.requests.clear()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cached = cli("pull", f"hf:{REPO}:Q4_K_M", env=env)
    assert cached.returncode == 0 and local_hub.requests == [], cached.stderr
    missing = cli("run", "-m", f"hf:{REPO}:Q8_0", "-p", "hi", "-n", "2", env=env)
    assert missing.returncode == 1 and missing.stdout == "" and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith(f"Error: hf:{REPO}:Q8_0 is not in the cache (")
    assert "HF_HUB_OFFLINE is set" in missing.stderr and local_hub.requests == []


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("hf:org/nothing:Q4_K_M", "org/nothing: no such model repository on the hub (a private one needs HF_TOKEN)"),
        (f"hf:{REPO}:Q2_K", f"hf:{REPO}:Q2_K: no GGUF file in {REPO} matches Q2_K (GGUF files there: tiny-Q4_K_M.gguf, tiny-Q8_0.gguf)"),
        (f"hf:{REPO}/missing.gguf", f"hf:{REPO}/missing.gguf: {REPO} has no file missing.gguf"),
        (f"hf:{REPO}@v9:Q4_K_M", f"{REPO}: the hub has no revision 'v9'"),
    ],
)
def test_names_the_hub_cannot_answer_are_one_line(home, local_hub, name, message):
    done = cli("pull", name)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"Error: {message}"), done.stderr
    assert cache_files(home) == []


def test_an_unreachable_hub_is_one_line(home, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    done = cli("pull", f"hf:{REPO}:Q4_K_M")
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"Error: the hub (http://127.0.0.1:9) is unreachable for {REPO} (")


# ---------------------------------------------------------------- --draft auto


def place(home: Path, source: Path, repo: str) -> Path:
    """A model in the cache as an hf: download leaves it (file and sidecar)."""
    dest = hfnames.folder(home / "cache", HfName(repo)) / source.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(source.read_bytes())
    hub._write_sidecar(dest, "0" * 64)
    return dest


def test_draft_auto_picks_the_compatible_small_model(home, tiny):
    place(home, tiny["other"], "org/other-GGUF")
    place(home, tiny["draft"], "org/draft-GGUF")
    target = place(home, tiny["target"], "org/target-GGUF")
    done = cli("run", "-m", str(target), "--draft", "auto", "--spec", "ngram+draft", "-p", "hi", "-n", "4", "--temp", "0")
    assert done.returncode == 0, done.stderr
    line = next(ln for ln in done.stderr.splitlines() if ln.startswith("draft auto:"))
    assert line.startswith("draft auto: chose hf:org/draft-GGUF/draft.gguf: ") and "the same token list" in line


def test_draft_auto_refuses_an_incompatible_model_and_runs_on_the_ngram_cache(home, tiny):
    place(home, tiny["other"], "org/other-GGUF")
    done = cli("run", "-m", str(tiny["target"]), "--draft", "auto", "--spec", "ngram+draft", "-p", "hi", "-n", "4", "--temp", "0")
    assert done.returncode == 0, done.stderr
    assert "draft auto: no compatible draft model (hf:org/other-GGUF/other.gguf: vocabulary sizes differ " in done.stderr
    assert "; running with the n-gram cache alone" in done.stderr


# ---------------------------------------------------------------- the catalog


def test_the_gpu_presets_are_listed_with_size_hardware_and_every_part(home):
    import json

    listing = json.loads(cli("models", "--json").stdout)
    presets = {p["name"]: p for p in listing["presets"]}
    models = {m["name"]: m for m in listing["models"]}
    for size in ("7b", "14b", "32b"):
        preset = presets[f"qwen2.5-coder-{size}"]
        assert preset["draft"] == "qwen2.5-coder-0.5b" and "GPU with" in preset["hardware"]
    for size in ("8b", "14b", "32b"):
        assert presets[f"qwen3-{size}"]["draft"] == "qwen3-0.6b"
    big = models["qwen2.5-coder-32b"]
    assert [f.rsplit("-", 3)[-3:] for f in big["files"]] == [["00001", "of", "00003.gguf"], ["00002", "of", "00003.gguf"], ["00003", "of", "00003.gguf"]]
    assert big["sha256"] is None and big["verified_by"] == "the hub's LFS metadata" and not big["size_exact"]
    assert models["qwen2.5-coder-0.5b"]["verified_by"] == "pinned sha256"
    table = cli("models").stdout
    assert "GPU with 24 GB (RTX 3090/4090)" in table and "~18.95 GiB" in table


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('file = "m.gguf"\napprox_size = 5', "missing required field 'hf_repo' (an entry without 'sha256'"),
        ('hf_repo = "o/r"\nfile = "m.gguf"\nsize = 5', "'size' is the exact size of a pinned file: give 'sha256' too"),
        ('hf_repo = "o/r"\nfile = "m.gguf"', "missing required field 'approx_size'"),
        ('hf_repo = "o/r"\nfiles = ["a.gguf", "b.gguf"]\nsize = 4\nsha256 = "' + "ab" * 32 + '"', "a pinned 'sha256' needs a single 'file'"),
        ('hf_repo = "o/r"\nfile = "a.gguf"\nfiles = ["a.gguf"]\napprox_size = 5', "give either 'file' or 'files'"),
        ('hf_repo = "o/r"\nfiles = ["x/a.gguf"]\napprox_size = 5', "'file' must be a plain file name"),
    ],
)
def test_hub_verified_entries_are_checked_when_read(home, entry, message):
    (home / "models.toml").write_text(f'[[model]]\nname = "m"\n{entry}\n')
    done = cli("models")
    assert done.returncode == 1 and message in done.stderr and done.stderr.count("\n") == 1
