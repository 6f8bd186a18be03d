"""The GGUF bench model's Q4_K_M file, made by llama.cpp's own quantizer: every K-quant
tensor in 16s through the packed tiles and through the raw-row path of this machine's Q8_K
kernel, each against the float64 reference (Q8_K-rounded activations times the gguf
package's dequantization), on 3 random activation rows.

Prints per tensor: each path's max |error| / (|acts| @ |w|), and max |tiles - raw|.
Needs llama-cpp-python (see bench/gguf_vs_llamacpp.py).

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/gguf_tiles_on_file.py
"""
import os, sys, tempfile, torch, numpy as np
sys.path.insert(0, "bench")
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T
from gguf_vs_llamacpp import build_model, find_llamacpp_python, run_llamacpp, VOCAB
from inference_engine_gguf.export import export_to_gguf
from inference_engine_gguf import q8k_kernels
from inference_engine_gguf.testing import q8k_matmul_reference
work = tempfile.mkdtemp()
print('packed tiles available:', q8k_kernels.packing_available())
hf, tok = build_model(8)
f32 = os.path.join(work, "f32.gguf"); q4 = os.path.join(work, "q4.gguf")
export_to_gguf(hf, tok, f32, T.F32, extra_control_tokens=VOCAB - len(tok))
run_llamacpp(find_llamacpp_python(None), {"op": "quantize", "src": f32, "dst": q4, "ftype": "Q4_K_M"}, work)
ext = q8k_kernels.kernel()
worst = {}
for t in GGUFReader(q4).tensors:
    qt = T(int(t.tensor_type))
    if qt not in (T.Q4_K, T.Q6_K, T.Q5_K): continue
    raw = torch.from_numpy(np.ascontiguousarray(t.data)).view(torch.uint8)
    raw = raw.reshape(int(t.shape[1]) if len(t.shape) > 1 else 1, -1).contiguous()
    n = raw.shape[0]
    if n % 16: continue
    k = int(t.shape[0])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    ref, mag = q8k_matmul_reference(x, raw, qt)
    out_t = torch.empty(3, n); ext.q8k_parts_into(x, [q8k_kernels.pack_tiles(raw, qt)], [int(qt)], [True], out_t)
    out_r = torch.empty(3, n); ext.q8k_parts_into(x, [raw], [int(qt)], [False], out_r)
    et = ((out_t.double() - ref).abs() / mag).max().item(); er = ((out_r.double() - ref).abs() / mag).max().item()
    d = (out_t - out_r).abs().max().item()
    worst[qt.name] = max(worst.get(qt.name, (0, 0, 0)), (et, er, d))
    print(t.name, qt.name, tuple(raw.shape), f"tiles err/mag {et:.2e} raw err/mag {er:.2e} |tiles-raw| {d:.2e}")
print(worst)
