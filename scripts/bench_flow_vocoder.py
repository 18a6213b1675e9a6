"""Time the flow (DiT CFM) and the HiFT vocoder at the real Fun-CosyVoice3-0.5B sizes.

Builds both modules with random weights straight from configs (no model files), then times one
non-streaming synthesis of ``--out-s`` seconds after a ``--prompt-s`` seconds prompt. Random weights
give noise audio but the real amount of work. Prints seconds of compute per second of audio, and
the same numbers as JSON in the ``cosyllama bench`` layout (``flow`` / ``vocoder`` lists).

    python scripts/bench_flow_vocoder.py                 # 2 threads, CPU, fp32
    python scripts/bench_flow_vocoder.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cosyllama.config import FlowConfig, HiftConfig
from cosyllama.device import resolve_device
from cosyllama.flow import Flow
from cosyllama.vocoder import HiFT, source_noise_state

TOKEN_RATE = 25  # speech tokens per second
MEL_RATE = 50  # mel frames per second

# Spec §1.2 / §15: the shipped cosyvoice3.yaml sizes.
FULL_FLOW = FlowConfig(
    input_size=80, output_size=80, spk_embed_dim=192, vocab_size=6561, token_mel_ratio=2, pre_lookahead_len=3,
    pre_lookahead_channels=1024, dit_dim=1024, dit_depth=22, dit_heads=16, dit_dim_head=64, dit_ff_mult=2,
    mel_dim=80, mu_dim=80, spk_dim=80, out_channels=80, static_chunk_size=50, inference_cfg_rate=0.7,
    t_scheduler="cosine",
)
FULL_HIFT = HiftConfig(
    in_channels=80, base_channels=512, nb_harmonics=8, sampling_rate=24000, nsf_alpha=0.1, nsf_sigma=0.003,
    nsf_voiced_threshold=10.0, upsample_rates=(8, 5, 3), upsample_kernel_sizes=(16, 11, 7), istft_n_fft=16,
    istft_hop_len=4, resblock_kernel_sizes=(3, 7, 11), resblock_dilation_sizes=((1, 3, 5),) * 3,
    source_resblock_kernel_sizes=(7, 7, 11), source_resblock_dilation_sizes=((1, 3, 5),) * 3, lrelu_slope=0.1,
    audio_limit=0.99, conv_pre_look_right=4, f0_num_class=1, f0_in_channels=80, f0_cond_channels=512,
)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeats: int) -> float:
    """Best wall time of ``repeats`` runs, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--prompt-s", type=float, default=3.0, help="prompt length in seconds (default 3)")
    ap.add_argument("--out-s", type=float, default=10.0, help="generated audio in seconds (default 10)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per stage; the best is kept")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    dev = resolve_device(a.device)
    torch.manual_seed(0)  # only the random weights; the modules' own noise uses private generators
    flow = Flow(FULL_FLOW).to(dev).eval()
    hift = HiFT(FULL_HIFT, source_noise_state(FULL_FLOW, FULL_HIFT)).to(dev).eval()
    n_flow = sum(p.numel() for p in flow.parameters())
    n_hift = sum(p.numel() for p in hift.parameters())

    p_tok, o_tok = round(a.prompt_s * TOKEN_RATE), round(a.out_s * TOKEN_RATE)
    prompt_token = torch.randint(0, FULL_FLOW.vocab_size, (1, p_tok))
    token = torch.randint(0, FULL_FLOW.vocab_size, (1, o_tok))
    prompt_feat = torch.randn(1, 2 * p_tok, 80) - 5.0
    emb = torch.randn(1, 192)
    mel = torch.randn(1, 80, 2 * o_tok, device=dev) - 5.0

    # Warm-up on a short input (allocator, oneDNN/cuDNN kernel selection), then time the real size.
    flow.inference(token[:, :10], prompt_token[:, :10], prompt_feat[:, :20], emb)
    hift.inference(mel[:, :, :20])
    audio_s = o_tok / TOKEN_RATE
    t_flow = timed(lambda: flow.inference(token, prompt_token, prompt_feat, emb), dev, a.repeats)
    t_voc = timed(lambda: hift.inference(mel), dev, a.repeats)

    variant = f"torch-fp32-{dev.type}-{a.threads}t" if dev.type == "cpu" else f"torch-fp32-{dev.type}"
    result = {
        "machine": {"threads": a.threads, "device": str(dev),
                    "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None},
        "flow": [{"variant": variant, "seconds_per_audio_second": t_flow / audio_s, "wall_s": t_flow,
                  "prompt_s": p_tok / TOKEN_RATE, "audio_s": audio_s, "params": n_flow}],
        "vocoder": [{"variant": variant, "seconds_per_audio_second": t_voc / audio_s, "wall_s": t_voc,
                     "audio_s": audio_s, "params": n_hift}],
    }
    print(f"flow    ({n_flow / 1e6:.1f} M params, {p_tok / TOKEN_RATE:.1f} s prompt + {audio_s:.1f} s, "
          f"10 Euler steps x CFG batch 2): {t_flow:7.2f} s wall = {t_flow / audio_s:.3f} s per audio second")
    print(f"vocoder ({n_hift / 1e6:.1f} M params, {audio_s:.1f} s):"
          f"{' ' * 39}{t_voc:7.2f} s wall = {t_voc / audio_s:.3f} s per audio second")
    print(json.dumps(result))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
