"""Defaults shared by the Python API, the CLI and the server, each defined once.

Light on purpose (no torch): ``cosyllama --help`` prints them without loading anything.
"""

LLM_CHOICES = ("torch", "llamacpp")
LLM_WEIGHTS = "llm.pt"  # LLM checkpoint in the model directory; the official one also ships llm.rl.pt
PRECISION = "auto"  # flow compute precision (see cosyllama.precision)
N_SEQ_MAX = 4  # llama.cpp sequences one context holds, for the Python API
SERVE_PARALLEL = 8  # the server's: more requests share each decode step
MAX_QUEUE = 16  # server requests that may wait for a running slot
MAX_INPUT_CHARS = 4096  # characters of text per server request
LLM_PRECISIONS = ("fp32", "bf16", "fp16")  # the torch LLM's weights and KV cache (fp32: the parity mode)
LLM_PRECISION = "fp32"
