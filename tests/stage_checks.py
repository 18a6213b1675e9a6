"""End-to-end comparisons with the recorded upstream runs that hold on every CPU class and on CUDA.

An end-to-end run is checked stage by stage, each stage against the reference *for the inputs it
received*:

* the speech tokens and the streamed chunk sizes equal the recording exactly;
* every flow call's mel is the recorded mel within the flow tolerance (1e-3);
* every vocoder call's waveform is the reference vocoder's (the reference path of :class:`HiFT`,
  which ``test_vocoder.py`` holds to the recording) for the mel that call received, within the
  vocoder tolerance (1e-3).

The whole waveform is then compared with the recording by :func:`check_whole_waveform`, at a
tolerance measured across CPU kernels. It cannot be the per-stage 1e-3: this tiny random vocoder is
chaotic. Its f0 predictor turns a 1e-6 change of the mel (what another summation order in the flow's
matrix products gives: AVX2 vs AVX-512 kernels, another thread count, CUDA) into ~1e-4 Hz of f0, and
the source integrates f0 into a phase over the whole clip, so late samples drift by up to ~0.05 while
the spectrum stays put. Measured with ``python tests/stage_checks.py`` (every recorded case, the flow
mel perturbed by Gaussian noise in several seeds, on AVX2 and DEFAULT kernels): see WAVE_TOLERANCES.
"""

from __future__ import annotations

import numpy as np
import torch

from helpers import load_fixture, maxdiff

ATOL = 1e-3  # flow mel and vocoder waveform, as in test_flow.py / test_vocoder.py

# The whole-waveform bounds (module docstring; the numbers are in docs/development.md, section
# "End-to-end waveform drift"). max_abs: worst sample; rel_rms: RMS of the difference over RMS of the
# recording; logmel: mean abs difference of the natural-log mel spectra (phase-blind: drift moves it
# little, a wrong stage a lot).
#
# Error model: the vocoder turns a deviation of the mel it gets into waveform drift that grows with that
# deviation (measured with `python tests/stage_checks.py --perturb SIGMA --seeds 4`, Gaussian noise of SIGMA
# on every flow-mel element, every recorded case, worst of the seeds); the bound is about twice the worst
# drift at the deviation the run's inputs can carry:
# - "cpu": inputs recorded from the reference (no frontend). The flow's own float32 rounding across kernels,
#   vendors and thread counts moves its mel by up to ~4e-6 (Intel AMX: 2.9-3.8e-6, native and forced to
#   AVX2), the maximum of a SIGMA 1e-6 field over ~10^4 elements: 0.091, 0.019, 0.014 over 3 seeds on AVX2 AMD,
#   0.18, 0.026, 0.021 over 12 seeds on Intel AMX (the drift is heavy-tailed: 3 seeds undersampled it).
# - "cpu-frontend": inputs computed by our frontend from the prompt audio. Its float32 log-spectra round
#   differently per CPU vendor (tests/helpers.py, log-spectrum error model), and the flow carries that into
#   its mel: 1.9e-5 at most on Intel AMX (0 to 1e-6 on AMD), which a Gaussian field reaches at SIGMA 5e-6
#   (its maximum over the ~10^4 elements is ~4 SIGMA): 0.44, 0.063, 0.045 (the same over 4 and 12 seeds).
# - "cuda": the flow's mel on CUDA is up to ~4e-6 from the CPU's, measured as a 4e-6 perturbation (0.29,
#   0.051, 0.037).
# A wrong token, a wrong DiT sign or a wrong hop gives at least 1.0, 0.49, 0.19 (test_stage_checks.py, which
# also runs the wrong token against the "cpu-frontend" bounds).
WAVE_TOLERANCES = {"cpu": {"max_abs": 0.35, "rel_rms": 0.05, "logmel": 0.04},
                   "cpu-frontend": {"max_abs": 0.9, "rel_rms": 0.13, "logmel": 0.09},
                   "cuda": {"max_abs": 0.5, "rel_rms": 0.1, "logmel": 0.08}}


EMBEDDING_ROUNDING = 1e-6  # speaker embedding: 4-7e-7 from the recording on Intel AMX, 0 on AMD (campplus averages)


PROMPT_ROUNDING_K = 0.1  # prompt mel: |dL| = K * eps * A_max / A_band; Intel AMX's worst element needed 0.07


