"""The low-latency first chunk (``SynthesisOptions.first_chunk_tokens``, docs/streaming.md) beside the reference's
schedule: for each setting, the first audio of a streamed synthesis (``Timings.first_chunk``, medians of
``--repeat`` interleaved rounds) and how far its output is from the reference schedule's, as the flow's mel (what
each chunk hands the vocoder: the split first chunk's frames see less of their attention block) and as the
audio's log-mel spectrum (the vocoder's sine source carries a phase through the whole utterance, so waveforms
are compared by their spectra, not sample by sample). Greedy, one seed: the speech tokens are the same.

    PYTHONPATH=src python scripts/measure_first_chunk.py --model-dir tests/fixtures/cosyvoice3-tiny/model \\
        --prompt-wav tests/fixtures/cosyvoice3-tiny/wavs/prompt_en_16k.wav --prompt-text "Hello, this is my voice."
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from cosyllama.tts import TTS

TEXT = ("The old lighthouse keeper climbed the long winding stairs every single evening before the sun went down "
        "over the grey and restless sea.")


def log_mel(samples: np.ndarray, sr: int, n_fft: int = 1024, hop: int = 256, bands: int = 80) -> np.ndarray:
    """An 80-band log-mel spectrogram (HTK mel scale, triangular bands; natural log of power + 1e-5)."""
    x = torch.from_numpy(np.asarray(samples, np.float32))
    spec = torch.stft(x, n_fft, hop, window=torch.hann_window(n_fft), return_complex=True).abs() ** 2
    freqs = torch.linspace(0, sr / 2, n_fft // 2 + 1)
    mel = lambda f: 2595 * torch.log10(1 + f / 700)  # noqa: E731
    edges = torch.linspace(0, float(mel(torch.tensor(sr / 2))), bands + 2)
    hz = 700 * (10 ** (edges / 2595) - 1)
    fb = torch.zeros(bands, freqs.numel())
    for b in range(bands):
        lo, mid, hi = hz[b], hz[b + 1], hz[b + 2]
        fb[b] = torch.clamp(torch.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), min=0)
    return torch.log(fb @ spec + 1e-5).numpy()


def run(tts: TTS, voice, text: str, first: int | None, seed: int, max_tokens: int | None):
    mels: list[torch.Tensor] = []
    real = tts.token2wav._vocode_new

    def spy(st, mel, finalize):
        mels.append(mel.detach().float().cpu())
        return real(st, mel, finalize)

    tts.token2wav._vocode_new = spy
    try:
        syn = tts.synthesize(text, voice=voice, seed=seed, greedy=True, stream=True, first_chunk_tokens=first,
                             max_tokens=max_tokens)
        chunks = [c.samples for c in syn]
    finally:
        tts.token2wav._vocode_new = real
    return syn.timings.first_chunk, [c.size for c in chunks], torch.cat(mels, dim=2)[0].numpy(), np.concatenate(chunks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--gguf", default=None)
    p.add_argument("--prompt-wav", required=True)
    p.add_argument("--prompt-text", default=None)
    p.add_argument("--text", default=TEXT)
    p.add_argument("--first-chunk-tokens", default="8,12,16", help="comma-separated settings beside the reference")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="auto")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--prompt-cache-mb", type=float, default=None,
                   help="the prompt cache's bound (0: none, so the low-latency first chunk solves the prompt's last "
                        "block with its own tokens, as it does wherever a voice's frames cannot be kept)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="at most this many speech tokens (a random-weight model rarely stops by itself)")
    a = p.parse_args(argv)
    kw = {"llm": "llamacpp", "gguf": a.gguf} if a.gguf else {}
    tts = TTS(a.model_dir, threads=a.threads, precision=a.precision, prompt_cache_mb=a.prompt_cache_mb, **kw)
    voice = tts.make_voice(a.prompt_wav, a.prompt_text)
    settings = [None] + [int(x) for x in a.first_chunk_tokens.split(",") if x]
    tts.synthesize(a.text, voice=voice, seed=a.seed, greedy=True, stream=True,
                   max_tokens=a.max_tokens).audio()  # warm
    tts.warm_voice(voice, low_latency=len(settings) > 1)  # the voice's frames, as a server warms them
    firsts = {s: [] for s in settings}
    out = {}
    for _ in range(a.repeat):
        for s in settings:  # interleaved, so a busy moment falls on every setting alike
            first, sizes, mel, audio = run(tts, voice, a.text, s, a.seed, a.max_tokens)
            firsts[s].append(first)
            out[s] = (sizes, mel, audio)
    sr = tts.sample_rate
    ref_sizes, ref_mel, ref_audio = out[None]
    ref_spec = log_mel(ref_audio, sr)
    print(f"text: {len(a.text)} characters; {ref_audio.size / sr:.2f} s of audio; threads {a.threads}, "
          f"precision {a.precision}, {'llama.cpp ' + a.gguf if a.gguf else 'PyTorch LLM'}")
    print("first chunk | first audio s (median) | chunk samples | mel max |diff| first part / rest | "
          "log-mel mean |diff| first part / rest (nats)")
    whole = tts.synthesize(a.text, voice=voice, seed=a.seed, greedy=True, max_tokens=a.max_tokens).audio()
    wd = np.abs(log_mel(whole, sr) - ref_spec[:, :log_mel(whole, sr).shape[1]])
    print(f"{'(yardstick) the reference non-streamed':>40}: log-mel mean |diff| from the reference stream "
          f"{wd.mean():.3f} nats (the same tokens; chunking alone changes the vocoder's sine phase and noise)")
    for s in settings:
        sizes, mel, audio = out[s]
        n = mel.shape[1]
        split = 2 * (s or 0)  # mel frames of the split first chunk (2 per token)
        d = np.abs(mel[:, :n] - ref_mel[:, :n])
        spec = log_mel(audio, sr)
        sd = np.abs(spec - ref_spec[:, :spec.shape[1]])
        cut = max(1, round(split * 480 / 256))  # the first part in spectrogram frames
        head = (f"{d[:, :split].max():.3f} / {d[:, split:].max():.3f}" if s else "0 / 0")
        shead = (f"{sd[:, :cut].mean():.3f} / {sd[:, cut:].mean():.3f}" if s else "0 / 0")
        print(f"{str(s) if s else 'reference':>11} | {statistics.median(firsts[s]):22.3f} | {str(sizes[:4]):>13} | "
              f"{head:>30} | {shead}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
