"""Tiny offline checkpoints for tests, benchmarks and the demo (no downloads).

A byte-level BPE tokenizer is trained on a built-in text, and a random
transformers model is saved next to it in Hugging Face layout.

Tests run the engine on the CPU platform *explicitly* (:func:`cpu_llm`,
``ServerProcess(..., platform="cpu")``): without a platform the engine takes
the present one with top priority (CUDA on a GPU machine), while the
transformers references the tests compare with are built on the CPU.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SAMPLE_TEXT",
    "TEST_PLATFORM",
    "ServerProcess",
    "cpu_llm",
    "free_port",
    "has_accelerator",
    "make_scripted_model",
    "make_tiny_model",
    "run_cli",
    "spawned_children",
    "train_tiny_tokenizer",
]

SAMPLE_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed size blocks.",
    "Continuous batching mixes prefill chunks with running decodes.",
    "héllo wörld, naïve café, 你好世界, こんにちは, 🎉🚀 emoji spans bytes.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a tiny language model that liked numbers: 1 2 3 42 1000.",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tiny_tokenizer(vocab_size: int = 384, texts: list[str] | None = None) -> Any:
    """A transformers fast tokenizer trained here: byte-level BPE with chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((texts or SAMPLE_TEXT) * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast



def run_under_triton_interpreter(test_file: str, timeout: float = 600.0) -> str:
    """Run ``test_file`` in a child pytest with ``TRITON_INTERPRET=1`` and return its output.

    ``triton.jit`` decides at import whether it interprets, so a test module whose kernel
    cases run on the CPU calls this from a wrapper test (skipped in the child) and asserts
    on the child's summary line (which cases skipped there).

    Raises:
        AssertionError: the child failed (its output's tail is the message).
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "--import-mode=importlib", test_file],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout

# The platform tests pin (``--platform``): where their transformers references run.
TEST_PLATFORM = "cpu"


def cpu_llm(model: str | Path, **kwargs: Any) -> Any:
    """``LLM(model, platform="cpu", show_progress=False, **kwargs)``.

    For tests that compare the engine with a transformers model built on the
    CPU: pinning the platform keeps both sides on one device on any machine.
    """
    from inference_engine.entrypoints.llm import LLM

    kwargs.setdefault("show_progress", False)
    return LLM(str(model), platform=TEST_PLATFORM, **kwargs)


def has_accelerator() -> bool:
    """Whether torch sees a real GPU here (CUDA, ROCm or XPU), simulations aside.

    Tests that check *this* machine is CPU-only skip where it is not.
    """
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())


ARCH_CONFIGS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


def make_tiny_model(
    path: str | Path,
    arch: str = "qwen3",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: Any | None = None,
    **overrides: Any,
) -> Path:
    """Save a random ``arch`` model (and tokenizer) under ``path``; returns the path."""
    import transformers

    path = Path(path)
    tokenizer = tokenizer or train_tiny_tokenizer()
    params: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "qwen3":
        params["head_dim"] = 16
    params.update(overrides)
    config = getattr(transformers, ARCH_CONFIGS[arch])(**params)
    torch.manual_seed(seed)
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[arch]
    model = model_cls(config).to(dtype)
    with torch.no_grad():
        # Random init is nearly flat; a wider spread gives decisive greedy choices.
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_scripted_model(path: str | Path, script: list[str], seed: int = 0,
                        hidden_size: int = 128) -> Path:
    """Save a real Qwen3 checkpoint whose greedy output after a chat prompt is ``script``.

    For end-to-end tests of everything after the forward pass (streaming,
    parsers, the server) with a known output, not a mocked one. Each piece of
    ``script`` becomes one added token of the tiny tokenizer; the weights make
    the model a bigram table: attention and MLP outputs are zero (so the
    residual stream is the token embedding), and the LM head maps each token
    to its successor: the chat template's last token to the first piece, each
    piece to the next, the last to EOS. Pieces must be distinct.
    """
    import transformers

    if len(set(script)) != len(script) or not script:
        raise ValueError("script pieces must be distinct and non-empty")
    path = Path(path)
    tokenizer = train_tiny_tokenizer()
    tokenizer.add_tokens(list(script))
    piece_ids = [tokenizer.convert_tokens_to_ids(p) for p in script]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True, tokenize=False)
    start = tokenizer.encode(prompt, add_special_tokens=False)[-1]
    chain = [start, *piece_ids, tokenizer.eos_token_id]
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        embed = torch.randn(len(tokenizer), hidden_size)
        embed *= hidden_size ** 0.5 / embed.norm(dim=1, keepdim=True)  # RMS 1 per row
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(len(tokenizer), hidden_size)
        for prev, nxt in zip(chain, chain[1:], strict=False):
            # logit(nxt | prev) = 40; other tokens get 40 * cos(embeddings) (|cos| << 1).
            head[nxt] += 40.0 * embed[prev] / hidden_size
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def word_level_tokenizer(vocab_size: int) -> Any:
    """A tokenizer with ``vocab_size`` synthetic words ``w0 w1 ...``, for benchmarks
    that feed token ids directly and need every id to decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="w0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawned_children(pid: int) -> list[int]:
    """Process ids of ``pid``'s children started by multiprocessing's spawn (a server's worker
    or DP-rank processes; not its resource tracker). Linux ``/proc`` only."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline:
                found.append(int(child))
    return found


PORT_ATTEMPTS = 3  # ServerProcess: starts tried when the chosen port was taken meanwhile


class ServerProcess:
    """``inference-engine serve`` as a subprocess on a free loopback port (tests, benchmarks).

    ``url`` is its base address, ``log()`` its output so far.
    """

    def __init__(self, model: str | Path, *args: str, env: dict[str, str] | None = None,
                 startup_timeout: float = 120.0, kv_cache_memory: str = "16MiB",
                 threads: int | None = 1, platform: str | None = None) -> None:
        """Args:
            model: model folder to serve.
            args: more ``serve`` flags.
            platform: ``--platform`` (tests pass ``TEST_PLATFORM``); None: the engine's
                choice, the present platform with top priority.
            env: extra environment variables.
            startup_timeout: seconds to wait for ``/health``.
            kv_cache_memory: ``--kv-cache-memory`` ("" for the engine's default).
            threads: ``OMP_NUM_THREADS`` for the server (1 keeps tests from
                fighting over cores; None leaves the default).
        """
        threads_env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        env = {**os.environ, **threads_env, **(env or {})}
        extra = [*args]
        if kv_cache_memory:
            extra += ["--kv-cache-memory", kv_cache_memory]
        if platform:
            extra += ["--platform", platform]
        # free_port() only finds a port free now: until the server binds it, another
        # process (a parallel test's client connection, say) may be given it. Then the
        # server exits at once naming the address, and it is started again on another.
        for attempt in range(PORT_ATTEMPTS):
            if self._start(model, extra, env, startup_timeout):
                return
            if attempt + 1 == PORT_ATTEMPTS or "address already in use" not in self.log():
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log()}")

    def _start(self, model: str | Path, extra: list[str], env: dict[str, str],
               startup_timeout: float) -> bool:
        """Start the server on a free port; True once healthy, False if it exited."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        command = [sys.executable, "-m", "inference_engine.cli", "serve", str(model),
                   "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"server did not start in {startup_timeout}s:\n{self.log()}")

    def log(self) -> str:
        return Path(self._log.name).read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and wait; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``inference-engine ARGS`` with this interpreter; output captured as text."""
    return subprocess.run([sys.executable, "-m", "inference_engine.cli", *args],
                          capture_output=True, text=True, timeout=timeout)
