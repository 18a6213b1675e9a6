"""Defaults shared by the Python API, the CLI and the server, each defined once.

Light on purpose (no torch): ``cosyllama --help`` prints them without loading anything.
"""

# Each vocabulary of a load option is defined here once: the flags take their choices from it and
# cosyllama.options.LoadOptions checks against it.
LLM_CHOICES = ("torch", "llamacpp")
LLM_WEIGHTS = "llm.pt"  # LLM checkpoint in the model directory; the official one also ships llm.rl.pt
PRECISIONS = ("fp32", "bf16", "int8", "auto")  # flow compute precisions (see cosyllama.precision)
PRECISION_ALIASES = {"float32": "fp32", "bfloat16": "bf16"}  # other spellings the Python API takes
PRECISION = "auto"
DEVICES = ("cpu", "cuda")  # where the flow, vocoder and torch LLM run; "cuda:N" names one GPU
# auto trusts a timing of the flow candidates only if the process got this share of the CPU its threads asked for
# (why this value: cosyllama.flow.auto.CPU_SHARE_MIN)
AUTO_CPU_SHARE_MIN = 0.8
SPEED_RANGE = (0.25, 4.0)  # time-stretch factors allowed (OpenAI's speech API allows the same)
# bad takes (a loop, a runaway) made again per text segment, and the most a request may ask for (docs/retries.md):
# none by default, so every take is the reference's (caught ones are reported); 2 is the advice where asked
RETRIES = 0
MAX_RETRIES = 5
N_SEQ_MAX = 4  # llama.cpp sequences one context holds, for the Python API
SERVE_PARALLEL = 8  # the server's: more requests share each decode step
MAX_QUEUE = 16  # server requests that may wait for a running slot
RETRY_AFTER_S = 1  # seconds a server's 503 (busy, or at --max-connections) asks the client to wait: Retry-After
MAX_VOICES = 1000  # voices a server registers (a voice file is at most ~0.5 MB: 30 s of prompt)
# how the server's scheduler pauses LLM decoding during flow work (cosyllama.llm.scheduler; `--interleave`,
# which also takes auto)
INTERLEAVE_MODES = ("off", "first", "all")
PREFILL_CHUNK = 128  # prompt positions the server's scheduler prefills between two decode steps
WYOMING_URI = "tcp://127.0.0.1:10200"  # where `cosyllama wyoming` listens (10200: Wyoming's usual TTS port)
API_KEY_ENV = "COSYLLAMA_API_KEY"  # the server's API key when --api-key is not given
LOG_LEVELS = ("debug", "info", "warning", "error")  # a server's --log-level: the least severe lines it writes
LOG_LEVEL = "info"
LLM_PRECISIONS = ("fp32", "bf16", "fp16")  # the torch LLM's weights and KV cache (fp32: the parity mode)
LLM_PRECISION = "fp32"

# Per-request bounds of the server (cosyllama.limits.RequestLimits; `serve --max-...`). Tokens are
# text tokens after the frontend's normalization and tokenizer.
MAX_INPUT_CHARS = 4096  # characters of input text per request
MAX_INPUT_TOKENS = 4096  # text tokens of the input, all segments together
MAX_INSTRUCTIONS_CHARS = 1000  # characters of an instruct-mode instruction
MAX_INSTRUCTIONS_TOKENS = 256  # its text tokens, system prefix included
# characters of a voice's transcript (a prompt clip is at most 30 s; 30 s of speech is ~500)
MAX_TRANSCRIPT_CHARS = 1000
MAX_TRANSCRIPT_TOKENS = 512  # its text tokens, system prefix included (odd characters can take several each)
MAX_SEQ_TOKENS = 4096  # LLM positions of one sequence: its prompt plus the speech tokens it may decode
# characters of text one streamed session takes in all (a /v1/audio/speech/stream connection, a Wyoming
# synthesize-start ... -stop); ~2 hours of speech
MAX_SESSION_CHARS = 100_000
# the languages CosyVoice3 was trained on (ISO 639-1), as Wyoming's describe lists them (--language narrows it);
# it also speaks Chinese dialects through instructions
LANGUAGES = ("zh", "en", "ja", "ko", "de", "es", "fr", "it", "ru")

# SynthesisOptions.first_chunk_tokens (docs/streaming.md, "Low-latency first chunk"): the speech tokens of a
# segment's first streamed chunk when asked, below the reference's first hop (engine.TOKEN_HOP = 25). At least 5:
# the vocoder keeps a non-final chunk's last 8 mel frames (4 tokens) as look-ahead (HiFT.inference), so a first
# chunk of 4 tokens or fewer has no audio and the first audio would come later than the reference's schedule's.
FIRST_CHUNK_RANGE = (5, 24)
