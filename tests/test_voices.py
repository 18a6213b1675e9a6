"""Voice stores without a model: ids, the in-memory store, and the voice directory: what one
process writes another sees, writes are atomic, a crash while writing leaves whole voices only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cosyllama.errors import InputError
from cosyllama.frontend import PromptFeatures
from cosyllama.voice_directory import VoiceDirectory
from cosyllama.voices import (
    ReadOnlyVoicesError,
    UnknownVoiceError,
    VoiceExistsError,
    VoiceStore,
    check_voice_id,
    read_voice_file,
)

SRC = str(Path(__import__("cosyllama").__file__).resolve().parents[1])


def _voice(seed: int, text: str | None = "Hello.") -> PromptFeatures:
    g = torch.Generator().manual_seed(seed)
    n = 10 + seed % 7
    return PromptFeatures(speech_tokens=torch.randint(0, 6561, (n,), generator=g, dtype=torch.int32),
                          speaker_embedding=torch.randn(192, generator=g),
                          prompt_feat=torch.randn(2 * n, 80, generator=g),
                          prompt_text=text, prompt_text_ids=(1, 2, seed) if text else ())


def _same(a: PromptFeatures, b: PromptFeatures) -> bool:
    return (torch.equal(a.speech_tokens, b.speech_tokens) and torch.equal(a.prompt_feat, b.prompt_feat)
            and torch.equal(a.speaker_embedding, b.speaker_embedding) and a.prompt_text == b.prompt_text
            and a.prompt_text_ids == b.prompt_text_ids)


@pytest.mark.parametrize("bad", ["", ".", "..", ".hidden", "a/b", "a\\b", "../x", "a b", "x" * 65, "é", None])
def test_reserved_and_malformed_ids_refused(bad):
    with pytest.raises(InputError, match="not allowed"):
        check_voice_id(bad)
    with pytest.raises(InputError):
        VoiceStore().add(bad, _voice(0))


@pytest.mark.parametrize("good", ["anna", "a.b", "x" * 64, "-x", "_x", "v1.2-3_4"])
def test_ids_allowed(good):
    assert check_voice_id(good) == good


def test_memory_store_replace_and_read_only(tmp_path):
    s = VoiceStore()
    s.add("a", _voice(1))
    with pytest.raises(VoiceExistsError):
        s.add("a", _voice(2), replace=False)
    assert _same(s.get("a"), _voice(1))
    s.add("a", _voice(2))  # the Python API's default: replace
    assert _same(s.get("a"), _voice(2))
    s.save(tmp_path / "b.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["b.pt"]  # no temporary file left
    r = VoiceStore()
    assert r.load(tmp_path / "b.pt") == ["a"]
    r.read_only = True
    with pytest.raises(ReadOnlyVoicesError):
        r.add("b", _voice(3))
    with pytest.raises(ReadOnlyVoicesError):
        r.remove("a")
    assert r.ids() == ["a"]


def test_directory_is_shared_between_stores(tmp_path):
    """Two stores on one directory stand for two server processes: each sees the other's
    registrations, replacements and removals, and a new store finds everything on disk."""
    a, b = VoiceDirectory(tmp_path / "v"), VoiceDirectory(tmp_path / "v")
    a.add("anna", _voice(1))
    assert "anna" in b and b.ids() == ["anna"] and _same(b.get("anna"), _voice(1))
    with pytest.raises(VoiceExistsError):
        b.add("anna", _voice(2), replace=False)
    b.add("anna", _voice(2, None))  # replaced through b ...
    assert _same(a.get("anna"), _voice(2, None))  # ... a reads the new file, not its cached voice
    b.remove("anna")
    assert "anna" not in a and a.ids() == []
    with pytest.raises(InputError, match="unknown voice 'anna'"):
        a.get("anna")
    with pytest.raises(InputError, match="unknown voice"):
        a.remove("anna")
    a.add("bob", _voice(3))
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["bob.pt"]
    assert VoiceDirectory(tmp_path / "v").ids() == ["bob"]
    # each file is an ordinary voice file (what batch --voices DIR and VoiceStore.load read)
    assert list(read_voice_file(tmp_path / "v" / "bob.pt")) == ["bob"]
    assert VoiceStore().load(tmp_path / "v" / "bob.pt") == ["bob"]


def test_directory_load_copies_a_bundle_in_and_save_writes_one(tmp_path):
    bundle = VoiceStore()
    bundle.add("x", _voice(1))
    bundle.add("y", _voice(2))
    bundle.save(tmp_path / "bundle.pt")
    d = VoiceDirectory(tmp_path / "v")
    assert d.load(tmp_path / "bundle.pt") == ["x", "y"]
    assert VoiceDirectory(tmp_path / "v").ids() == ["x", "y"]
    d.save(tmp_path / "again.pt")
    assert sorted(read_voice_file(tmp_path / "again.pt")) == ["x", "y"]


def test_directory_refuses_what_it_cannot_serve(tmp_path):
    VoiceStore().save(tmp_path / "f.pt")
    with pytest.raises(InputError, match="is a file; give a directory"):
        VoiceDirectory(tmp_path / "f.pt")
    with pytest.raises(InputError, match="does not exist"):
        VoiceDirectory(tmp_path / "no" / "such")
    d = tmp_path / "v"
    d.mkdir()
    bundle = VoiceStore()
    bundle.add("x", _voice(1))
    bundle.add("y", _voice(2))
    bundle.save(d / "team.pt")
    store = VoiceDirectory(d)  # every file is read at start: a bad one is skipped and reported then
    assert list(store.skipped) == ["team.pt"]
    assert store.skipped["team.pt"].startswith("holds the voice(s) 'x', 'y'; a voice directory holds one")
    assert str(d) not in store.skipped["team.pt"]  # the reason names no path (the log does)
    # a skipped file is no voice: the same error as an unknown id, not counted, not listed
    with pytest.raises(UnknownVoiceError, match=r"^unknown voice 'team'; registered voices: none$"):
        store.get("team")
    assert store.items() == {} and store.ids() == [] and "team" not in store and len(store) == 0
    (d / "team.pt").write_text("junk")  # changed: read again, still bad
    with pytest.raises(UnknownVoiceError):
        store.get("team")
    assert store.skipped["team.pt"].startswith("not a voice file (")
    assert "not a voice file" in VoiceDirectory(d).skipped["team.pt"]
    VoiceDirectory(d).add("team", _voice(1))  # replaced by a good one: no longer skipped
    assert store.get("team") is not None and store.skipped == {} and store.ids() == ["team"]


def test_stale_temporary_files_are_removed_fresh_ones_kept(tmp_path):
    d = tmp_path / "v"
    d.mkdir()
    old, new = d / ".a.x1.tmp", d / ".b.x2.tmp"
    old.write_bytes(b"half")
    new.write_bytes(b"half")
    t = time.time() - 2 * 3600
    os.utime(old, (t, t))
    store = VoiceDirectory(d)
    assert store.ids() == [] and not old.exists() and new.exists()  # another process may be writing `new`


_WRITER = textwrap.dedent("""
    import sys, torch
    from cosyllama.frontend import PromptFeatures
    from cosyllama.voice_directory import VoiceDirectory
    d = VoiceDirectory(sys.argv[1])
    n = 0
    while True:
        # big enough that a write takes a while: the kill lands in one now and then
        v = PromptFeatures(torch.zeros(2000, dtype=torch.int32), torch.randn(192), torch.randn(4000, 80),
                           "Hi.", (1, 2, 3))
        d.add(f"v{n % 5}", v)
        n += 1
        if n == 3:
            print("ready", flush=True)
""")


def test_kill_9_while_writing_leaves_only_whole_voices(tmp_path):
    d = tmp_path / "v"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    for delay in (0.05, 0.3, 0.7):
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(d)], stdout=subprocess.PIPE, env=env)
        try:
            assert p.stdout.readline().strip() == b"ready"
            time.sleep(delay)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        store = VoiceDirectory(d)  # reads every voice file: a torn one would fail here
        assert 1 <= len(store.ids()) <= 5
        assert all(store.get(v).prompt_feat.shape == (4000, 80) for v in store.ids())
