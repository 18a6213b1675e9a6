"""How close cosyllama's word times are to the truth, on speech nobody here wrote: English sentences that
espeak-ng speaks (its word events give each word's onset, scripts/espeak_words.py), aligned by
:func:`cosyllama.align`. Prints the median and 90th percentile of |onset error| and the aligner's cost
per audio second; docs/captions.md quotes the numbers.

    python scripts/measure_alignment.py            # the 17 sentences below (over 200 measured words)
    python scripts/measure_alignment.py --json out.json

Needs Debian's espeak-ng (libespeak-ng) and the align extra (PocketSphinx).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from espeak_words import Espeak  # noqa: E402

# Varied length and punctuation: questions, exclamations, quotes, semicolons, colons, contractions, one-word
# sentences and a 40-word one.
SENTENCES = [
    "The weather was cold, so we stayed inside and read old letters by the fire.",
    "Did you remember to lock the back door before you left this morning?",
    "Stop!",
    "She opened the box slowly; inside, wrapped in paper, was a small silver key.",
    "Our train leaves at seven, but the station is far, and the roads are busy on Monday mornings.",
    "Why would anyone build a house so close to the river, where every spring the water rises over the fields?",
    "Thank you.",
    "The committee met on Tuesday and agreed that the new library should open in the autumn, after the last "
    "repairs are finished and the books have been moved from the old building across the square.",
    "\"Come here,\" he said, \"and look at this.\"",
    "It's not what we expected, isn't it?",
    "Several small birds landed on the fence, waited a moment, and then flew away together toward the trees.",
    "A quiet voice answered from the dark room: nobody had been there for years.",
    "Please write your name, your address, and the date at the top of the first page.",
    "When the music stopped, the dancers froze in place, and for a long second the whole hall was silent.",
    "Bring a warm coat, two sandwiches, and a map; the path over the hills is long.",
    "How many people will come to dinner tonight?",
    "He laughed, shook his head, and walked back into the garden without another word.",
]


def measure(sentences=SENTENCES, shift_s: float = 0.0, voice: str = "en-us") -> dict:
    """Speak each sentence, align it, and compare each word's aligned start (plus ``shift_s``, to check that a
    wrong aligner fails the targets) with espeak-ng's onset. Returns the errors in ms and the summary."""
    from cosyllama.alignment import align

    speaker = Espeak(voice)
    errors, cost, audio_s, words = [], 0.0, 0.0, 0
    for text in sentences:
        audio, rate, spoken = speaker.speak(text)
        found = align(audio, rate, text)
        assert [w.word for w in found.words] == [w.word for w in spoken], "the aligner's words are the text's"
        cost += found.seconds
        audio_s += audio.size / rate
        words += len(spoken)
        errors += [1000 * abs(w.start + shift_s - s.onset) for w, s in zip(found.words, spoken) if s.onset is not None]
    e = np.array(errors)
    return {"sentences": len(sentences), "words": words, "measured_words": int(e.size),
            "median_ms": float(np.median(e)), "p90_ms": float(np.percentile(e, 90)), "max_ms": float(e.max()),
            "audio_s": audio_s, "align_s": cost, "align_s_per_audio_s": cost / audio_s, "errors_ms": e.tolist()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the summary and every error here")
    args = p.parse_args()
    r = measure()
    print(f"{r['sentences']} sentences, {r['measured_words']} of {r['words']} words with an espeak-ng onset: "
          f"|onset error| median {r['median_ms']:.0f} ms, 90th percentile {r['p90_ms']:.0f} ms, "
          f"max {r['max_ms']:.0f} ms; aligner {r['align_s']:.2f} s for {r['audio_s']:.1f} s of audio "
          f"({r['align_s_per_audio_s']:.3f} s per audio second)")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
