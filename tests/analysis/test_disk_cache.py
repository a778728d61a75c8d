"""Where the trace cache lives: $MIST_CACHE_DIR, else ~/.cache/mist; off, empty and homeless cases."""

from pathlib import Path

from mist.analysis import disk_cache


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path))
    assert disk_cache._dir().parent == tmp_path / "analysis"
    monkeypatch.setenv("MIST_CACHE_DIR", "off")
    assert disk_cache._dir() is None
    monkeypatch.setenv("MIST_CACHE_DIR", "  ")  # empty: the default, not the current folder
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: tmp_path / "home"))
    assert disk_cache._dir().parent == tmp_path / "home" / ".cache" / "mist" / "analysis"


def test_no_home_folder_means_no_cache(monkeypatch):
    def homeless(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("MIST_CACHE_DIR", raising=False)
    monkeypatch.setattr(Path, "home", classmethod(homeless))
    assert disk_cache._dir() is None and disk_cache._path(("key",)) is None
