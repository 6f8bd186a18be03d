"""The tokenizer rebuilt from GGUF metadata encodes text exactly as the original one."""

from __future__ import annotations

import pytest
from gguf import GGUFWriter
from inference_engine.testing import SAMPLE_TEXT, train_tiny_tokenizer
from inference_engine_gguf.export import _write_tokenizer
from inference_engine_gguf.gguf_file import GGUFFile
from inference_engine_gguf.tokenizer import build_tokenizer

TEXTS = [
    *SAMPLE_TEXT,
    "<|im_start|>user\nWhat's 12345 + 678?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces,\ttabs\n\nand   runs of    spaces  ",
    "I'll say it's DON'T they've we're 3.14159 — ünïcödé ÆØÅ",
    "\n\n\nnewlines\r\nCRLF",
    "",
]


def write_vocab_only(path, write_tokenizer) -> GGUFFile:
    writer = GGUFWriter(str(path), "qwen3")
    write_tokenizer(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(str(path))


def test_gpt2_vocab_encodes_like_the_original(tmp_path):
    original = train_tiny_tokenizer()
    file = write_vocab_only(tmp_path / "tok.gguf",
                            lambda w: _write_tokenizer(w, original, None, 0))
    ours = build_tokenizer(file)
    for text in TEXTS:
        assert ours.encode(text) == original.encode(text), text
        ids = original.encode(text)
        assert ours.decode(ids) == original.decode(ids)
    assert ours.eos_token == original.eos_token and ours.pad_token == original.pad_token
    messages = [{"role": "user", "content": "hi there"}]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == original.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


# The pre-tokenizer regexes as transformers' own tokenizer.json files spell them.
HF_PATTERNS = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}


def _train_split_bpe(pattern: str, ignore_merges: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLE_TEXT * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.mark.parametrize("pre", list(HF_PATTERNS))
def test_named_pre_tokenizers_match_transformers_regexes(pre, tmp_path):
    original = _train_split_bpe(HF_PATTERNS[pre], ignore_merges=pre == "llama-bpe")

    def write(w):
        _write_tokenizer(w, original, None, 0)
        # _write_tokenizer wrote "default"; overwrite the pre-tokenizer name.
        w.kv_data[0].pop("tokenizer.ggml.pre", None)
        w.add_tokenizer_pre(pre)

    ours = build_tokenizer(write_vocab_only(tmp_path / "tok.gguf", write))
    for text in TEXTS:
        assert ours.encode(text) == original.encode(text), text


# --------------------------------------------------------------------- SentencePiece


def spm_reference(text: str, pieces: dict[str, tuple[int, float]], add_prefix: bool = True):
    """llama.cpp's ``llm_tokenizer_spm``: merge the best-scoring adjacent pair, leftmost first;
    symbols left without a piece fall back to ``<0xXX>`` byte tokens."""
    text = ("\u2581" if add_prefix else "") + text.replace(" ", "\u2581")
    symbols = list(text)
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in pieces:
                score = pieces[joined][1]
                if best is None or score > best[0]:
                    best = (score, i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    ids = []
    for s in symbols:
        if s in pieces:
            ids.append(pieces[s][0])
        else:
            ids.extend(pieces[f"<0x{b:02X}>"][0] for b in s.encode("utf-8"))
    return ids


def test_llama_spm_vocab_matches_llama_cpp_algorithm(tmp_path):
    corpus = " ".join(SAMPLE_TEXT[:3] + SAMPLE_TEXT[4:])  # leave the CJK/emoji line to bytes
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    chars = sorted(set(corpus.replace(" ", "\u2581")) | {"\u2581"})
    for c in chars:
        tokens.append(c)
        types.append(1)
        scores.append(-1000.0 - len(tokens))
    # Frequent pieces become merged tokens, each with its own score.
    words = {("\u2581" + w) for w in corpus.split()} | set(corpus.split())
    extra = sorted({w[:n] for w in words for n in range(2, min(len(w), 6) + 1)})
    for rank, piece in enumerate(extra):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank) - 1.0)
    pieces = {t: (i, s) for i, (t, s) in enumerate(zip(tokens, scores, strict=True))}

    def write(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)

    ours = build_tokenizer(write_vocab_only(tmp_path / "spm.gguf", write))
    for text in SAMPLE_TEXT + ["Hello  world", "x"]:
        expected = [1] + spm_reference(text, pieces)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected, skip_special_tokens=True) == text
