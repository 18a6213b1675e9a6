"""The one place that turns "which LLM" into a backend and a token source; the Python API, the
CLI and the server all come through here.

A *token source* (:class:`~cosyllama.llm.decode.TokenSource`: ``generate(prefill, n_text_tokens, options,
cancel)``, ``pause_for_flow(first)``, ``close()``): :class:`~cosyllama.llm.decode.DirectTokens` decodes each
request on its own (the API's default), :class:`~cosyllama.llm.scheduler.BatchScheduler` advances concurrent
requests in one backend step (the servers' and batch's).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ModelConfig
from ..defaults import LLM_CHOICES, LLM_PRECISION, LLM_PRECISIONS, LLM_WEIGHTS, N_SEQ_MAX
from ..errors import DeviceError, InputError
from .backend import LLMBackend, check_max_seq_tokens

if TYPE_CHECKING:
    from .decode import TokenSource


def choose_llm(llm: str | None, gguf: str | Path | None) -> str:
    """The backend name: ``llm`` when given, else llama.cpp when a GGUF file is given and torch
    otherwise. The choice itself is checked by :class:`~cosyllama.options.LoadOptions` (asserted
    here); what only building a backend needs is refused here: llama.cpp without a GGUF (a TTS given
    its backend has none)."""
    if llm is None:
        return "llamacpp" if gguf else "torch"
    assert llm in LLM_CHOICES and not (llm == "torch" and gguf is not None), "checked by LoadOptions"
    if llm == "llamacpp" and gguf is None:
        raise InputError("llm='llamacpp' needs a GGUF file (gguf=...); make one with "
                         "`cosyllama convert --model-dir DIR --out FILE.gguf`")
    return llm


ALL_LAYERS = 999  # llama.cpp offloads min(n_gpu_layers, layers): more than any model has means all


def make_llm(config: ModelConfig, llm: str = "torch", *, gguf: str | Path | None = None,
             llm_weights: str | Path = LLM_WEIGHTS, device="cpu", threads: int | None = None,
             n_gpu_layers: int | None = None, n_seq_max: int = N_SEQ_MAX,
             llm_precision: str = LLM_PRECISION, max_seq_tokens: int | None = None) -> LLMBackend:
    """The LLM backend for ``config``'s model.

    torch: on the CPU in float32, the dynamic-cache :class:`~cosyllama.llm.torch_backend.TorchLLM`;
    on CUDA (or at ``llm_precision`` bf16/fp16) the static-cache backend whose decode steps are
    CUDA graphs (:class:`~cosyllama.llm.static_decode.StaticTorchLLM`, ``n_seq_max`` slots).
    llamacpp: from ``gguf`` with ``threads``, ``n_seq_max`` concurrent sequences and
    ``n_gpu_layers`` layers on the GPU (None: all of them when ``device`` is CUDA, else none).
    ``llm_weights`` chooses the checkpoint: the torch backend's weights, and for llama.cpp the
    file the GGUF must have been converted from (and whose text rows the speech layout reads).
    ``max_seq_tokens``: positions one sequence may use (prompt + new tokens); given, the llama.cpp
    context and the static cache are made now for ``n_seq_max`` such sequences and never grow;
    None: the model's context length (the static cache: its default), a llama.cpp context sized
    lazily. The options are those of a :class:`~cosyllama.options.LoadOptions`, checked there (asserted here)."""
    import torch

    llm = choose_llm(llm, gguf)
    assert llm_precision in LLM_PRECISIONS, "checked by LoadOptions"
    assert llm == "torch" or llm_precision == LLM_PRECISION, "checked by LoadOptions"
    weights_path = config.llm_weights_path(llm_weights)  # refused here, before any backend is built
    on_cuda = torch.device(device).type == "cuda"
    if llm == "torch":
        from ..weights import load_llm_weights

        weights = load_llm_weights(weights_path, config.llm)
        if on_cuda or llm_precision != "fp32":
            from .static_decode import StaticTorchLLM

            ctx = {} if max_seq_tokens is None else {"ctx": check_max_seq_tokens(max_seq_tokens, config.llm) + 1}
            return StaticTorchLLM(config.llm, weights, device, slots=n_seq_max, precision=llm_precision, **ctx)
        from .torch_backend import TorchLLM

        return TorchLLM(config.llm, weights, device, max_seq_tokens=max_seq_tokens)
    from .llamacpp_backend import LlamaCppLLM, import_llama_cpp

    if n_gpu_layers is None:
        n_gpu_layers = 0
        if on_cuda:
            if not import_llama_cpp().llama_supports_gpu_offload():
                raise DeviceError("device cuda puts llama.cpp's layers on the GPU, but this llama-cpp-python "
                                  "build has no GPU support: install a CUDA build (docs/gpu.md) or "
                                  "pass n_gpu_layers=0 (--n-gpu-layers 0) to run the LLM on the CPU")
            n_gpu_layers = ALL_LAYERS
    return LlamaCppLLM(gguf, config, n_threads=threads, n_gpu_layers=n_gpu_layers, n_seq_max=n_seq_max,
                       llm_weights=llm_weights, max_seq_tokens=max_seq_tokens,
                       n_ctx=None if max_seq_tokens is None else n_seq_max * max_seq_tokens)


def make_token_source(backend: LLMBackend, *, batched: bool = False, max_active: int | None = None,
                      max_waiting: int | None = None, prefill_chunk: int | None = None,
                      interleave: str = "off") -> TokenSource:
    """``batched=False``: each request decodes alone (:class:`DirectTokens`). ``batched=True``: a
    :class:`~cosyllama.llm.scheduler.BatchScheduler` over ``backend`` decoding ``max_active`` sequences
    together, letting ``max_waiting`` requests wait for a sequence and prefilling ``prefill_chunk``
    prompt positions between two decode steps (its defaults if None), pausing its decode steps during
    flow calls as ``interleave`` says (:data:`~cosyllama.llm.scheduler.INTERLEAVE_MODES`); the caller
    closes it."""
    if not batched:
        from .decode import DirectTokens

        return DirectTokens(backend)
    from .scheduler import BatchScheduler

    kw = {k: v for k, v in (("max_active", max_active), ("max_waiting", max_waiting),
                            ("prefill_chunk", prefill_chunk)) if v is not None}
    return BatchScheduler(backend, interleave=interleave, **kw)
