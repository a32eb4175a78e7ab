"""The test suite never writes into the user's cache or config folders (conftest.py's `isolated_home`).

A command that calibrates (`--spec auto` with nothing measured yet) writes costs.json: it must land
in the test's temporary cache, and the user's folders must be exactly as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

from specllm.models import catalog
from tests.cli_helpers import ROOT
from tests.user_files import USER_CACHE, builtin_registry, user_files, user_files_changed


def test_every_location_specllm_writes_is_temporary(isolated_home):
    assert catalog.cache_dir() == isolated_home / "cache" != USER_CACHE
    assert catalog.user_config_path().is_relative_to(isolated_home)
    for var in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HF_HOME"):
        assert os.environ[var].startswith(str(isolated_home)), var
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_calibrating_run_writes_costs_only_into_the_test_cache(isolated_home, tiny_pair):
    before = user_files()
    costs = isolated_home / "cache" / "costs.json"
    costs.unlink(missing_ok=True)  # nothing measured yet: this run must calibrate
    args = ["run", "-m", tiny_pair[0], "--draft", tiny_pair[1], "--spec", "auto", "-t", "1", "-n", "4", "-p", "hi"]
    done = subprocess.run([sys.executable, "-m", "specllm", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert user_files_changed(before) == []
    if not costs.is_file():  # a calibration may decline to cache a curve whose timings were unsteady
        warnings.warn("the calibrating run cached no curve: where a cached one lands was not checked", stacklevel=1)
        return
    measured = json.loads(costs.read_text("utf-8"))
    assert [key for key in measured if key.startswith(f"{tiny_pair[0].name}:")], measured.keys()


def test_user_models_are_linked_read_only_and_stay_verified(isolated_home):
    """The verified models of the user's cache are shared as links, with sidecars that still match."""
    from specllm.models import hub

    for link in (isolated_home / "cache" / "models").glob("*.gguf"):
        assert link.is_symlink() and link.resolve().parent == (USER_CACHE / "models").resolve()
        entry = next(e for e in builtin_registry().models.values() if e.file == link.name)
        assert hub.cache_state(entry, link) == "verified"  # no rehash of a gigabyte per test
