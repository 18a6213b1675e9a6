"""How even ``--loudness`` makes voices of very different prompt levels (docs/loudness.md): one prompt clip
scaled to each of ``--levels`` dB, each made a voice, each speaking ``--text`` non-streamed and streamed with
the target; prints each output's integrated loudness (BS.1770) and true peak, and the spread.

    PYTHONPATH=src python scripts/measure_loudness.py --model-dir tests/fixtures/cosyvoice3-tiny/model \\
        --prompt-wav tests/fixtures/cosyvoice3-tiny/wavs/prompt_en_16k.wav --prompt-text "Hello, this is my voice." \\
        --target -30
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

from cosyllama import loudness
from cosyllama.tts import TTS

PARAGRAPH = ("The old lighthouse keeper climbed the stairs every evening before sunset. He checked the lamp, wiped "
             "the glass, and wrote the weather in a small book. Ships passed far out at sea, and some of their "
             "captains waved when the light came on. In winter the storms were loud and the waves broke over the "
             "rocks below the tower. He did not mind the noise, because the light kept everyone safe. When spring "
             "came he painted the door blue and planted flowers by the wall.")


def _db(x: float) -> float:
    return loudness.db(x) if x > 0 else float("-inf")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--prompt-wav", required=True)
    p.add_argument("--prompt-text", default=None)
    p.add_argument("--text", default="Hello there, how are you today? The weather is fine and the tea is hot.")
    p.add_argument("--paragraph", action="store_true", help="speak PARAGRAPH (six sentences) instead of --text")
    p.add_argument("--target", type=float, default=-16.0, help="LUFS")
    p.add_argument("--levels", default="0,-10,-20,-30", help="dB the prompt clip is scaled by, comma-separated")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--stream-first", action="store_true",
                   help="speak each voice streamed before non-streamed: each stream is then the voice's first")
    p.add_argument("--json", help="also write the rows here")
    a = p.parse_args(argv)
    if a.paragraph:
        a.text = PARAGRAPH
    tts = TTS(a.model_dir, threads=a.threads, precision=a.precision)
    wav, sr = sf.read(a.prompt_wav, dtype="float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for level in (float(x) for x in a.levels.split(",")):
            path = Path(tmp) / f"p{level:+.0f}.wav"
            sf.write(path, wav * np.float32(10 ** (level / 20)), sr, subtype="FLOAT")
            voice = tts.make_voice(path, a.prompt_text)
            row = {"prompt_db": level}
            for stream in ((True, False) if a.stream_first else (False, True)):
                kw = dict(voice=voice, seed=a.seed, greedy=True, stream=stream)
                raw = tts.synthesize(a.text, **kw).audio()
                syn = tts.synthesize(a.text, **kw, loudness=a.target)
                out = syn.audio()
                key = "stream" if stream else "whole"
                row[key] = {"raw_lufs": loudness.integrated_loudness(raw, tts.sample_rate),
                            "lufs": loudness.integrated_loudness(out, tts.sample_rate),
                            "true_peak_dbfs": _db(loudness.true_peak(out)),
                            "gain_db": syn.timings.loudness_gain_db, "why": syn.timings.loudness_why,
                            "held": syn.timings.loudness_held, "from": syn.timings.loudness_from,
                            "seconds": out.size / tts.sample_rate}
            rows.append(row)
    print(f"target {a.target:g} LUFS, ceiling {loudness.CEILING_DBFS:g} dBFS true peak")
    print("prompt dB | kind   | raw LUFS | out LUFS | error LU | true peak dBFS | gain dB (why)   | held | from")
    for row in rows:
        for key in ("whole", "stream"):
            m = row[key]
            err = m["lufs"] - a.target if m["lufs"] is not None else float("nan")
            print(f"{row['prompt_db']:9.0f} | {key:6} | {m['raw_lufs']:8.2f} | {m['lufs']:8.2f} | {err:+8.2f} | "
                  f"{m['true_peak_dbfs']:14.2f} | {m['gain_db']:+6.2f} ({m['why']:8}) | {m['held']:4} | {m['from']}")
    for key in ("whole", "stream"):
        vals = [r[key]["lufs"] for r in rows if r[key]["lufs"] is not None]
        raw = [r[key]["raw_lufs"] for r in rows if r[key]["raw_lufs"] is not None]
        print(f"{key}: out {min(vals):.2f}..{max(vals):.2f} LUFS (spread {max(vals) - min(vals):.2f} LU, worst error "
              f"{max(abs(v - a.target) for v in vals):.2f} LU); without --loudness {min(raw):.2f}..{max(raw):.2f} "
              f"(spread {max(raw) - min(raw):.2f} LU); highest true peak "
              f"{max(r[key]['true_peak_dbfs'] for r in rows):.2f} dBFS")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
