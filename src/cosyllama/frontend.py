"""The frontend: text and prompt audio -> the inputs of the LLM and the flow, per mode (see
docs/reference.md#model-inputs).

One :class:`Frontend` per model directory (tokenizer, wetext normalizers, ONNX sessions, all
created once; no per-request state, safe to share between threads). A prompt clip is turned into
a reusable :class:`PromptFeatures` ("voice") once; each mode then yields one :class:`ModelInput`
per text segment.

Prompt-text conventions (see :mod:`cosyllama.text`): a zero-shot transcript without
``<|endofprompt|>`` gets the default prefix ``"You are a helpful assistant.<|endofprompt|>"``;
cross-lingual text without the marker is normalized, split and each segment prefixed; an
instruction without the marker becomes ``"You are a helpful assistant. <instruction><|endofprompt|>"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from .audio import (
    MAX_PROMPT_SECONDS,
    TOKENIZER_SAMPLE_RATE,
    AudioSource,
    check_prompt_audio,
    describe,
    load_prompt_audio,
    mel_spectrogram,
    read_audio,
    resample,
)
from .config import PROMPT_MEL_PER_TOKEN, ModelConfig
from .errors import InputError
from .prompt import PromptEncoder
from .request import FRONTEND_MODES, VC_MODE
from .text.lexicon import Lexicon, take_inline
from .text.normalize import (
    DEFAULT_PROMPT_PREFIX,
    TextNormalizer,
    contains_chinese,
    has_markup,
    instruct_prompt_text,
    text_problem,
    zero_shot_prompt_text,
)
from .text.tokenizer import ENDOFPROMPT, TextTokenizer

MODES = (*FRONTEND_MODES.values(), VC_MODE)  # ModelInput.mode: request.MODES by request.FRONTEND_MODES, and "vc"


@dataclass(frozen=True)
class PromptFeatures:
    """A voice: what one prompt clip (and its transcript) gives, computed once and reusable.

    ``speech_tokens`` and ``prompt_feat`` are aligned (see docs/reference.md#prompt-alignment): with P = min(F
    // 2, n_tokens) they hold the first P tokens and the first 2P mel frames. Treat the tensors as read-only.
    """

    speech_tokens: torch.Tensor  # int32 (P,): 25 Hz speech token ids in [0, 6561)
    speaker_embedding: torch.Tensor  # float32 (192,): CAM++ embedding, not normalized
    prompt_feat: torch.Tensor  # float32 (2P, 80): natural-log mel at 24 kHz, 50 frames/s
    prompt_text: str | None  # LLM prompt text incl. <|endofprompt|>; None when no transcript was given
    prompt_text_ids: tuple[int, ...]  # token ids of prompt_text; () when None
    token_rate: int = 25  # speech tokens per second: the config's token_frame_rate (25 for CosyVoice3)
    instruction: str | None = None  # the voice's style instruction: instruct mode when a request gives none
    # words this voice speaks as pronunciation tokens (a voice folder's lexicon.txt): added to the pipeline's
    # TTS.lexicon, a call's options.lexicon adding to both; not kept in voice files
    lexicon: Lexicon | None = None

    @property
    def duration(self) -> float:
        """Seconds of prompt audio kept after alignment."""
        return len(self.speech_tokens) / self.token_rate


@dataclass(frozen=True)
class ModelInput:
    """Everything the LLM and the flow need for one text segment (the reference's ``model_input``).

    The LLM prefill is ``[sos] + (prompt_text_ids + text_ids) + [task] + llm_prompt_speech_tokens``;
    the flow takes ``flow_prompt_speech_tokens``, ``prompt_feat`` and ``speaker_embedding``.
    Treat the tensors as read-only (segments of one request share them).
    """

    mode: str  # one of MODES
    text: str  # the segment as tokenized ('' for vc)
    text_ids: tuple[int, ...]  # (Lt,) target text ids
    prompt_text_ids: tuple[int, ...]  # (Lp,) transcript (zero_shot) or instruction (instruct2); () otherwise
    llm_prompt_speech_tokens: torch.Tensor  # int32 (P,) in zero_shot; (0,) otherwise
    flow_prompt_speech_tokens: torch.Tensor  # int32 (P,); vc: the prompt's tokens, unaligned
    # float32 (2P, 80); vc: (F, 80), unaligned (see docs/reference.md#q10-unaligned-vc-prompt)
    prompt_feat: torch.Tensor
    speaker_embedding: torch.Tensor  # float32 (192,)
    source_speech_tokens: torch.Tensor | None = None  # int32 (S,): vc only, the speech to convert
    # what captions show of the segment: its inline forms as their words, no lexicon entry applied (None: text)
    shown: str | None = None

    @property
    def llm_text_ids(self) -> tuple[int, ...]:
        """Text ids of the LLM prefill: prompt/instruct text followed by the target text."""
        return self.prompt_text_ids + self.text_ids

    def to_reference_dict(self) -> dict[str, torch.Tensor]:
        """The upstream ``model_input`` dict for this mode: int32 ``(1, L)`` ids, int32 ``(1,)``
        lengths, float32 ``(1, F, 80)`` feat and ``(1, 192)`` embeddings."""
        def ids(x) -> torch.Tensor:
            t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int32)
            return t.to(torch.int32).reshape(1, -1)

        def length(x) -> torch.Tensor:
            return torch.tensor([len(x)], dtype=torch.int32)

        d: dict[str, torch.Tensor] = {}
        if self.mode != "vc":
            d.update(text=ids(self.text_ids), text_len=length(self.text_ids))
        if self.mode in ("zero_shot", "instruct2"):
            d.update(prompt_text=ids(self.prompt_text_ids), prompt_text_len=length(self.prompt_text_ids))
        if self.mode == "zero_shot":
            d.update(llm_prompt_speech_token=ids(self.llm_prompt_speech_tokens),
                     llm_prompt_speech_token_len=length(self.llm_prompt_speech_tokens))
        if self.mode == "vc":
            d.update(source_speech_token=ids(self.source_speech_tokens),
                     source_speech_token_len=length(self.source_speech_tokens))
        d.update(flow_prompt_speech_token=ids(self.flow_prompt_speech_tokens),
                 flow_prompt_speech_token_len=length(self.flow_prompt_speech_tokens),
                 prompt_speech_feat=self.prompt_feat.unsqueeze(0),
                 prompt_speech_feat_len=length(self.prompt_feat))
        if self.mode != "vc":
            d["llm_embedding"] = self.speaker_embedding.reshape(1, -1)
        d["flow_embedding"] = self.speaker_embedding.reshape(1, -1)
        return d


Voice = Union[PromptFeatures, AudioSource]


def _check_finite(what: str, audio, computed: dict[str, torch.Tensor]) -> None:
    """Refuse a clip whose features are not finite numbers: finite but huge samples (1e20 squared
    overflows float32) would make a voice that speaks silence."""
    bad = [name for name, t in computed.items() if not bool(torch.isfinite(t).all())]
    if bad:
        peak = float(audio.wav16.abs().max())
        raise InputError(f"{what} gives {' and '.join(bad)} that are not finite numbers: its samples are far "
                         f"outside [-1, 1] (peak {peak:.3g}); give audio scaled to [-1, 1] (e.g. 16-bit PCM)")


def check_text(field: str, text: str) -> None:
    """Refuse text holding a control character or a lone surrogate (:func:`text_problem`)."""
    problem = text_problem(text) if isinstance(text, str) else None
    if problem is not None:
        raise InputError(f"{field} {problem}")


_EMPTY_TOKENS = torch.zeros(0, dtype=torch.int32)


def continued_lead(lead: str, text: str) -> str:
    """What of ``lead``, the whitespace before ``text`` in a longer text, the reference's normalization of that
    longer text keeps before ``text``'s first segment: a segment after the first keeps its leading spaces
    (docs/reference.md#segment-splitting); the English path drops a line break (wetext) and joins paragraphs
    (a line break and more whitespace, read line by line: :meth:`TextNormalizer._wetext
    <cosyllama.text.normalize.TextNormalizer._wetext>`) with one space; other whitespace (tabs, no-break spaces)
    and every space before Chinese text (dropped between CJK characters) give none, as does a text with
    ``<|…|>`` markup (never split). So a text streamed sentence by sentence is spoken as the same text sent
    whole when the whole splits at the same places, with spaces and line breaks between its sentences."""
    if not lead or has_markup(text) or contains_chinese(text):
        return ""
    lead = lead.replace("\r\n", "\n").replace("\r", "\n")
    if re.search(r"\n\s", lead):
        return " "
    kept = lead.replace("\n", "")
    return kept if kept.strip(" ") == "" else ""


class Frontend:
    """Text normalization/tokenization and prompt feature extraction of one model directory.

    ``providers``: onnxruntime execution providers for the two prompt models (CPU by default).
    ``onnx_threads``: intra-op threads per ONNX session (None: onnxruntime's default).
    """

    def __init__(self, config: ModelConfig, providers: Sequence[str] = ("CPUExecutionProvider",),
                 onnx_threads: int | None = None):
        self.config = config
        self.tokenizer = TextTokenizer(self.config.qwen_dir)
        self.normalizer = TextNormalizer(self.tokenizer)
        self.encoder = PromptEncoder(self.config.model_dir, providers=providers, threads=onnx_threads)

    # -- text ------------------------------------------------------------------------------------

    def tokenize(self, text: str) -> tuple[int, ...]:
        """Qwen2 + CosyVoice3 token ids of ``text`` (special tokens recognised, no BOS/EOS)."""
        return tuple(self.tokenizer.encode(text))

    def normalize_and_split(self, text: str, text_frontend: bool = True, russian_numbers: bool = True,
                            normalizer: TextNormalizer | None = None, lexicon: Lexicon | None = None) -> list[str]:
        """Target text -> segments (see docs/reference.md#segment-splitting); each segment is synthesized by its own
        LLM call.

        ``text_frontend=False`` skips normalization and splitting (as does ``<|…|>`` markup).
        ``russian_numbers``: Russian sentences get Russian number words (default) instead of English.
        Raises :class:`InputError` when nothing speakable is left. The text's own rules (a string, not
        empty, no control characters) are :class:`~cosyllama.request.SynthesisRequest`'s, checked before.
        ``normalizer``: the pipeline's (e.g. one with a helper process); None: this frontend's.
        ``lexicon``: words to speak as its pronunciation tokens (docs/pronunciation.md). Inline forms
        ``{word|[tokens]}`` are taken out before normalization and put back as tokens after it; the
        lexicon is applied to each segment after normalization and splitting, so that no token is
        spelled out and the segments are those of the same text without entries.
        """
        return [spoken for spoken, _ in self._segments(text, text_frontend, russian_numbers, normalizer, lexicon)]

    def _segments(self, text: str, text_frontend: bool, russian_numbers: bool, normalizer: TextNormalizer | None,
                  lexicon: Lexicon | None, lead: str = "") -> list[tuple[str, str]]:
        """:meth:`normalize_and_split`'s segments, each with what captions show of it: its inline forms as their
        words, no lexicon entry applied. ``lead``: the whitespace that stood before ``text`` in a longer text it
        continues (a streamed sentence after the first, :func:`continued_lead`), put back before its first
        segment as that text's own segmentation keeps it (docs/reference.md#segment-splitting)."""
        normalizer = self.normalizer if normalizer is None else normalizer
        inline = take_inline(text, self.tokenizer)
        segments = normalizer.normalize(inline.text, split=True, text_frontend=text_frontend,
                                        russian_numbers=russian_numbers)
        segments = [s for s in segments if s.strip()]
        if not segments:
            raise InputError(f"text {text[:60]!r} has nothing to speak (only punctuation or symbols)")
        lead = continued_lead(lead, inline.text) if text_frontend else ""
        if lead:
            segments[0] = lead + segments[0]
        shown = [inline.shown(s) for s in segments]
        if lexicon is not None and len(lexicon):
            segments = [lexicon.apply(s) for s in segments]
        if inline.tokens:
            segments = [inline.restore(s) for s in segments]
        return list(zip(segments, shown))

    # -- prompt audio ----------------------------------------------------------------------------

    def make_voice(self, prompt_wav: AudioSource, prompt_text: str | None = None) -> PromptFeatures:
        """Compute a reusable voice from a prompt clip (16 kHz or more, 0.1-30 s, not silent).

        ``prompt_text``: the clip's transcript (needed for zero-shot); without ``<|endofprompt|>``
        the default system prefix is prepended. Not normalized (reference behaviour).
        """
        if prompt_text is not None:
            check_text("transcript", prompt_text)
        tokens, feat, embedding = self._extract(prompt_wav, "prompt audio")
        # The reference's frontend trims to its fixed 2:1 ratio (config.load_config refuses a yaml that differs).
        n = min(feat.shape[0] // PROMPT_MEL_PER_TOKEN, tokens.shape[0])
        full_text = None if prompt_text is None else zero_shot_prompt_text(prompt_text)
        return PromptFeatures(
            speech_tokens=tokens[:n].contiguous(),
            speaker_embedding=embedding,
            prompt_feat=feat[:n * PROMPT_MEL_PER_TOKEN].contiguous(),
            prompt_text=full_text,
            prompt_text_ids=() if full_text is None else self.tokenize(full_text),
            token_rate=self.config.token_frame_rate,
        )

    def _extract(self, wav: AudioSource, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(speech tokens int32 (n,), mel float32 (F, 80), embedding float32 (192,)), unaligned."""
        audio = load_prompt_audio(wav, self.config.sample_rate, what)
        tokens = self.encoder.speech_tokens(audio.wav16)
        feat = mel_spectrogram(audio.wav24, self.config.feat).squeeze(0).transpose(0, 1).contiguous()
        embedding = self.encoder.speaker_embedding(audio.wav16)
        _check_finite(what, audio, {"mel features": feat, "speaker embedding": embedding})
        return tokens, feat, embedding

    def _voice(self, voice: Voice) -> PromptFeatures:
        return voice if isinstance(voice, PromptFeatures) else self.make_voice(voice)

    # -- modes -----------------------------------------------------------------------------------

    def zero_shot(self, text: str, voice: Voice, prompt_text: str | None = None, *, text_frontend: bool = True,
                  russian_numbers: bool = True, normalizer: TextNormalizer | None = None,
                  lexicon: Lexicon | None = None, lead: str = "") -> list[ModelInput]:
        """Clone ``voice`` saying ``text``: the LLM continues the prompt's transcript and speech.

        ``voice``: a :class:`PromptFeatures` (its ``prompt_text`` is used unless ``prompt_text`` is
        given) or a prompt audio source (then ``prompt_text`` is required: a
        :class:`~cosyllama.request.SynthesisRequest` has checked that there is a transcript). One input
        per segment.
        """
        if not isinstance(voice, PromptFeatures):
            voice = self.make_voice(voice, prompt_text)
        full_prompt = voice.prompt_text if prompt_text is None else zero_shot_prompt_text(prompt_text)
        prompt_ids = voice.prompt_text_ids if full_prompt == voice.prompt_text else self.tokenize(full_prompt)
        return [self._input("zero_shot", seg, voice, prompt_ids, voice.speech_tokens, shown)
                for seg, shown in self._segments(text, text_frontend, russian_numbers, normalizer, lexicon, lead)]

    def cross_lingual(self, text: str, voice: Voice, *, text_frontend: bool = True,
                      russian_numbers: bool = True, normalizer: TextNormalizer | None = None,
                      lexicon: Lexicon | None = None, lead: str = "") -> list[ModelInput]:
        """Speak ``text`` (any language) in the voice, without the prompt's transcript or speech
        tokens in the LLM. Text containing ``<|endofprompt|>`` is one segment, used verbatim."""
        voice = self._voice(voice)
        segments = self._segments(text, text_frontend, russian_numbers, normalizer, lexicon, lead)
        if ENDOFPROMPT not in text:
            segments = [(DEFAULT_PROMPT_PREFIX + s, shown) for s, shown in segments]
        return [self._input("cross_lingual", seg, voice, (), _EMPTY_TOKENS, shown) for seg, shown in segments]

    def instruct2(self, text: str, instruction: str, voice: Voice, *, text_frontend: bool = True,
                  russian_numbers: bool = True, normalizer: TextNormalizer | None = None,
                  lexicon: Lexicon | None = None, lead: str = "") -> list[ModelInput]:
        """Speak ``text`` in the voice following ``instruction`` (dialect, speed, emotion ...).

        The instruction replaces the transcript as LLM prompt text and is never normalized.
        """
        voice = self._voice(voice)
        instruct_ids = self.tokenize(instruct_prompt_text(instruction))
        return [self._input("instruct2", seg, voice, instruct_ids, _EMPTY_TOKENS, shown)
                for seg, shown in self._segments(text, text_frontend, russian_numbers, normalizer, lexicon, lead)]

    def vc(self, source_wav: AudioSource, prompt_wav: AudioSource) -> ModelInput:
        """Voice conversion: the speech tokens of ``source_wav`` rendered in the voice of
        ``prompt_wav`` by the flow alone. Prompt tokens/mel are not aligned (see
        docs/reference.md#q10-unaligned-vc-prompt)."""
        wav, sr = read_audio(source_wav, "source audio", max_seconds=MAX_PROMPT_SECONDS)
        check_prompt_audio(wav, sr, describe("source audio", source_wav))
        source_tokens = self.encoder.speech_tokens(resample(wav, sr, TOKENIZER_SAMPLE_RATE))
        tokens, feat, embedding = self._extract(prompt_wav, "prompt audio")
        return ModelInput(mode="vc", text="", text_ids=(), prompt_text_ids=(), llm_prompt_speech_tokens=_EMPTY_TOKENS,
                          flow_prompt_speech_tokens=tokens, prompt_feat=feat, speaker_embedding=embedding,
                          source_speech_tokens=source_tokens)

    def _input(self, mode: str, segment: str, voice: PromptFeatures, prompt_ids: tuple[int, ...],
               llm_speech: torch.Tensor, shown: str | None = None) -> ModelInput:
        return ModelInput(mode=mode, text=segment, text_ids=self.tokenize(segment), prompt_text_ids=prompt_ids,
                          llm_prompt_speech_tokens=llm_speech, flow_prompt_speech_tokens=voice.speech_tokens,
                          prompt_feat=voice.prompt_feat, speaker_embedding=voice.speaker_embedding, shown=shown)
