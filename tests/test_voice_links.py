"""Voice folders and ``--voices DIR`` (issue #42): nothing is read or written through a link that
leads out of DIR (a voice file, a voice folder, or a file of one): such a voice is skipped like a
broken one, with its reason, and counted in /health; links that stay inside DIR are followed. A
folder's ``instruct.txt`` and ``ref.txt`` follow a request's text rules (no control characters)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from helpers import LoopbackServer
from server_helpers import PROMPT_TEXT, PROMPT_WAV, WAIT_S

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voice_directory import ClipEncoder, VoiceDirectory  # noqa: E402


def _folder(root, name, **texts):
    d = root / name
    d.mkdir(parents=True)
    shutil.copy(PROMPT_WAV, d / "ref.wav")
    for fname, text in texts.items():
        (d / f"{fname}.txt").write_text(text)
    return d


def test_links_out_of_the_voice_directory_are_skipped(tts, voice, tmp_path, caplog):
    """``leak/instruct.txt`` -> a secret outside, ``away`` -> a folder outside, ``file.pt`` -> a voice
    file outside, ``wav/ref.wav`` -> a clip outside: none is a voice, each is skipped with its reason
    (no path), the secret is nowhere in /v1/voices or /health, and nothing is written outside."""
    caplog.set_level(logging.INFO)
    outside, root = tmp_path / "outside", tmp_path / "voices"
    outside.mkdir()
    (outside / "secret.txt").write_text("the admin password is hunter2")
    other = _folder(outside, "other", ref=PROMPT_TEXT)
    VoiceDirectory(outside).add("stray", voice)
    _folder(root, "anna", ref=PROMPT_TEXT)
    (_folder(root, "leak") / "instruct.txt").symlink_to(outside / "secret.txt")
    (root / "away").symlink_to(other, target_is_directory=True)
    (root / "file.pt").symlink_to(outside / "stray.pt")
    wav = root / "wav"
    wav.mkdir()
    (wav / "ref.wav").symlink_to(other / "ref.wav")
    before = sorted(p.name for p in outside.rglob("*"))

    view = TTS.from_models(tts.models, voices=VoiceDirectory(root))
    srv = LoopbackServer(create_app(view))
    try:
        with httpx.Client(base_url=srv.url, timeout=WAIT_S) as c:
            voices = c.get("/v1/voices")
            assert [v["id"] for v in voices.json()["voices"]] == ["anna"], voices.text
            health = c.get("/health").json()["voices"]
    finally:
        srv.stop()
    assert "hunter2" not in voices.text and "hunter2" not in json.dumps(health)
    assert health["skipped_count"] == 4, health
    skipped = view.voices.skipped
    assert skipped == {
        "away/": "the folder is a link to outside the voice directory; links are followed only within it",
        "file.pt": "the file is a link to outside the voice directory; links are followed only within it",
        "leak/": "instruct.txt is a link to outside the voice directory; links are followed only within it",
        "wav/": "ref.wav is a link to outside the voice directory; links are followed only within it"}, skipped
    assert sorted(p.name for p in outside.rglob("*")) == before  # no voice.pt written through the link
    assert not [r for r in caplog.records if "hunter2" in r.getMessage()]


def test_links_within_the_voice_directory_are_followed(tts, tmp_path):
    root = tmp_path / "voices"
    _folder(root, "anna", ref=PROMPT_TEXT)
    (root / ".texts").mkdir()  # not a voice id: no folder of its own
    (root / ".texts" / "calm.txt").write_text("Speak calmly.")
    (_folder(root, "bob") / "instruct.txt").symlink_to(root / ".texts" / "calm.txt")
    (root / "alias").symlink_to(root / "anna", target_is_directory=True)
    store = VoiceDirectory(root, encoder=ClipEncoder.of(tts))
    assert store.ids() == ["alias", "anna", "bob"] and store.skipped == {}
    assert store.get("bob").instruction == "Speak calmly."


@pytest.mark.parametrize("name", ["instruct", "ref"])
def test_folder_text_follows_the_request_text_rules(tts, tmp_path, name):
    """``calm\\x01\\x1b[31m`` in instruct.txt (or ref.txt) is refused as the same text in a request's
    instructions is: the folder is skipped with the reason, the voice is not served."""
    root = tmp_path / "voices"
    _folder(root, "anna", ref=PROMPT_TEXT)
    _folder(root, "ctl", **{name: "calm\x01\x1b[31m"})
    _folder(root, "unit", **{name: "calm\x1f voice"})  # Python's split() takes U+001F for a space
    store = VoiceDirectory(root, encoder=ClipEncoder.of(tts))
    assert store.ids() == ["anna"]
    assert store.skipped == {
        "ctl/": f"{name}.txt holds a control character (U+0001) at character 4; remove it (tab and newline are fine)",
        "unit/": f"{name}.txt holds a control character (U+001F) at character 4; remove it (tab and newline are "
                 "fine)"}
    _folder(root, "tabs", **{name: "Speak\tcalmly,\r\nplease."})  # tab and newlines are fine, as in a request
    assert "tabs" in store.ids()