class StageRecorder:
    """Records what a Token2Wav's flow and vocoder receive and return during one synthesis."""

    def __init__(self, t2w):
        self.t2w, self.flow_mels, self.flow_calls, self.vocoder_calls = t2w, [], [], []

    def __enter__(self):
        flow, hift = self.t2w.flow, self.t2w.hift
        real_flow, real_step, real_inf = flow.inference, hift.stream_step, hift.inference

        def flow_inference(tokens, *args, **kw):
            mel = real_flow(tokens, *args, **kw)
            self.flow_calls.append({"n_tokens": int(tokens.shape[1]), "streaming": bool(kw.get("streaming", False)),
                                    "finalize": bool(kw.get("finalize", True))})
            self.flow_mels.append(mel.detach().cpu())
            return mel

        def stream_step(state, mel, finalize):
            out = real_step(state, mel, finalize)
            self.vocoder_calls.append(("stream_step", id(state), mel.detach().cpu(), finalize, out.detach().cpu()))
            return out

        def inference(mel, finalize=True):
            out = real_inf(mel, finalize)
            self.vocoder_calls.append(("inference", None, mel.detach().cpu(), finalize, out.detach().cpu()))
            return out

        flow.inference, hift.stream_step, hift.inference = flow_inference, stream_step, inference
        return self

    def __exit__(self, *exc):
        del self.t2w.flow.__dict__["inference"]
        for m in ("stream_step", "inference"):
            del self.t2w.hift.__dict__[m]


def check_stages(rec: StageRecorder, ref_hift, case: str, tokens: list[int], chunk_lengths: list[int] | None,
                 report: dict | None = None, frontend: bool = False, device: str = "cpu") -> None:
    """Assert that a recorded run of fixture ``e2e_<case>`` matches the reference stage by stage
    (module docstring). ``ref_hift`` is a CPU :class:`HiFT`; its reference path is used.
    ``chunk_lengths``: the streamed chunk sizes (None for a run that was not chunked); each streamed
    chunk is also held to the recording's chunk at the whole-waveform bounds (``frontend``: see
    :func:`check_whole_waveform`)."""
    a, meta = load_fixture(f"e2e_{case}")
    m = meta["meta"]
    assert tokens == a["flow_tokens"][0].tolist(), "speech tokens differ from the recording"
    if chunk_lengths is not None:
        assert chunk_lengths == m["chunk_lengths"], "chunk sizes differ from the recording"
    assert len(rec.flow_mels) == len(m["flow_calls"]), "number of flow calls differs from the recording"
    # The schedule, call by call: tokens in, streaming or not, mel frames out.
    got = [(c["n_tokens"], c["streaming"], c["finalize"], int(mel.shape[2]))
           for c, mel in zip(rec.flow_calls, rec.flow_mels)]
    want = [(c["n_tokens"], c["streaming"], c["finalize"], c["n_mel_out"]) for c in m["flow_calls"]]
    assert got == want, f"flow calls differ from the recording: {got} != {want}"
    for k, mel in enumerate(rec.flow_mels):
        d = maxdiff(mel, a[f"flow_call{k}_mel"])
        if report is not None:
            report["e2e_flow_mel"] = max(d, report.get("e2e_flow_mel", 0.0))
        assert d <= ATOL, f"flow call {k}: mel differs from the recording by {d:.2e} > {ATOL}"
    assert rec.vocoder_calls, "the vocoder was not called"
    mels: dict = {}
    emitted: dict = {}
    saved = ref_hift.fast
    ref_hift.fast = False
    try:
        for kind, sid, mel, finalize, out in rec.vocoder_calls:
            if kind == "stream_step":  # the samples inference(all mel so far) adds beyond those returned
                so_far = mel if sid not in mels else torch.cat([mels[sid], mel], dim=2)
                mels[sid] = so_far
                start = emitted.get(sid, 0)
                want = ref_hift.inference(so_far, finalize)[:, start:start + out.shape[1]] \
                    if so_far.shape[2] else out[:, :0]
                emitted[sid] = start + out.shape[1]
            else:
                want = ref_hift.inference(mel, finalize)
            d = maxdiff(out, want)
            if report is not None:
                report["e2e_vocoder_vs_reference"] = max(d, report.get("e2e_vocoder_vs_reference", 0.0))
            assert d <= ATOL, f"{kind}: waveform differs from the reference vocoder by {d:.2e} > {ATOL}"
    finally:
        ref_hift.fast = saved
    # Last, so that a wrong stage is named by the checks above.
    if chunk_lengths is not None and m["call"]["stream"]:
        _check_chunks_against_recording(rec, a["speech"][0], m["chunk_lengths"], _bounds(device, frontend))


