"""``cosyllama batch`` pronunciation (docs/pronunciation.md): ``--lexicon FILE`` for every row, a voice folder's
``lexicon.txt`` for its voice's rows, a row's ``lexicon`` field (``{"word": "[t][o]..."}``, as the HTTP request's)
for that row, the later winning; a bad file is one line and exit 2 before the model, a bad field a bad row said
with its line; a row's lexicon is part of what makes it done.

The effect is checked where it is made, as tests/test_lexicon_doors.py does: the text segments the frontend hands
the tokenizer (a recording wrapper around ``Frontend._segments``) hold the entries' tokens."""

import shutil
import threading

import pytest

from batch_helpers import results, write_manifest
from batch_helpers import run_batch as batch
from cosyllama.batch.manifest import Row, _digest, read_manifest
from helpers import FIXTURES, MODEL_DIR

EN, EN_TEXT = FIXTURES / "wavs" / "prompt_en_16k.wav", "Hello, this is a short prompt."
RUN_LEX = {"tomato": "[T][AH0][M][EY1][T][OW2]", "potato": "[P][AH0][T][EY1][T][OW2]"}
VOICE_LEX = {"tomato": "[T][AH0][M][AA1][T][OW2]", "banana": "[B][AH0][N][AE1][N][AH0]"}
ROW_TOMATO = "[T][OW1][M][EY1][T][OW2]"
TEXT = "A tomato, a potato and a banana."
CLIP = {"id": "clip", "mode": "zero-shot", "text": TEXT, "prompt_wav": str(EN), "prompt_text": EN_TEXT,
        "greedy": True}
VOICE = {"id": "voice", "mode": "zero-shot", "text": TEXT, "voice": "lex", "greedy": True}
OWN = dict(VOICE, id="own", lexicon={"Tomato": ROW_TOMATO})


def test_the_lexicon_field_is_checked_as_a_lexicon(tmp_path):
    rows = [OWN, dict(VOICE, id="empty", lexicon={}), dict(VOICE, id="none", lexicon=None),
            dict(VOICE, id="b1", lexicon=["tomato"]), dict(VOICE, id="b2", lexicon={"tomato": ["[T]", "[AH0]"]}),
            dict(VOICE, id="b3", lexicon={"tomato": "[T][XX1]"}), dict(VOICE, id="b4", lexicon={"tomato": "tomahto"}),
            dict(VOICE, id="b5", lexicon={"tomato": "[T]", "TOMATO": "[T]"}),
            dict(VOICE, id="b6", lexicon={"a|b": "[T]"})]
    m = read_manifest(write_manifest(tmp_path / "m.jsonl", rows), voices={"lex"}, voice_transcripts={"lex": True})
    assert {r.id: r.lexicon for r in m.rows} == {"own": (("Tomato", ROW_TOMATO),), "empty": None, "none": None}
    errs = {b.line: b.error for b in m.bad}
    assert errs[4] == 'lexicon must be an object {"word": "[t][o][k]..."} (docs/pronunciation.md), got list'
    assert errs[5] == 'lexicon entry \'tomato\': its tokens must be a string, e.g. "[T][AH0][M]", not list'
    assert errs[6].startswith("lexicon entry 'tomato': unknown token [XX1]: not one of CosyVoice3's pronunciation")
    assert errs[7].startswith("lexicon entry 'tomato': 'tomahto' is not a token")
    assert errs[8] == "lexicon entry 'TOMATO': duplicate word 'TOMATO' (first at entry 'tomato')"
    assert errs[9].startswith("lexicon entry 'a|b': word 'a|b' holds '|'")
    own = m.rows[0]
    assert own.options().lexicon.apply("One tomato.") == f"One {ROW_TOMATO}."
    assert m.rows[1].options().lexicon is None
    assert Row.from_json(own.to_json()) == own  # as a Ray actor gets it
    # the digest: an empty or absent lexicon is the row as before lexicons existed; entries are part of it
    digest = {r.id: r.digest for r in m.rows}
    assert digest["empty"] == _digest(dict(VOICE, id="empty")) and digest["none"] == _digest(dict(VOICE, id="none"))
    assert digest["own"] != _digest(VOICE | {"id": "own"})


