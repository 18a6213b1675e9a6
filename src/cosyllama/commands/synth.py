"""``cosyllama synth``: one text to a WAV file, with per-stage timings and the RTF (see :mod:`cosyllama.synth`)."""

from __future__ import annotations

from ..defaults import LLM_CHOICES, SPEED_RANGE
from ..progress import to_stderr
from .flags import add_gpu_options, add_llm_weights_option, add_precision_option, add_threads_option


def add_parser(sub) -> None:
    """The ``synth`` command's arguments (``sub``: the CLI's sub-parsers)."""
    s = sub.add_parser("synth", help="synthesize speech to a WAV file")
    s.add_argument("--model-dir", required=True, help="official CosyVoice3 model directory")
    s.add_argument("--text", required=True, help="text to speak")
    s.add_argument("--out", required=True, help="output .wav (24 kHz mono)")
    s.add_argument("--out-format", choices=["pcm16", "float"], default="pcm16",
                   help="16-bit PCM (default) or 32-bit float WAV")
    s.add_argument("--prompt-wav", help="prompt audio (wav/flac/ogg/mp3), up to 30 s")
    s.add_argument("--prompt-text", help="transcript of the prompt audio")
    s.add_argument("--instruct", help="instruction for instruct mode (e.g. 'Speak slowly.')")
    s.add_argument("--mode", choices=["zero-shot", "cross-lingual", "instruct"], default=None,
                   help="default: instruct if --instruct, zero-shot if --prompt-text, else cross-lingual")
    s.add_argument("--llm", choices=LLM_CHOICES, default=None,
                   help="LLM backend (default: llamacpp when --gguf is given, else torch)")
    s.add_argument("--gguf", help="GGUF file for --llm llamacpp")
    s.add_argument("--stream", action="store_true", help="synthesize in streaming chunks")
    s.add_argument("--greedy", action="store_true", help="argmax decoding (deterministic)")
    s.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    s.add_argument("--speed", type=float, default=1.0,
                   help=f"speaking-rate factor, {SPEED_RANGE[0]}-{SPEED_RANGE[1]} (non-streaming)")
    s.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    add_gpu_options(s)
    add_threads_option(s)
    add_precision_option(s, "flow compute: auto = bf16 where the CPU/GPU has it natively, int8 on other x86 CPUs, "
                            "each kept only if a fidelity check on the loaded weights passes, else fp32 (the "
                            "reference)")
    add_llm_weights_option(s)
    s.add_argument("--tokens-out", help="write the speech tokens per text segment as JSON")
    s.set_defaults(func=run)


def run(args) -> int:
    from ..synth import run_synth

    return run_synth(args, progress=to_stderr)
