"""Voices as folders (#34): ``--voices DIR`` also takes ``NAME/ref.wav`` with ``NAME/ref.txt`` (a
transcript) or ``NAME/instruct.txt`` (a style instruction), made into a voice once and kept beside
them as ``NAME/voice.pt``, made again when a file or the model changes; broken folders are skipped
like broken files. Through the store, ``serve``'s routes, Wyoming's service and ``batch`` (tiny model)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyllama.errors import InputError
from cosyllama.tts import TTS
from cosyllama.voice_directory import FOLDER_VOICE, ClipEncoder, VoiceDirectory
from cosyllama.voices import ReadOnlyVoicesError, UnknownVoiceError, VoiceStore, read_voice_file
from helpers import FIXTURES, MODEL_DIR

PROMPT_WAV = FIXTURES / "wavs" / "prompt_en_16k.wav"
TRANSCRIPT = "Hello, this is my voice."


@pytest.fixture(scope="module")
def tts():
    from cosyllama.tts import TTS

    return TTS(MODEL_DIR, threads=1, precision="fp32")


def _folder(root, name, wav=PROMPT_WAV, **texts):
    d = root / name
    d.mkdir(parents=True)
    if wav is not None:
        shutil.copy(wav, d / "ref.wav")
    for fname, text in texts.items():
        (d / f"{fname}.txt").write_text(text)
    return d


def _layout(root, voice=None):
    """anna: clip + transcript; bob: clip + instruction; carl: clip only; silent: a clip with no
    signal; notes: no clip; dan.pt: a voice file beside them."""
    _folder(root, "anna", ref=TRANSCRIPT + "\n")
    _folder(root, "bob", instruct="Speak slowly and calmly.")
    _folder(root, "carl")
    silent = root / "silent.wav"
    sf.write(silent, np.zeros(32_000, np.float32), 16_000)
    _folder(root, "silent", wav=silent, ref="Nothing.")
    silent.unlink()
    _folder(root, "notes", wav=None, ref="Just a transcript.")
    if voice is not None:
        VoiceDirectory(root).add("dan", voice)
    return root


class Counting:
    """A ClipEncoder around the TTS's that counts the clips it makes into voices."""

    def __init__(self, tts, key=None):
        base = ClipEncoder.of(tts)
        self.calls = []

        def make(audio, text):
            self.calls.append(text)
            return base.make(audio, text)

        self.encoder = ClipEncoder(make, key or base.key)


def _same(a, b) -> bool:
    return (torch.equal(a.speech_tokens, b.speech_tokens) and torch.equal(a.prompt_feat, b.prompt_feat)
            and torch.equal(a.speaker_embedding, b.speaker_embedding) and a.prompt_text == b.prompt_text)


def test_folders_become_voices_once_and_are_kept_beside_the_clip(tts, tmp_path):
    root = _layout(tmp_path / "voices", tts.make_voice(PROMPT_WAV))
    store = VoiceDirectory(root)
    assert store.ids() == ["dan"]  # folders wait for the model
    assert store.folders() == {"anna": True, "bob": False, "carl": False, "silent": True}
    enc = Counting(tts)
    store.set_encoder(enc.encoder)
    assert store.ids() == ["anna", "bob", "carl", "dan"]
    assert sorted(enc.calls, key=str) == sorted([TRANSCRIPT, None, None, "Nothing."], key=str)
    skipped = store.skipped
    assert sorted(skipped) == ["notes/", "silent/"]
    assert skipped["silent/"].startswith("ref.wav: prompt audio has no signal") and str(root) not in skipped["silent/"]
    assert skipped["notes/"].startswith("no ref.wav in it")
    anna, bob = store.get("anna"), store.get("bob")
    assert _same(anna, tts.make_voice(PROMPT_WAV, TRANSCRIPT)) and anna.instruction is None
    assert bob.prompt_text is None and bob.instruction == "Speak slowly and calmly."
    for name in ("anna", "bob", "carl"):
        assert list(read_voice_file(root / name / FOLDER_VOICE)) == [name]
    assert not (root / "silent" / FOLDER_VOICE).exists()
    with pytest.raises(UnknownVoiceError, match="unknown voice 'silent'; registered voices: anna, bob, carl, dan"):
        store.get("silent")

    # another process (a restart) reads the kept voices: no good clip is encoded again (the bad one is tried)
    again = Counting(tts)
    other = VoiceDirectory(root, encoder=again.encoder)
    assert other.ids() == ["anna", "bob", "carl", "dan"] and again.calls == ["Nothing."]
    again.calls.clear()
    assert _same(other.get("anna"), anna) and other.get("bob").instruction == bob.instruction
    # touched but the same bytes: read again, not made again
    os.utime(root / "anna" / "ref.wav")
    assert _same(other.get("anna"), anna) and again.calls == []
    # a new transcript: that folder is made again (by the store that looks), the others are not
    (root / "anna" / "ref.txt").write_text("Another transcript.")
    assert other.get("anna").prompt_text.endswith("<|endofprompt|>Another transcript.")
    assert again.calls == ["Another transcript."]
    assert store.get("anna").prompt_text == other.get("anna").prompt_text  # the first store sees the change
    # another model: every folder is made again
    third = Counting(tts, key="another model")
    assert VoiceDirectory(root, encoder=third.encoder).ids() == ["anna", "bob", "carl", "dan"]
    assert len(third.calls) == 4  # anna, bob, carl and the still silent clip
    # a broken folder fixed: served
    shutil.copy(PROMPT_WAV, root / "notes" / "ref.wav")
    assert "notes" in store.ids() and "notes/" not in store.skipped