def _bounds(device: str, frontend: bool) -> dict:
    return WAVE_TOLERANCES["cuda" if str(device).startswith("cuda") else "cpu-frontend" if frontend else "cpu"]


def _check_chunks_against_recording(rec: StageRecorder, speech: np.ndarray, lengths: list[int], bounds: dict) -> None:
    """Each streamed vocoder call's samples against the reference's samples of that call (the recording's
    chunks), not only against our reference vocoder run on the same mel: a schedule that re-vocodes
    consistently but chunks otherwise than the reference fails here."""
    outs = [out[0].numpy() for kind, _, _, _, out in rec.vocoder_calls if kind == "stream_step"]
    outs = [o for o in outs if o.size]  # a call that emits nothing yields no chunk
    assert [o.size for o in outs] == lengths, "streamed vocoder calls differ in length from the recording's chunks"
    start = 0
    for k, (o, n) in enumerate(zip(outs, lengths)):
        err = waveform_errors(o, speech[start:start + n])
        start += n
        for name in ("rel_rms", "logmel"):  # phase-blind enough for a piece; max_abs is the whole check's
            assert err[name] <= bounds[name], f"streamed chunk {k}: {name} {err[name]:.3g} > {bounds[name]} ({err})"


def logmel(wav: np.ndarray) -> np.ndarray:
    """Natural-log 80-bin mel spectrum (n_fft 1024, hop 256, 24 kHz) for phase-blind comparison."""
    x = torch.as_tensor(np.asarray(wav, dtype=np.float32))
    spec = torch.stft(x, 1024, 256, window=torch.hann_window(1024), return_complex=True).abs()
    freqs = torch.linspace(0, 12000, spec.shape[0])
    mel_pts = torch.linspace(0, 2595 * np.log10(1 + 12000 / 700), 82)
    hz = 700 * (10 ** (mel_pts / 2595) - 1)
    lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    fb = torch.clamp(torch.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), min=0)
    return torch.log(torch.clamp(fb @ spec, min=1e-5)).numpy()


def waveform_errors(speech: np.ndarray, want: np.ndarray) -> dict:
    """The whole-waveform error measures of WAVE_TOLERANCES."""
    assert speech.shape == want.shape, f"waveform shape {speech.shape} != {want.shape}"
    diff = speech.astype(np.float64) - want
    return {"max_abs": float(np.abs(diff).max()),
            "rel_rms": float(np.sqrt(np.mean(diff ** 2)) / np.sqrt(np.mean(want.astype(np.float64) ** 2))),
            "logmel": float(np.abs(logmel(speech) - logmel(want)).mean())}


def check_whole_waveform(speech: np.ndarray, case: str, device: str = "cpu", frontend: bool = False) -> dict:
    """Assert the whole waveform is the recording's within the bounds for ``device``'s kind
    (WAVE_TOLERANCES); ``frontend``: the run computed its inputs from the prompt audio rather than
    taking the recorded ones. Returns the errors."""
    want = load_fixture(f"e2e_{case}")[0]["speech"][0]
    err = waveform_errors(speech, want)
    for k, tol in _bounds(device, frontend).items():
        assert err[k] <= tol, f"whole waveform: {k} {err[k]:.3g} > {tol} ({err})"
    return err


# ----------------------------------------------------------------------------------------------
# Measurement behind WAVE_TOLERANCES: `python tests/stage_checks.py [--perturb 1e-6] [--seeds 3]`,
# run once per kernel set (e.g. with ATEN_CPU_CAPABILITY=avx2 / default, and on an AVX-512 CPU).


