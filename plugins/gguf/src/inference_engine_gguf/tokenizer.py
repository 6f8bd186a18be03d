"""A transformers tokenizer rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

Two vocabularies llama.cpp writes are handled:

* ``gpt2``: byte-level BPE with an explicit merge list; the pre-tokenizer
  regex comes from ``tokenizer.ggml.pre`` as in llama.cpp's ``llama-vocab.cpp``.
* ``llama``: SentencePiece-style BPE over scored pieces with byte fallback
  (``<0x41>`` tokens). llama.cpp merges the adjacent pair whose joined piece
  has the highest score; a BPE whose merges are ranked by that score does the same.

Control tokens (type 3) become special added tokens, user-defined ones (4)
added tokens; BOS/EOS/pad/unk ids, ``add_bos_token`` and the embedded chat
template are carried over, so chat and the server work with a lone ``.gguf``.
"""

from __future__ import annotations

import logging
from typing import Any

from inference_engine_gguf.gguf_file import GGUFFile, GGUFFileError

__all__ = ["PRE_TOKENIZER_PATTERNS", "build_tokenizer"]

logger = logging.getLogger(__name__)

# gguf.TokenType values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
          r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex; None: GPT-2's own regex (byte-level pre-tokenizer).
PRE_TOKENIZER_PATTERNS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "gpt2": None,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
# Pre-tokenizers whose vocab lookup wins over merges (Llama 3's "ignore_merges").
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe"}


def build_tokenizer(gguf: GGUFFile) -> Any | None:
    """A ``PreTrainedTokenizerFast`` for the file, or None if it carries no vocabulary.

    Raises:
        GGUFFileError: for a tokenizer model other than ``gpt2``/``llama``, or
            inconsistent vocabulary metadata.
    """
    from transformers import PreTrainedTokenizerFast

    kind = gguf.get("tokenizer.ggml.model")
    tokens = gguf.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        return None
    types = gguf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFFileError(f"{gguf.path}: {len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        tok, add_bos_default = _gpt2(gguf, tokens), False
    elif kind == "llama":
        tok, add_bos_default = _llama(gguf, tokens, types), True
    else:
        raise GGUFFileError(
            f"{gguf.path}: tokenizer model {kind!r} is not supported (supported: gpt2, llama)"
        )
    _add_special_tokens(tok, tokens, types)

    def token(key: str) -> str | None:
        idx = gguf.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    _post_processor(tok, tokens, bos if add_bos else None, eos if add_eos else None)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=token("padding_token_id"),
        unk_token=token("unknown_token_id"),
        clean_up_tokenization_spaces=False,
    )
    template = gguf.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


def _gpt2(gguf: GGUFFile, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges_meta = gguf.get("tokenizer.ggml.merges")
    if not merges_meta:
        raise GGUFFileError(f"{gguf.path}: gpt2 tokenizer without tokenizer.ggml.merges")
    vocab = _vocab(tokens)
    merges = [tuple(m.split(" ", 1)) for m in merges_meta]
    pre = str(gguf.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZER_PATTERNS:
        logger.warning("unknown tokenizer.ggml.pre %r; using GPT-2's pre-tokenizer", pre)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    pattern = PRE_TOKENIZER_PATTERNS.get(pre)
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _llama(gguf: GGUFFile, tokens: list[str], types: list[int]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = gguf.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = _vocab(tokens)
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    # Every piece that two other pieces join into is a merge, ranked by its score.
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece_id, piece in enumerate(tokens):
        if types[piece_id] not in (NORMAL, USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[piece_id]), piece_id, vocab[left], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    tok = Tokenizer(models.BPE(
        vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
        unk_token=tokens[int(unk_id)] if unk_id is not None else None,
    ))
    steps = []
    if bool(gguf.get("tokenizer.ggml.add_space_prefix", True)):
        steps.append(normalizers.Prepend("\u2581"))
    steps.append(normalizers.Replace(" ", "\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if bool(gguf.get("tokenizer.ggml.add_space_prefix", True)):
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    return tok


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    return vocab


def _add_special_tokens(tok: Any, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types, strict=True) if kind == CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _post_processor(tok: Any, tokens: list[str], bos: str | None, eos: str | None) -> None:
    from tokenizers import processors

    if bos is None and eos is None:
        return
    ids = {t: tokens.index(t) for t in (bos, eos) if t is not None}
    single = " ".join(x for x in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if x)
    pair = single + " " + " ".join(x for x in (bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x)
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(ids.items())
    )