class Recorder:
    """Every spoken segment the frontend hands on (``Frontend._segments``, wrapped on the class), in order."""

    def __init__(self, monkeypatch):
        from cosyllama.frontend import Frontend

        inner, self.segments, lock = Frontend._segments, [], threading.Lock()

        def record(frontend, *args, **kw):
            out = inner(frontend, *args, **kw)
            with lock:
                self.segments.extend(spoken for spoken, _shown in out)
            return out

        monkeypatch.setattr(Frontend, "_segments", record)


@pytest.fixture
def voices(tmp_path):
    """A voice directory holding the folder ``lex``, with its lexicon.txt."""
    d = tmp_path / "voices"
    (d / "lex").mkdir(parents=True)
    shutil.copy(EN, d / "lex" / "ref.wav")
    (d / "lex" / "ref.txt").write_text(EN_TEXT)
    (d / "lex" / "lexicon.txt").write_text("".join(f"{w}\t{t}\n" for w, t in VOICE_LEX.items()))
    return d


def test_the_runs_the_voices_and_the_rows_lexicons_each_reach_their_rows(tmp_path, voices, monkeypatch):
    lex = tmp_path / "lex.txt"
    lex.write_text("".join(f"{w}\t{t}\n" for w, t in RUN_LEX.items()))
    m = write_manifest(tmp_path / "m.jsonl", [CLIP, VOICE, OWN])
    rec = Recorder(monkeypatch)
    out = tmp_path / "out"
    assert batch(m, out, "--voices", str(voices), "--lexicon", str(lex), "--concurrency", "1") == 0
    assert all(r["status"] == "ok" for r in results(out).values())
    said = rec.segments
    assert len(said) == 3, said  # one segment per row, in manifest order (one row at a time)
    # the run's for a clip; the voice folder's over it; the row's over both
    assert RUN_LEX["tomato"] in said[0] and RUN_LEX["potato"] in said[0] and "banana" in said[0]
    assert VOICE_LEX["tomato"] in said[1] and VOICE_LEX["banana"] in said[1] and RUN_LEX["potato"] in said[1]
    assert ROW_TOMATO in said[2] and VOICE_LEX["banana"] in said[2] and RUN_LEX["potato"] in said[2]

    # a row whose lexicon changes is made again; the others stay done
    m = write_manifest(tmp_path / "m.jsonl", [CLIP, VOICE, dict(OWN, lexicon={"banana": "[B][AA1]"})])
    rec.segments.clear()
    assert batch(m, out, "--voices", str(voices), "--lexicon", str(lex)) == 0
    assert rec.segments == [TEXT.replace("tomato", VOICE_LEX["tomato"]).replace("potato", RUN_LEX["potato"])
                            .replace("banana", "[B][AA1]")]


