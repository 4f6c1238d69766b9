"""``controllers.kv_clears.ClearJournal`` on its own: the file a daemon leaves for the next one
with the same identity, and what it does with a file it cannot read or a folder it cannot write
(a warning naming the file, never an exception: the daemon goes on)."""
from __future__ import annotations

import json
import logging
import os
import stat

from hicache.controllers.kv_clears import PREFIX, ClearJournal


def test_pending_namespaces_survive_for_the_same_identity_only(tmp_path):
    j = ClearJournal(str(tmp_path), "master|prefix|ipc://a")
    assert j.load() == []
    j.save({"b": 1, "a": 2})  # a dict of namespace -> removals, as KvL3 keeps them
    files = list(tmp_path.glob(f"{PREFIX}*.json"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert json.loads(files[0].read_text()) == {"namespaces": ["a", "b"]}
    assert ClearJournal(str(tmp_path), "master|prefix|ipc://a").load() == ["a", "b"]
    assert ClearJournal(str(tmp_path), "master|prefix|ipc://other").load() == []
    j.save([])  # every removal ran: nothing left behind
    assert list(tmp_path.iterdir()) == []
    j.save([])  # and saying so again is no error


def test_a_bad_file_is_ignored_and_an_unwritable_folder_is_logged_once(tmp_path, caplog):
    j = ClearJournal(str(tmp_path), "x")
    for text in ("not json", json.dumps({"namespaces": [1, 2]}), json.dumps([])):
        with open(j.path, "w") as f:
            f.write(text)
        with caplog.at_level(logging.WARNING, logger="hicache.daemon"):
            assert ClearJournal(str(tmp_path), "x").load() == []
        assert j.path in caplog.text
        caplog.clear()
    os.unlink(j.path)
    k = ClearJournal(str(tmp_path / "gone"), "y")  # a folder that is not there (any uid)
    with caplog.at_level(logging.ERROR, logger="hicache.daemon"):
        k.save(["a"])
        k.save(["a", "b"])
    assert caplog.text.count("cannot be written") == 1
    assert not (tmp_path / "gone").exists()
