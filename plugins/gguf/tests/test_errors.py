"""Bad GGUF input fails with a message that names the problem."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as T
from inference_engine.testing import cpu_llm, run_cli
from inference_engine_gguf.architectures import UnknownArchitectureError
from inference_engine_gguf.export import export_to_gguf
from inference_engine_gguf.format import GGUFFormat
from inference_engine_gguf.ggml_types import UnsupportedGGMLTypeError
from inference_engine_gguf.gguf_file import GGUFFileError


@pytest.fixture(scope="module")
def good_file(tmp_path_factory, tokenizer, make_hf_model):
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    export_to_gguf(make_hf_model("qwen3"), tokenizer, path, T.Q8_0)
    return path


def write_file(path, arch: str, tensors: dict[str, tuple[np.ndarray, T | None]]) -> str:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_truncated_file_is_reported(tmp_path, good_file):
    data = good_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFFileError, match="truncated"):
        GGUFFormat(str(cut))


def test_header_cut_short_is_reported(tmp_path, good_file):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good_file.read_bytes()[:200])
    with pytest.raises(GGUFFileError, match="truncated or corrupt"):
        GGUFFormat(str(cut))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(GGUFFileError, match="not a GGUF file"):
        GGUFFormat(str(bad))


def test_unsupported_quant_type_is_named(tmp_path):
    raw = np.zeros((4, 66), dtype=np.uint8)  # IQ2_XXS: 66 bytes per 256 values
    path = write_file(tmp_path / "iq.gguf", "qwen3", {"blk.0.attn_q.weight": (raw, T.IQ2_XXS)})
    with pytest.raises(UnsupportedGGMLTypeError, match="IQ2_XXS.*blk.0.attn_q.weight"):
        GGUFFormat(path)


def test_unknown_architecture_is_named(tmp_path):
    path = write_file(tmp_path / "arch.gguf", "mamba",
                      {"token_embd.weight": (np.zeros((8, 256), np.float32), None)})
    supported = ("deepseek2, glm4moe, gpt-oss, granitemoe, llama, minimax-m2, qwen2, qwen3, "
                 "qwen3moe")
    with pytest.raises(UnknownArchitectureError, match=f"'mamba'.*{supported}"):
        GGUFFormat(path)


def test_folder_with_one_gguf_loads_and_two_are_refused(tmp_path, good_file):
    (tmp_path / "one").mkdir()
    os.link(good_file, tmp_path / "one" / "m.gguf")
    llm = cpu_llm(str(tmp_path / "one"), dtype="float32", show_progress=False,
              kv_cache_memory=1 << 22)
    assert llm.get_tokenizer().eos_token == "<|im_end|>"
    os.link(good_file, tmp_path / "one" / "other.gguf")
    with pytest.raises(GGUFFileError, match="several .gguf files"):
        GGUFFormat(str(tmp_path / "one"))


def test_without_the_plugin_the_core_says_what_to_install(good_file):
    code = ("from inference_engine import LLM\n"
            f"LLM({str(good_file)!r}, show_progress=False, platform='cpu')\n")
    env = {**os.environ, "INFERENCE_ENGINE_PLUGINS": "builtin,models"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "pip install inference-engine-gguf-plugin" in proc.stderr, proc.stderr[-2000:]


def test_rope_factors_that_are_not_llama3_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    path = write_file(tmp_path / "rope.gguf", "llama", {
        "token_embd.weight": (np.zeros((8, 256), np.float32), None),
        "rope_freqs.weight": ((rng.random(32) * 7 + 1).astype(np.float32), None),
    })
    with pytest.raises(GGUFFileError, match="does not follow Llama-3 rope scaling"):
        GGUFFormat(path).load_config()


def test_bad_activation_mode_and_unknown_option_are_named(good_file):
    with pytest.raises(ValueError, match=r"activations='int4' is not one of q8, float"):
        cpu_llm(str(good_file), show_progress=False, quant_options={"activations": "int4"})
    unknown = r"'gguf' has no option 'group_size'.*takes: accumulate, activations"
    with pytest.raises(ValueError, match=unknown):
        cpu_llm(str(good_file), show_progress=False, quant_options={"group_size": "32"})
    with pytest.raises(ValueError, match=r"accumulate='float128' is not one of default, float64"):
        cpu_llm(str(good_file), show_progress=False, quant_options={"accumulate": "float128"})


def test_quant_option_on_the_command_line(good_file):
    ok = run_cli("generate", "--model", str(good_file), "--prompt", "hi", "--max-tokens", "2",
                 "--quant-option", "activations=float", "--json", "--platform", "cpu")
    assert ok.returncode == 0, ok.stderr
    bad = run_cli("generate", "--model", str(good_file), "--prompt", "hi", "--quant-option",
                  "activations", "--platform", "cpu")
    assert bad.returncode == 2 and "--quant-option takes KEY=VALUE, got 'activations'" in bad.stderr
