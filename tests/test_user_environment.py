"""The user's environment as `specllm` reads it: the cache and config locations (SPECLLM_*, XDG_*,
HOME), the Hugging Face cache variables, a models.toml as editors and users write it, and a cost
cache edited by hand. Everything lives in a temporary folder; the hub is tests/hubserver.py."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import pytest

from specllm import costs_cache
from specllm.errors import SpecllmError
from specllm.models import catalog, hub, store
from tests.cli_helpers import specllm_here

SHA = "ab" * 32


@pytest.fixture
def env(tmp_path, monkeypatch) -> dict:
    """A `specllm` process's environment: its own home, cache and config; Hugging Face offline."""
    for key in ("SPECLLM_CONFIG", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HF_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return dict(os.environ)


def cli(env: dict, *args: str):
    return specllm_here(env, *args, timeout=60)


def one_error_line(done) -> str:
    assert done.returncode == 1 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("Error: ") and "a bug" not in done.stderr, done.stderr
    return done.stderr[len("Error: ") :].strip()


# ---------------------------------------------------------------- locations


def test_relative_xdg_folders_are_ignored_as_the_specification_says(env, tmp_path, monkeypatch):
    """XDG base directory specification: "If an implementation encounters a relative path in any of
    these variables it should consider the path invalid and ignore it"; ~/.cache and ~/.config serve."""
    monkeypatch.delenv("SPECLLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-cache")
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative-config")
    assert catalog.cache_dir() == tmp_path / "home" / ".cache" / "specllm"
    assert catalog.user_config_path() == tmp_path / "home" / ".config" / "specllm" / "models.toml"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # an absolute one is used
    monkeypatch.setenv("XDG_CONFIG_HOME", "~/conf")  # `~` is the home folder, as a shell would make it
    assert catalog.cache_dir() == tmp_path / "xdg" / "specllm"
    assert catalog.user_config_path() == tmp_path / "home" / "conf" / "specllm" / "models.toml"


@pytest.mark.parametrize("variable", ["SPECLLM_CACHE", "SPECLLM_CONFIG", "XDG_CACHE_HOME"])
def test_a_tilde_of_no_user_is_one_line_naming_the_variable(env, variable):
    if variable == "XDG_CACHE_HOME":
        del env["SPECLLM_CACHE"]
    env[variable] = "~specllm-no-such-user-4711/x"
    message = one_error_line(cli(env, "models"))
    assert message == (
        f"{variable} is '~specllm-no-such-user-4711/x', but there is no user 'specllm-no-such-user-4711' "
        "to expand '~specllm-no-such-user-4711' to"
    )


def test_no_home_folder_at_all_is_one_line_saying_what_to_set(env, monkeypatch):
    """HOME unset and no password entry (a container run with a user id of its own): no traceback."""

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    del env["HOME"], env["SPECLLM_CACHE"]
    message = one_error_line(cli(env, "models"))
    assert message.startswith("cannot find the home folder (HOME is not set") and "set HOME" in message
    env["SPECLLM_CACHE"], env["SPECLLM_CONFIG"] = "/nonexistent-cache", ""  # named folders need no home
    env["XDG_CONFIG_HOME"] = "/nonexistent-config"
    assert cli(env, "models", "--json").returncode == 0


# ---------------------------------------------------------------- models.toml


def user_file(env: dict, tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "my models.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    env["SPECLLM_CONFIG"] = str(path)
    return path


def test_a_byte_order_mark_before_models_toml_is_dropped(env, tmp_path):
    """Notepad and PowerShell save UTF-8 with a byte-order mark, which TOML does not allow."""
    user_file(env, tmp_path, b'\xef\xbb\xbfdefault = "smollm2-135m"\r\n')
    done = cli(env, "models", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["default"] == "smollm2-135m"


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-7B", "mine.gguf", "hf:me/mine", "a\\b"])
def test_a_name_that_minus_m_would_read_as_a_path_or_an_hf_name_is_refused(env, tmp_path, name):
    """`run -m Qwen/Qwen2.5-7B` said "model file not found" while `pull Qwen/Qwen2.5-7B` fetched it."""
    path = user_file(env, tmp_path, f'[[preset]]\nname = {json.dumps(name)}\ntarget = "smollm2-135m"\n')
    message = one_error_line(cli(env, "models"))
    assert message.startswith(f"{path}: preset #1 ('{name}'): name '{name}' would be read as a path or an hf: name by -m")


def test_a_user_model_named_like_a_preset_of_another_target_is_refused_and_rm_deletes_nothing(env, tmp_path):
    """A model named `qwen2.5-coder` could never be used (the preset of that name comes first), and
    `rm qwen2.5-coder`, meant for it, deleted the preset's target and draft."""
    path = user_file(env, tmp_path, f'[[model]]\nname = "qwen2.5-coder"\nfile = "mine.gguf"\nsize = 4\nsha256 = "{SHA}"\n')
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    target = models / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    target.write_bytes(b"kept")
    message = one_error_line(cli(env, "rm", "qwen2.5-coder"))
    assert message == (
        f"{path}: model 'qwen2.5-coder' has the name of preset 'qwen2.5-coder' (target 'qwen2.5-coder-1.5b'), "
        "which -m, pull and rm take first; rename the model"
    )
    assert target.read_bytes() == b"kept"
    # a model that replaces the one a preset of its name targets is what the README promises
    user_file(env, tmp_path, f'[[model]]\nname = "smollm2-135m"\nfile = "mine.gguf"\nsize = 4\nsha256 = "{SHA}"\n')
    assert cli(env, "models").returncode == 0


def test_rm_of_hf_names_needs_no_registry_as_pull_does(env, tmp_path):
    user_file(env, tmp_path, "default = \n")  # a mistake in the user's file
    folder = tmp_path / "cache" / "models" / "hf" / "org" / "Tiny-GGUF"
    folder.mkdir(parents=True)
    (folder / "tiny-Q4_K_M.gguf").write_bytes(b"GGUF")
    done = cli(env, "rm", "hf:org/Tiny-GGUF:Q4_K_M")
    assert done.returncode == 0 and "hf:org/Tiny-GGUF:Q4_K_M: removed 4 B" in done.stderr, done.stderr
    assert not (folder / "tiny-Q4_K_M.gguf").exists()
    assert one_error_line(cli(env, "rm", "smollm2-135m")).startswith(f"{tmp_path / 'my models.toml'}: invalid TOML")


# ---------------------------------------------------------------- the Hugging Face cache


@pytest.fixture
def online_hub(env, monkeypatch):
    """A local Hugging Face hub that HF_ENDPOINT names, with the test session's offline switch off
    (huggingface_hub reads it once, at import); stopped afterwards."""
    import huggingface_hub.constants

    from tests.hubserver import LocalHub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    server = LocalHub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.stop()


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_hugging_face_cache_variables_are_expanded_as_huggingface_hub_expands_them(env, tmp_path, monkeypatch, online_hub, variable):
    """`HF_HUB_CACHE=~/hub` (or `$VAR` in it) names the folder huggingface_hub downloads into: a file
    there is linked into specllm's cache, not downloaded again."""
    from tests.hubserver import COMMIT

    data = b"GGUF" + bytes(range(256)) * 20
    hub_folder = tmp_path / "home" / "hf-elsewhere" / ("hub" if variable == "HF_HOME" else "")
    snapshot = hub_folder / "models--org--Tiny-GGUF" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "tiny-Q4_K_M.gguf").write_bytes(data)
    monkeypatch.setenv("ELSEWHERE", "hf-elsewhere")
    monkeypatch.setenv(variable, "~/$ELSEWHERE")
    online_hub.add("org/Tiny-GGUF", "tiny-Q4_K_M.gguf", data)
    path = store.resolve_model("hf:org/Tiny-GGUF:Q4_K_M")
    assert path.read_bytes() == data and online_hub.downloads(".gguf") == []
    assert hub._hf_hub_cache() == str(hub_folder).rstrip("/")


# ---------------------------------------------------------------- the cost cache


GOOD = {"batch_seconds": {"1": 0.01, "2": 0.015, "3": 0.02}, "depth": 256, "context_seconds": 1e-6}


@pytest.mark.parametrize(
    "entry",
    [
        '{"batch_seconds": {"1": 0.01, "2": 0.02}, "depth": Infinity}',
        '{"batch_seconds": {"1": 0.01, "2": 0.02}, "passes": 1e400}',
        '{"batch_seconds": {"1": 0.01, "2": 1%s}}' % ("0" * 400),
        '{"batch_seconds": {"1": 0.01, "2": 0.02, "3000000000": 5.0}}',
        '{"batch_seconds": {"-5": 0.01, "1": 0.01, "2": 0.02}}',
        '{"batch_seconds": {"0": 0.01, "1": 0.01}}',
        '{"batch_seconds": {"1": 0.01, "2": 0.02}, "draft_seconds": NaN}',
        '{"batch_seconds": {"1": 0.01, "2": 0.02}, "depth": -3}',
    ],
    ids=["infinite depth", "infinite passes", "a number beyond floats", "a size of 3e9", "a negative size",
         "a size of 0", "NaN draft step", "negative depth"],  # fmt: skip
)
def test_a_cost_cache_edited_by_hand_is_measured_again_never_a_crash(tmp_path, entry):
    """A damaged entry is measured again (as the module promises): before, an infinite count raised
    OverflowError through `run`, and a size of 3e9 made the cost model interpolate 3e9 sizes."""
    path = tmp_path / "costs.json"
    path.write_text('{"K": %s, "other": %s}' % (entry, json.dumps(GOOD)), "utf-8")
    assert costs_cache.load_costs(path, "K") is None
    assert costs_cache.load_costs(path, "other").batch_seconds == {1: 0.01, 2: 0.015, 3: 0.02}  # the rest is kept


def test_a_cost_cache_saved_with_a_byte_order_mark_keeps_its_curves(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text("\ufeff" + json.dumps({"K": GOOD}), "utf-8")
    assert costs_cache.load_costs(path, "K").batch_seconds == {1: 0.01, 2: 0.015, 3: 0.02}
    costs_cache.save_costs(path, "L", costs_cache.load_costs(path, "K"))
    assert set(json.loads(path.read_text("utf-8"))) == {"K", "L"}  # not thrown away as unreadable


def test_the_registry_error_for_a_missing_file_still_names_the_variable(env, tmp_path):
    env["SPECLLM_CONFIG"] = str(tmp_path / "nothing.toml")
    assert one_error_line(cli(env, "models")).startswith(f"SPECLLM_CONFIG names {tmp_path / 'nothing.toml'}, which does not exist")


def test_load_registry_rejects_a_shadowing_model_given_as_a_path(tmp_path):
    path = tmp_path / "u.toml"
    path.write_text(f'[[model]]\nname = "qwen2.5-coder"\nfile = "m.gguf"\nsize = 4\nsha256 = "{SHA}"\n')
    with pytest.raises(SpecllmError, match="has the name of preset 'qwen2.5-coder'"):
        catalog.load_registry(path)


# ---------------------------------------------------------------- HF_ENDPOINT


def test_an_empty_hf_endpoint_means_the_default_hub(monkeypatch):
    """`HF_ENDPOINT=` (a compose file passing on a variable unset on the host): huggingface_hub takes
    the empty string as its endpoint, and every request went to "/api/models/..." ("the hub () is unreachable")."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", "")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "")  # as imported under HF_ENDPOINT=
    assert hub._endpoint() == huggingface_hub.constants._HF_DEFAULT_ENDPOINT.rstrip("/") != ""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1/mirror/")
    assert hub._endpoint() == "http://127.0.0.1:1/mirror"


def test_a_pinned_model_is_fetched_from_the_hf_endpoint_set_after_import(env, tmp_path, online_hub):
    """A catalog model with an `hf_repo` asks the endpoint HF_ENDPOINT names now, as `hf:` names do
    (huggingface_hub's own functions read it once, at import)."""
    import hashlib

    from specllm.models.catalog import ModelEntry

    data = b"GGUF" + bytes(range(256)) * 20
    entry = ModelEntry("pinned", "pinned.gguf", len(data), hashlib.sha256(data).hexdigest(), hf_repo="org/Pinned-GGUF")
    online_hub.add("org/Pinned-GGUF", "pinned.gguf", data)
    path = hub.fetch(entry, tmp_path / "cache", hf_timeout=5)
    assert path.read_bytes() == data and online_hub.downloads("pinned.gguf")