def test_a_bad_lexicon_file_is_one_line_and_exit_2_before_the_model(tmp_path, capsys, monkeypatch):
    import cosyllama.batch.engine as engine

    monkeypatch.setattr(engine, "load_models", lambda *a: pytest.fail("the model was loaded"))
    m = write_manifest(tmp_path / "m.jsonl", [CLIP])
    bad = tmp_path / "lex.txt"
    bad.write_text("tomato\t[T][AH0]\npotato\t[P][XX1]\n")
    for extra in ((), ("--dry-run",)):
        assert batch(m, tmp_path / "o", "--lexicon", str(bad), *extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"lexicon {bad}:2: unknown token [XX1]" in err, err
    bad.write_bytes(b"tomato\t[T]\n\xff\xfe\n")
    assert batch(m, tmp_path / "o", "--lexicon", str(bad)) == 2
    assert f"lexicon {bad}:2: not UTF-8" in capsys.readouterr().err
    assert batch(m, tmp_path / "o", "--lexicon", str(tmp_path / "none.txt")) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


class Vocabulary:
    """A model vocabulary without [EY1]."""

    def token_to_id(self, token):
        return None if token == "[EY1]" else 1


def test_entries_the_models_vocabulary_lacks_fail_their_row_or_the_run(tmp_path):
    """Every pronunciation token is in CosyVoice3's vocabulary, so these hold the checks on a vocabulary
    that lacks one: a row's entry fails that row (said in its result), the run's lexicon the run."""
    from types import SimpleNamespace

    import numpy as np

    from cosyllama.batch.engine import EngineOptions, RowSynthesizer, run_lexicon
    from cosyllama.options import LoadOptions
    from cosyllama.text.lexicon import Lexicon, LexiconError

    syn = SimpleNamespace(audio=lambda: np.zeros(2400, np.float32),
                          timings=SimpleNamespace(tokens=[[1]], frontend=0, llm=0, token2wav=0, retries=[]))
    tts = SimpleNamespace(sample_rate=24000, run=lambda request, cancel: syn,
                          frontend=SimpleNamespace(tokenizer=Vocabulary()))
    synth = RowSynthesizer(tts, tmp_path, "wav")
    row = Row(line=3, id="r", text="hi", mode="cross-lingual", voice="v", lexicon=(("tomato", RUN_LEX["tomato"]),))
    rec = synth.run(row)
    assert (rec["status"], rec["line"], rec["stage"]) == ("error", 3, "synthesis")
    assert "entry 'tomato'" in rec["error"] and "[EY1]" in rec["error"]
    assert synth.run(Row(line=4, id="p", text="hi", mode="cross-lingual", voice="v",
                         lexicon=(("potato", "[P][AH0]"),)))["status"] == "ok"
    models = SimpleNamespace(frontend=SimpleNamespace(tokenizer=Vocabulary()))
    opts = EngineOptions(LoadOptions(model_dir=MODEL_DIR), lexicon=Lexicon.from_mapping(RUN_LEX))
    with pytest.raises(LexiconError, match=r"\[EY1\] is not in this model's vocabulary"):
        run_lexicon(opts, models)


def test_ray_gives_the_same_files_with_lexicons_and_loudness(tmp_path, voices):
    """The run's lexicon (pickled with the engine options), a voice folder's, a row's, and loudness targets
    (a row's and --loudness) reach Ray's actors: the same files and results as the local run."""
    pytest.importorskip("ray.data", reason="Ray is not installed: pip install 'cosyllama[ray]'")
    pytest.importorskip("pyloudnorm")
    import torch

    lex = tmp_path / "lex.txt"
    lex.write_text("".join(f"{w}\t{t}\n" for w, t in RUN_LEX.items()))
    m = write_manifest(tmp_path / "m.jsonl", [dict(CLIP, loudness=-35), VOICE, OWN])
    flags = ("--voices", str(voices), "--lexicon", str(lex), "--loudness", "-30", "--retries", "1")
    assert batch(m, tmp_path / "local", *flags) == 0
    # the actor computes with as many threads as this process did (float sums depend on the split)
    assert batch(m, tmp_path / "ray", *flags, "--ray", "--ray-cpus", str(torch.get_num_threads()),
                 "--ray-batch-size", "3") == 0
    local, ray = results(tmp_path / "local"), results(tmp_path / "ray")
    for rid in ("clip", "voice", "own"):
        assert (tmp_path / "ray" / f"{rid}.wav").read_bytes() == (tmp_path / "local" / f"{rid}.wav").read_bytes()
        keep = ("status", "bytes", "tokens", "digest", "loudness", "loudness_gain_db", "retries")
        assert {k: ray[rid].get(k) for k in keep} == {k: local[rid].get(k) for k in keep}, rid
    assert [local[rid]["loudness"] for rid in ("clip", "voice", "own")] == [-35.0, -30.0, -30.0]
    # the lexicons made a difference: the same text in the same voice, with and without the row's own
    assert local["own"]["digest"] != local["voice"]["digest"]
    assert (tmp_path / "local" / "own.wav").read_bytes() != (tmp_path / "local" / "voice.wav").read_bytes()
