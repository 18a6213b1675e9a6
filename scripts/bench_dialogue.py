"""What a dialogue costs beside its turns spoken one by one (docs/dialogue.md; issue #51's target: no more than
the turns alone plus the pauses, which are silence and cost nothing to make).

Full-size random model from ``cosyllama bench``'s cache (made on first use), speech-layout GGUF Q8_0 (or the
PyTorch LLM with ``--llm torch``), two voices from the bench's prompt clip, a script of ``--turns`` turns
alternating between them, each turn's length forced to ``--tokens`` speech tokens (the random model has no
stop). In interleaved rounds (``dialogue``, ``turns``) it times ``TTS.dialogue`` and the same turns as
separate ``TTS.synthesize`` calls with the seeds the dialogue gives them, and checks that the audio is the same:

    python scripts/bench_dialogue.py --threads 2 --turns 6 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from cosyllama.dialogue import Turn, turn_seed
from cosyllama.progress import to_stderr
from cosyllama.timing import rounds
from cosyllama.tools.bench_setup import ensure_full_model, ensure_gguf, machine_info, prompt_wav
from cosyllama.tts import TTS

LINES = ["Good morning, did you sleep well last night?", "Not really, the neighbours had a party until three.",
         "That sounds awful; did you ask them to stop?", "I did, but nobody heard me over the music."]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--tokens", type=int, default=75, help="speech tokens per turn (3 s of audio)")
    p.add_argument("--pause", type=float, default=0.4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--llm", choices=("llamacpp", "torch"), default="llamacpp")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    model = ensure_full_model(to_stderr)
    kw = {"gguf": ensure_gguf(model, "speech", "Q8_0", to_stderr)} if args.llm == "llamacpp" else {}
    tts = TTS(model, llm=args.llm, threads=args.threads, **kw)
    clip = prompt_wav(5.0)
    tts.add_voice("anna", clip)
    tts.add_voice("bob", clip)
    turns = [Turn("anna" if k % 2 == 0 else "bob", LINES[k % len(LINES)]) for k in range(args.turns)]
    opts = {"seed": 1, "max_tokens": args.tokens, "ignore_stop": True}

    def dialogue():
        return tts.dialogue(turns, pause=args.pause, **opts).audio()

    def one_by_one():
        return [tts.synthesize(t.text, voice=t.voice, **{**opts, "seed": turn_seed(1, k)}).audio()
                for k, t in enumerate(turns)]

    whole, parts = dialogue(), one_by_one()  # warm-up, and the check that they are the same audio
    gap = int(round(args.pause * tts.sample_rate))
    joined = np.concatenate([x for k, a in enumerate(parts) for x in ((np.zeros(gap, np.float32), a) if k else (a,))])
    assert np.array_equal(whole, joined), "a dialogue is its turns and pauses"
    times: dict[str, list[float]] = {"dialogue": [], "turns": []}
    for name in rounds(list(times), args.repeat):
        t0 = time.perf_counter()
        (dialogue if name == "dialogue" else one_by_one)()
        times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"machine": machine_info(args.threads), "llm": args.llm, "turns": args.turns, "tokens": args.tokens,
              "pause_s": args.pause, "audio_s": whole.size / tts.sample_rate, "median_s": med,
              "ratio": med["dialogue"] / med["turns"], "all_s": times}
    print(f"{args.turns} turns, {result['audio_s']:.1f} s of audio: dialogue {med['dialogue']:.2f} s, turns one by "
          f"one {med['turns']:.2f} s (ratio {result['ratio']:.3f}; medians of {args.repeat} interleaved rounds)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
