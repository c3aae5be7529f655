"""Every CLI test sees an empty home: no config file of this machine's user can change its outcome."""

import pytest


@pytest.fixture(autouse=True)
def isolated_config_locations(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv("ACCELERATE_CONFIG_FILE", raising=False)
