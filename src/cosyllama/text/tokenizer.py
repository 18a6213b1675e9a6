"""The text tokenizer: the Qwen2 byte-level BPE of ``CosyVoice-BlankEN/`` with CosyVoice3's special
tokens (see docs/reference.md#text).

``CosyVoice-BlankEN/`` holds a Qwen2 byte-level BPE (``vocab.json`` + ``merges.txt``, added tokens in
``tokenizer_config.json``). We assemble the same tokenizer with the ``tokenizers`` library alone (NFC, the
Qwen2 pre-tokenizer regex, byte-level BPE) and append CosyVoice3's 280 special tokens in the reference
order, so ``<|endofprompt|>`` is 151646 and the text vocabulary has 151924 ids. transformers is not needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MissingDependencyError, ModelDirError

ENDOFPROMPT = "<|endofprompt|>"
ENDOFPROMPT_ID = 151646  # hard-coded by the reference LLM (an assertion there)
TEXT_VOCAB_SIZE = 151924  # ids 0 .. 151923: Qwen2 BPE + Qwen2 specials + CosyVoice3 specials

# The Qwen2 pre-tokenizer: contractions, letter runs (with one leading non-letter), single digits,
# punctuation runs, newlines and whitespace.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CONTROL_TOKENS = (
    "<|im_start|>", "<|im_end|>", ENDOFPROMPT, "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]", "<|endofsystem|>",
)
# the model's own markup in a text (emphasis, breaths, laughter, ...): spoken as sounds or prosody, not words
MARKUP_TOKENS = tuple(t for t in _CONTROL_TOKENS if not t.startswith("<|"))
_ARPABET_TOKENS = tuple("""
[AA] [AA0] [AA1] [AA2] [AE] [AE0] [AE1] [AE2] [AH] [AH0] [AH1] [AH2] [AO] [AO0] [AO1] [AO2] [AW]
[AW0] [AW1] [AW2] [AY] [AY0] [AY1] [AY2] [B] [CH] [D] [DH] [EH] [EH0] [EH1] [EH2] [ER] [ER0] [ER1]
[ER2] [EY] [EY0] [EY1] [EY2] [F] [G] [HH] [IH] [IH0] [IH1] [IH2] [IY] [IY0] [IY1] [IY2] [JH] [K] [L]
[M] [N] [NG] [OW] [OW0] [OW1] [OW2] [OY] [OY0] [OY1] [OY2] [P] [R] [S] [SH] [T] [TH] [UH] [UH0]
[UH1] [UH2] [UW] [UW0] [UW1] [UW2] [V] [W] [Y] [Z] [ZH]
""".split())
# Tone-marked vowels are single precomposed (NFC) code points.
_PINYIN_TOKENS = tuple("""
[a] [ai] [an] [ang] [ao] [b] [c] [ch] [d] [e] [ei] [en] [eng] [f] [g] [h] [i] [ian] [in] [ing] [iu]
[ià] [iàn] [iàng] [iào] [iá] [ián] [iáng] [iáo] [iè] [ié] [iòng] [ióng] [iù] [iú] [iā] [iān] [iāng]
[iāo] [iē] [iě] [iōng] [iū] [iǎ] [iǎn] [iǎng] [iǎo] [iǒng] [iǔ] [j] [k] [l] [m] [n] [o] [ong] [ou]
[p] [q] [r] [s] [sh] [t] [u] [uang] [ue] [un] [uo] [uà] [uài] [uàn] [uàng] [uá] [uái] [uán] [uáng]
[uè] [ué] [uì] [uí] [uò] [uó] [uā] [uāi] [uān] [uāng] [uē] [uě] [uī] [uō] [uǎ] [uǎi] [uǎn] [uǎng]
[uǐ] [uǒ] [vè] [w] [x] [y] [z] [zh] [à] [ài] [àn] [àng] [ào] [á] [ái] [án] [áng] [áo] [è] [èi] [èn]
[èng] [èr] [é] [éi] [én] [éng] [ér] [ì] [ìn] [ìng] [í] [ín] [íng] [ò] [òng] [òu] [ó] [óng] [óu] [ù]
[ùn] [ú] [ún] [ā] [āi] [ān] [āng] [āo] [ē] [ēi] [ēn] [ēng] [ě] [ěi] [ěn] [ěng] [ěr] [ī] [īn] [īng]
[ō] [ōng] [ōu] [ū] [ūn] [ǎ] [ǎi] [ǎn] [ǎng] [ǎo] [ǐ] [ǐn] [ǐng] [ǒ] [ǒng] [ǒu] [ǔ] [ǔn] [ǘ] [ǚ] [ǜ]
""".split())
# eos/pad first, then the reference's `additional_special_tokens`, in this exact order (see
# docs/reference.md#tokenizer).
SPECIAL_TOKENS = ("<|endoftext|>",) + _CONTROL_TOKENS + _ARPABET_TOKENS + _PINYIN_TOKENS
# the pronunciation tokens (what a lexicon entry or an SSML <phoneme> may spell a word with)
ARPABET_TOKENS = _ARPABET_TOKENS
PINYIN_TOKENS = _PINYIN_TOKENS


# ----------------------------------------------------------------------------------------------
# Tokenizer


class TextTokenizer:
    """Qwen2 byte-level BPE + CosyVoice3 special tokens. Thread-safe (``tokenizers`` encodes
    without shared mutable state).

    :meth:`encode` returns plain ids, no BOS/EOS; special tokens written literally in the text
    (``<|endofprompt|>``, ``[breath]``, ``[j][ǐ]``) become single ids.
    """

    def __init__(self, qwen_dir: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # a core dependency; only a broken install gets here
            raise MissingDependencyError("the 'tokenizers' package is needed: pip install tokenizers") from e
        qwen_dir = Path(qwen_dir)
        vocab_path, merges_path = qwen_dir / "vocab.json", qwen_dir / "merges.txt"
        try:
            vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
            merges = [line for line in merges_path.read_text(encoding="utf-8").splitlines()
                      if line and not line.startswith("#version")]
        except (OSError, json.JSONDecodeError) as e:
            raise ModelDirError(f"{qwen_dir}: cannot read the Qwen2 tokenizer files vocab.json/merges.txt: {e}") from e

        added = self._read_added_tokens(qwen_dir / "tokenizer_config.json")
        known = {**vocab, **{t["content"]: t["id"] for t in added}}
        next_id = max(known.values()) + 1
        for token in SPECIAL_TOKENS:  # existing tokens keep their id, new ones get consecutive ids
            if token in known:
                if all(t["content"] != token for t in added):
                    added.append(_added_token(token, known[token]))
                continue
            added.append(_added_token(token, next_id))
            known[token] = next_id
            next_id += 1

        spec = {
            "version": "1.0",
            "added_tokens": sorted(added, key=lambda t: t["id"]),
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                      # The added tokens are listed in the BPE vocabulary as well: `tokenizers`
                      # re-numbers added tokens it cannot find in the model when it loads.
                      "vocab": {**vocab, **{t["content"]: t["id"] for t in added}}, "merges": merges},
        }
        try:
            self._tok = Tokenizer.from_str(json.dumps(spec))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelDirError(f"{qwen_dir}: the Qwen2 tokenizer files do not form a valid BPE: {e}") from e
        self._n_entries = len({**vocab, **{t["content"]: t["id"] for t in added}})

        eop = self._tok.token_to_id(ENDOFPROMPT)
        last = self._tok.token_to_id(SPECIAL_TOKENS[-1])
        if eop != ENDOFPROMPT_ID or last != TEXT_VOCAB_SIZE - 1:
            raise ModelDirError(
                f"{qwen_dir}: this tokenizer gives {ENDOFPROMPT} id {eop} and {SPECIAL_TOKENS[-1]} id {last}; "
                f"CosyVoice3 needs {ENDOFPROMPT_ID} and {TEXT_VOCAB_SIZE - 1} (a Qwen2 vocabulary of 151643 "
                "BPE ids plus <|endoftext|>, <|im_start|>, <|im_end|>)")

    @staticmethod
    def _read_added_tokens(path: Path) -> list[dict]:
        if not path.is_file():
            return []
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelDirError(f"{path}: cannot read tokenizer_config.json: {e}") from e
        out = []
        for tid, t in (cfg.get("added_tokens_decoder") or {}).items():
            tok = _added_token(t["content"], int(tid), special=bool(t.get("special", True)))
            tok.update({k: bool(t.get(k, False)) for k in ("lstrip", "rstrip", "single_word")})
            tok["normalized"] = bool(t.get("normalized", False))
            out.append(tok)
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __len__(self) -> int:
        """Number of entries (BPE + added tokens), as ``len()`` of an HF tokenizer."""
        return self._n_entries


def _added_token(content: str, tid: int, special: bool = True) -> dict:
    return {"id": tid, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}