def test_folders_change_through_their_files_only(tts, tmp_path):
    root = _layout(tmp_path / "voices")
    store = VoiceDirectory(root, encoder=ClipEncoder.of(tts))
    with pytest.raises(ReadOnlyVoicesError, match="voice folder"):
        store.add("anna", store.get("carl"))
    with pytest.raises(ReadOnlyVoicesError, match="voice folder"):
        store.remove("anna")
    assert (root / "anna" / "ref.wav").is_file()
    shutil.rmtree(root / "carl")  # removed by the operator: gone
    assert "carl" not in store.ids()
    with pytest.raises(UnknownVoiceError):
        store.get("carl")
    store.add("carl", store.get("anna"))  # the id is free again: a registered voice file
    assert (root / "carl.pt").is_file() and store.get("carl").prompt_text == store.get("anna").prompt_text
    _folder(root, "dup")
    with pytest.raises(ReadOnlyVoicesError, match="voice folder"):
        store.add("dup", store.get("bob"), replace=True)
    assert not (root / "dup.pt").exists()


def test_a_voice_file_and_a_folder_of_one_id(tts, tmp_path):
    root = tmp_path / "voices"
    _folder(root, "eve", ref=TRANSCRIPT)
    bundle = VoiceStore()
    bundle.add("eve", tts.make_voice(PROMPT_WAV))
    bundle.save(root / "eve.pt")  # put there by hand: the store refuses to write it (see above)
    store = VoiceDirectory(root, encoder=ClipEncoder.of(tts))
    assert store.ids() == ["eve"] and store.get("eve").prompt_text is None  # the file wins
    assert "same id" in store.skipped["eve/"]


def test_a_read_only_folder_is_made_each_time_with_a_warning(tts, tmp_path, caplog, monkeypatch):
    import cosyllama.voice_directory as voice_directory

    def read_only(directory, name, data):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(voice_directory, "write_durably", read_only)
    root = _layout(tmp_path / "voices")
    store = VoiceDirectory(root, encoder=ClipEncoder.of(tts))
    assert "anna" in store.ids() and not (root / "anna" / FOLDER_VOICE).exists()
    warned = [r.getMessage() for r in caplog.records if "cannot keep the voice" in r.getMessage()]
    assert len(warned) == 3 and "made again at each start" in warned[0]  # anna, bob, carl: once each
    store.ids()
    assert len([r for r in caplog.records if "cannot keep the voice" in r.getMessage()]) == 3


def test_a_voice_with_an_instruction_speaks_instruct_unless_told_otherwise(tts, tmp_path, monkeypatch):
    store = VoiceDirectory(_layout(tmp_path / "voices"), encoder=ClipEncoder.of(tts))
    view = TTS.from_models(tts.models, voices=store)
    calls = []
    fe = view.frontend  # TTS.run chooses the mode and calls the frontend's method for it
    monkeypatch.setattr(fe, "instruct2", lambda text, instr, *a, **kw: calls.append(("instruct", instr)) or [])
    monkeypatch.setattr(fe, "zero_shot", lambda *a, **kw: calls.append(("zero-shot", None)) or [])
    monkeypatch.setattr(fe, "cross_lingual", lambda *a, **kw: calls.append(("cross-lingual", None)) or [])
    view.synthesize("Hi.", voice="bob")
    view.synthesize("Hi.", voice="bob", instruction="Whisper.")
    view.synthesize("Hi.", voice="bob", mode="instruct")
    view.synthesize("Hi.", voice="bob", mode="cross-lingual")
    view.synthesize("Hi.", voice="anna")
    view.synthesize("Hi.", voice="carl")
    assert calls == [("instruct", "Speak slowly and calmly."), ("instruct", "Whisper."),
                     ("instruct", "Speak slowly and calmly."), ("cross-lingual", None), ("zero-shot", None),
                     ("cross-lingual", None)]


