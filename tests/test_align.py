"""Word times (cosyllama.align): measured on speech nobody here wrote (espeak-ng, with its own word onsets),
the errors a user can make, an aligner model given as a directory, word times on a synthesis (same audio,
after each segment), and ``cosyllama align`` as a user runs it.

The accuracy test speaks a few sentences; scripts/measure_alignment.py measures the full set (docs/captions.md).
Its bounds are the issue's targets (median |onset error| ≤ 50 ms, 90th percentile ≤ 120 ms); PocketSphinx is
deterministic and the measured values are far inside them (docs/captions.md), and the same check with every
word moved by 100 ms fails, so the test can fail."""

from __future__ import annotations

import ctypes.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pocketsphinx")
if not ctypes.util.find_library("espeak-ng"):
    pytest.skip("needs Debian's libespeak-ng (apt-get install espeak-ng)", allow_module_level=True)

import cosyllama  # noqa: E402
from cli_run import run_cli  # noqa: E402
from cosyllama.alignment import AlignError, WordTimer, align  # noqa: E402
from cosyllama.captions import Segment  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from espeak_words import Espeak  # noqa: E402
from measure_alignment import measure  # noqa: E402

# a few sentences of the full set: a question, quotes, a semicolon, a one-word exclamation, a long one
FEW = ["Did you remember to lock the back door before you left this morning?",
       "\"Come here,\" he said, \"and look at this.\"",
       "Stop!",
       "Bring a warm coat, two sandwiches, and a map; the path over the hills is long.",
       "Several small birds landed on the fence, waited a moment, and then flew away together toward the trees."]
MEDIAN_MS, P90_MS = 50, 120


@pytest.fixture(scope="module")
def espeak():
    return Espeak()


def test_word_onsets_on_espeak_ng_speech_are_within_the_targets():
    r = measure(FEW)
    assert r["measured_words"] >= 40
    assert r["median_ms"] <= MEDIAN_MS and r["p90_ms"] <= P90_MS, r
    wrong = measure(FEW, shift_s=0.1)  # an aligner 100 ms late everywhere fails the same check
    assert not (wrong["median_ms"] <= MEDIAN_MS and wrong["p90_ms"] <= P90_MS)


def test_align_is_importable_from_the_package_and_keeps_the_text_as_written(espeak):
    text = "Mister Zwarbleton met Kowalczyk at 7 on the 21st of May."
    audio, rate, spoken = espeak.speak(text)
    found = cosyllama.align(audio, rate, text)
    assert [w.word for w in found.words] == text.split()  # numbers and unknown names aligned, as written
    starts = [w.start for w in found.words]
    assert starts == sorted(starts) and all(w.end > w.start for w in found.words)
    assert found.words[-1].end <= audio.size / rate + 0.01 and found.language == "en" and found.seconds > 0


