"""The user cache folder visiontune trusts (``host.check_environment``, ``host.untrusted``): this user's own,
writable by nobody else, as ssh wants ``~/.ssh``; a read-only home's stand-in made 0700."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from trainrun import one_line, tiny_train
from visiontune import cli
from visiontune.cluster import host
from visiontune.errors import UserError


@pytest.fixture
def home(tmp_path, monkeypatch):
    """HOME in tmp_path, no cache folder named: the default one is HOME/.cache/visiontune."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("VISIONTUNE_CACHE_DIR", raising=False)  # restored after, whatever the code sets
    return tmp_path / "home"


def test_a_new_default_cache_folder_is_made_for_this_user_alone(home):
    home.mkdir()
    host.check_environment(trains=True)
    folder = home / ".cache" / "visiontune"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    host.check_environment(trains=True)  # and passes the check it made


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757], ids=oct)
def test_a_default_cache_folder_others_may_write_in_is_refused(home, mode):
    folder = home / ".cache" / "visiontune"
    folder.mkdir(parents=True)
    folder.chmod(mode)
    with pytest.raises(UserError, match=rf"{folder} is writable by .* \(mode {mode:04o}\).*chmod go-w"):
        host.check_environment(trains=True)
    host.check_environment(trains=False)  # a command that caches nothing does not care


def test_a_named_cache_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o755)
    os.chown(folder, 12345, 12345)  # the tests run as root
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(folder))
    with pytest.raises(UserError, match=r"owned by another user \(uid 12345; .*VISIONTUNE_CACHE_DIR"):
        host.check_environment(trains=True)


def test_the_folders_above_count_unless_sticky(tmp_path):
    (above := tmp_path / "open").mkdir()
    (folder := above / "cache").mkdir(mode=0o700)
    above.chmod(0o777)  # anyone may rename cache away and put their own in its place
    assert "above the cache folder, is writable by every user (mode 0777)" in host.untrusted(folder)
    above.chmod(0o1777)  # sticky, as /tmp: they may not
    assert host.untrusted(folder) is None
    os.chown(above, 12345, 12345)
    assert "above the cache folder, is owned by another user (uid 12345)" in host.untrusted(folder)


def test_a_read_only_homes_stand_in_is_a_new_folder_of_this_user_alone(home, capsys):
    home.write_text("a file: nothing can be made under it")
    host.check_environment(trains=True)
    temporary = os.environ["VISIONTUNE_CACHE_DIR"]
    try:
        st = os.stat(temporary)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert f"keeps its caches in {temporary} " in capsys.readouterr().err
    finally:
        shutil.rmtree(temporary)


def test_train_with_a_world_writable_cache_folder_stops_at_start_up(tmp_path, small_data, capsys, no_scan, monkeypatch):
    (folder := tmp_path / "shared").mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(folder))
    assert cli.main(tiny_train(small_data, tmp_path / "run")) == 2
    one_line(capsys, f"{folder} is writable by every user (mode 0777)", "chmod go-w", "VISIONTUNE_CACHE_DIR")
    assert not (tmp_path / "run").exists() and list(folder.iterdir()) == []