def test_folder_text_files_are_checked(tts, tmp_path):
    root = tmp_path / "voices"
    _folder(root, "bin")
    (root / "bin" / "ref.txt").write_bytes(b"\xff\xfe\x00broken")
    _folder(root, "big")
    (root / "big" / "ref.txt").write_text("word " * 20_000)
    _folder(root, "ctl", ref="Hello\x07.")
    store = VoiceDirectory(root, encoder=ClipEncoder.of(tts))
    assert store.ids() == []
    assert store.skipped["bin/"] == "ref.txt is not UTF-8 text"
    assert store.skipped["big/"].startswith("ref.txt is larger than")
    assert "control character (U+0007)" in store.skipped["ctl/"]


def test_serve_routes_and_wyoming_serve_folders(tts, tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from cosyllama.server.app import create_app
    from cosyllama.server.options import ServeOptions, ServingOptions
    from cosyllama.server.startup import open_voice_store
    from cosyllama.server.wyoming import WyomingService

    root = _layout(tmp_path / "voices")
    view = TTS.from_models(tts.models, voices=open_voice_store(str(root)))
    app = create_app(view, ServeOptions(ServingOptions(view.options), max_voices=4))
    with TestClient(app) as c:  # create_app gave the store its encoder
        voices = {v["id"]: v for v in c.get("/v1/voices").json()["voices"]}
        assert sorted(voices) == ["anna", "bob", "carl"]
        assert voices["anna"]["has_transcript"] and voices["anna"]["instructions"] is None
        assert voices["bob"]["instructions"] == "Speak slowly and calmly."
        r = c.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "anna", "greedy": True,
                                              "response_format": "wav"})
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
        err = c.delete("/v1/voices/anna").json()["error"]
        assert err["code"] == "voice_folder" and "through its files" in err["message"]
        files = {"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")}
        r = c.post("/v1/voices", files=files, data={"id": "bob", "replace": "true"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "voice_folder"
        assert c.get("/health").json()["voices"]["skipped_count"] == 2
        # dropped in while the server runs: found on the next lookup
        _folder(root, "zoe", ref="Hi, I am Zoe.")
        assert "zoe" in [v["id"] for v in c.get("/v1/voices").json()["voices"]]
        service = WyomingService(app.state.server.serving)
        names = [v.name for v in service.info().tts[0].voices]
        assert names == ["default", "anna", "bob", "carl", "zoe"]
        assert service.voice(None)[0] == "anna"


def test_batch_reads_voice_folders(tmp_path, capsys):
    from cosyllama.cli import main

    root = _layout(tmp_path / "voices")
    manifest = tmp_path / "m.jsonl"
    rows = [{"id": "a", "mode": "zero-shot", "text": "Hello there.", "voice": "anna", "greedy": True},
            {"id": "c", "mode": "cross-lingual", "text": "Hi.", "voice": "carl", "greedy": True}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["batch", str(manifest), "--out", str(tmp_path / "out"), "--model-dir", str(MODEL_DIR), "--threads", "1",
            "--precision", "fp32", "--voices", str(root), "--no-progress"]
    assert main([*base, "--dry-run"]) == 0  # the ids are known without the model
    assert main(base) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "a.wav").is_file() and (tmp_path / "out" / "c.wav").is_file()
    assert (root / "anna" / FOLDER_VOICE).is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "n", "mode": "cross-lingual", "text": "Hi.", "voice": "notes"}) + "\n")
    assert main(["batch", str(bad), *base[2:], "--dry-run"]) == 2  # a folder without a clip is no voice
    assert "unknown voice 'notes'" in capsys.readouterr().err


def test_no_encoder_no_voice_no_error(tmp_path):
    store = VoiceDirectory(_layout(tmp_path / "voices"))
    assert store.ids() == [] and "anna" not in store
    with pytest.raises(InputError, match="unknown voice 'anna'"):
        store.get("anna")
    assert list(store.skipped) == ["notes/"]  # what is known broken without a model