def run_case(t2w, case: str, tokens: list[int] | None = None,
             prompt_noise: torch.Generator | None = None,
             prompt_k: float = PROMPT_ROUNDING_K) -> tuple[np.ndarray, list | None]:
    """Flow + vocoder of recorded case ``e2e_<case>`` from its recorded model inputs and tokens.
    ``prompt_noise``: perturb the prompt mel and the speaker embedding at the rounding level of another
    CPU's frontend (:func:`frontend_rounding`), drawing from this generator."""
    from cosyllama.engine import FlowPrompt

    a, meta = load_fixture(f"e2e_{case}")
    call = meta["meta"]["call"]
    feat, emb = torch.from_numpy(a["in_prompt_speech_feat"]), torch.from_numpy(a["in_flow_embedding"])
    if prompt_noise is not None:
        feat_sd, emb_sd = frontend_rounding(a["in_prompt_speech_feat"], prompt_k)
        feat = feat + torch.from_numpy(feat_sd).float() * torch.randn(feat.shape, generator=prompt_noise)
        emb = emb + emb_sd * torch.randn(emb.shape, generator=prompt_noise)
    fp = FlowPrompt(torch.from_numpy(a["in_flow_prompt_speech_token"]), feat, emb)
    toks = a["flow_tokens"][0].tolist() if tokens is None else tokens
    if call["stream"]:
        chunks = list(t2w.stream(iter(toks), fp, 0))
        return np.concatenate([c.samples for c in chunks]), [c.samples.size for c in chunks]
    return t2w.full(toks, fp, speed=call["speed"]), None


def frontend_rounding(prompt_mel: np.ndarray, k: float = PROMPT_ROUNDING_K) -> tuple[np.ndarray, float]:
    """Standard deviations of what another CPU's float32 frontend changes in a recorded prompt mel
    ``(1, T, 80)`` and in the speaker embedding, on the shape of the log-spectrum error model in
    ``helpers`` (``eps * A_max / A_band``) at ``k`` times its unit: every element drawn at about the size
    of the worst one Intel AMX showed, where most of its elements were equal to the recording."""
    from cosyllama.audio import slaney_mel_filterbank
    from helpers import FEATURE_ATOL, log_spectrum_tolerance

    banks = slaney_mel_filterbank(24_000, 1920, 80, 0.0, None)
    unit = (log_spectrum_tolerance(prompt_mel, banks, 1920, power=False) - FEATURE_ATOL) / (2 * np.sqrt(np.log2(1920)))
    return k * unit, EMBEDDING_ROUNDING


def _measure(perturb: float, seeds: int, prompt_k: float = 0.0) -> dict:
    from cosyllama.cpu import CpuPath
    from cosyllama.engine import Token2Wav
    from cosyllama.flow import Flow
    from cosyllama.vocoder import HiFT
    from helpers import FIXTURES, MODEL_DIR

    flow = Flow.from_dir(MODEL_DIR)
    t2w = Token2Wav(flow, HiFT.from_dir(MODEL_DIR), 24000)
    real = flow.inference
    out = {"machine": CpuPath(threads=torch.get_num_threads(), llm="torch").as_dict(), "cases": {}}
    for case in sorted(p.stem[4:] for p in FIXTURES.glob("e2e_*.npz")):
        want = load_fixture(f"e2e_{case}")[0]["speech"][0]
        rows = [waveform_errors(run_case(t2w, case)[0], want)]
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)

            def noisy(*args, **kw):
                mel = real(*args, **kw)
                return mel + perturb * torch.randn(mel.shape, generator=g)

            flow.inference = noisy
            try:
                audio = run_case(t2w, case, prompt_noise=g if prompt_k else None, prompt_k=prompt_k)[0]
                rows.append(waveform_errors(audio, want))
            finally:
                del flow.__dict__["inference"]
        out["cases"][case] = {k: max(r[k] for r in rows) for k in rows[0]}
        print(case, out["cases"][case], flush=True)
    out["worst"] = {k: max(c[k] for c in out["cases"].values()) for k in WAVE_TOLERANCES["cpu"]}
    return out


if __name__ == "__main__":
    import argparse
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    ap = argparse.ArgumentParser()
    ap.add_argument("--perturb", type=float, default=1e-6)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompt-k", type=float, default=0.0,
                    help="also perturb the prompt mel and embedding at this multiple of the frontend's rounding "
                    f"unit (frontend_rounding; {PROMPT_ROUNDING_K} for the bound)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    res = _measure(args.perturb, args.seeds, args.prompt_k)
    print("worst:", res["worst"])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