@pytest.mark.parametrize("case,message", [
    ("silent", "the audio is silent"),
    ("short", "too short to align"),
    ("no words", "no words to align"),
    ("stereo", "mono audio"),
    ("other text", "does not match the audio"),
    ("french", "no word aligner for language 'fr'"),
    ("bad code", "is not a language code"),
])
def test_what_cannot_be_aligned_is_said(espeak, case, message):
    audio, rate, _ = espeak.speak("Several small birds landed on the fence.")
    text, language = "Several small birds landed on the fence.", None
    if case == "silent":
        audio = np.zeros(rate, np.float32)
    elif case == "short":
        audio = audio[: rate // 20]
    elif case == "no words":
        text = "... !"
    elif case == "stereo":
        audio = np.stack([audio, audio])
    elif case == "other text":
        text = "banana " * 12
    elif case == "french":
        language = "fr"
    else:
        language = "../../etc"
    with pytest.raises(AlignError, match=message):
        align(audio, rate, text, language)


def test_without_pocketsphinx_the_error_names_the_extra(espeak, monkeypatch):
    import cosyllama.alignment as A

    monkeypatch.setitem(sys.modules, "pocketsphinx", None)
    monkeypatch.setattr(A, "_DECODERS", A._Decoders())
    audio, rate, _ = espeak.speak("Thank you.")
    with pytest.raises(AlignError, match=r"pip install 'cosyllama\[align\]'"):
        align(audio, rate, "Thank you.")


def _model_dir(root: Path, language: str) -> Path:
    """The wheel's English model laid out as a user provides a model: <root>/<language>/{model/, words.dict}."""
    from pocketsphinx import get_model_path

    d = root / language
    shutil.copytree(Path(get_model_path()) / "en-us" / "en-us", d / "model")
    shutil.copy(Path(get_model_path()) / "en-us" / "cmudict-en-us.dict", d / "words.dict")
    return d


def test_an_aligner_model_in_a_directory_is_used_for_its_language(espeak, tmp_path, monkeypatch):
    _model_dir(tmp_path, "xx")
    text = "How many people will come to dinner tonight?"
    audio, rate, _ = espeak.speak(text)
    found = align(audio, rate, text, "xx", aligner_dir=tmp_path)
    assert found.language == "xx" and found.words == align(audio, rate, text).words
    monkeypatch.setenv("COSYLLAMA_ALIGNERS", str(tmp_path))  # the same by the environment
    assert align(audio, rate, text, "xx").words == found.words
    with pytest.raises(AlignError, match="'zwarbleton' is not in the 'xx' aligner's dictionary"):
        align(audio, rate, "How many zwarbleton will come to dinner tonight?", "xx", aligner_dir=tmp_path)
    shutil.copy(tmp_path / "xx" / "words.dict", tmp_path / "xx" / "more.dict")
    with pytest.raises(AlignError, match="one acoustic model .* and one \\*.dict file; found 1 and 2"):
        align(audio, rate, text, "xx", aligner_dir=tmp_path)


def test_word_timer_places_each_segments_words_in_the_whole_output(espeak):
    texts = ["The weather was cold, so we stayed inside.", "...", "How many people will come to dinner tonight?",
             "banana banana banana banana banana banana banana banana"]
    spoken = [espeak.speak(t) if t != texts[3] else espeak.speak("Thank you.") for t in texts[:1] + texts[2:]]
    rate = spoken[0][1]
    pieces = [spoken[0][0], np.zeros(rate // 2, np.float32), spoken[1][0], spoken[2][0]]
    segments, offset = [], 0
    timer = WordTimer(segments)
    for i, (text, audio) in enumerate(zip(texts, pieces)):
        segments.append(Segment(i, text, offset, offset + audio.size, rate))
        timer.add(i, audio)
        offset += audio.size
    timer.finish()
    first, silence, third, wrong = segments
    assert silence.words == () and wrong.words is None and "does not match" in wrong.words_why
    for seg, (_, _, truth) in ((first, spoken[0]), (third, spoken[1])):
        errors = [abs(w.start - seg.start - t.onset) for w, t in zip(seg.words, truth) if t.onset is not None]
        assert np.median(errors) < MEDIAN_MS / 1000
        assert seg.start <= seg.words[0].start and seg.words[-1].end <= seg.end


def test_word_times_leave_the_audio_as_it_is_and_come_after_each_segment(tts):
    from test_captions import PROMPT, TEXT

    plain = tts.cross_lingual(TEXT, PROMPT, seed=3).audio()
    s = tts.cross_lingual(TEXT, PROMPT, seed=3, word_times=True)
    first = next(s)
    assert s.timings.align == 0  # nothing was aligned before the first audio
    assert first.is_final and len(s.segments) == 1 and s.segments[0].words is None  # not aligned before it went
    assert s.segments[0].words_why is None
    s.finish_words()
    assert s.segments[0].words is not None or s.segments[0].words_why  # the tiny model speaks noise
    rest = s.audio()
    np.testing.assert_array_equal(np.concatenate([first.samples, rest]), plain)
    assert all(seg.words is not None or seg.words_why for seg in s.segments) and s.timings.align > 0


def test_cli_align_writes_captions_from_another_folder(espeak, tmp_path):
    import soundfile as sf

    srt = pytest.importorskip("srt")
    text = "Thank you. How many people will come to dinner tonight?"
    audio, rate, _ = espeak.speak(text)
    (tmp_path / "data").mkdir()
    sf.write(tmp_path / "data" / "speech.wav", audio, rate)
    (tmp_path / "data" / "speech.txt").write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    r = run_cli("align", "--audio", "../data/speech.wav", "--text-file", "../data/speech.txt", "--out", "out.srt",
                cwd=work)
    assert r.returncode == 0, r.stderr
    assert "10 words in 2 sentence(s)" in r.stdout and "per audio second" in r.stdout
    subs = list(srt.parse((work / "out.srt").read_text()))
    assert [" ".join(s.content.split()) for s in subs] == ["Thank you.", "How many people will come to dinner tonight?"]
    r = run_cli("align", "--audio", "../data/speech.wav", "--text", text, "--out", "out.json", cwd=work)
    d = json.loads((work / "out.json").read_text())
    assert r.returncode == 0 and d["level"] == "word" and len(d["segments"][1]["words"]) == 8


@pytest.mark.parametrize("args,message", [
    (["--text", "Hi.", "--out", "o.txt"], "--out: captions 'o.txt': the file name must end in"),
    (["--text", "Hi.", "--out", "no/o.srt"], "--out: cannot write 'no/o.srt': directory 'no' does not exist"),
    (["--text", "  ", "--out", "o.srt"], "the text is empty"),
    (["--text", "Bonjour.", "--language", "fr", "--out", "o.srt"], "no word aligner for language 'fr'"),
    (["--text-file", "none.txt", "--out", "o.srt"], "--text-file 'none.txt' does not exist"),
    (["--text-file", "latin1.txt", "--out", "o.srt"],
     "--text-file 'latin1.txt' is not UTF-8 text (invalid continuation byte at byte 3); save it as UTF-8"),
    (["--text-file", ".", "--out", "o.srt"], "--text-file '.' is a directory"),
])
def test_cli_align_refuses_bad_input_in_one_line(tmp_path, args, message):
    import soundfile as sf

    (tmp_path / "latin1.txt").write_bytes("Caf\u00e9 au lait.".encode("latin-1"))
    sf.write(tmp_path / "a.wav", np.sin(np.arange(16000) / 5).astype(np.float32) * 0.3, 16000)
    r = run_cli("align", "--audio", "a.wav", *args, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_align_names_a_missing_audio_file(tmp_path):
    r = run_cli("align", "--audio", "none.wav", "--text", "Hi.", "--out", "o.srt", cwd=tmp_path)
    assert r.returncode == 2 and "--audio file 'none.wav' does not exist" in r.stderr



def test_symbols_and_other_digits_do_not_break_alignment(espeak):
    text = "Room 2 has x² and ٣ cats, the 1a plan, café ™."
    audio, rate, _ = espeak.speak(text)
    assert [w.word for w in align(audio, rate, text).words] == text.split()[:-1]  # "™." has nothing to say


def test_a_fault_in_the_aligner_never_ends_a_synthesis(monkeypatch):
    import cosyllama.alignment as A

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(A, "align", broken)
    segments = [Segment(0, "Hello there.", 0, 24000, 24000)]
    timer = WordTimer(segments)
    timer.add(0, np.ones(24000, np.float32) * 0.1)
    timer.finish()
    assert segments[0].words is None and "internal error" in segments[0].words_why
