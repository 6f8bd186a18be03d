"""gpt-oss: attention sinks, sliding-window layers, biased experts with a clamped SwiGLU.

Attention is the shared decoder's with q/k/v/o biases, a learned sink logit
per head (handled by the attention backend) and ``config.layer_types``
choosing sliding-window layers. The MoE router has a bias and takes the
softmax of the top-k logits. Stacked expert tensors are stored as
``[E, in, out]`` with gate and up columns interleaved; they are transposed
and de-interleaved into our ``[E, out, in]`` gate-then-up layout on load
(MXFP4 checkpoints' packed ``gate_up_proj_blocks``/``_scales`` rows too, still packed).
"""

from __future__ import annotations

from functools import partial

import torch
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers import DecoderAttention, DecoderForCausalLM
from inference_engine.layers.moe import ExpertActivation, RouterSpec, SparseMoeBlock
from torch import nn

__all__ = ["GptOssAttention", "GptOssForCausalLM", "from_gpt_oss_layout"]


def from_gpt_oss_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A stacked gpt-oss expert tensor in our layout (see the module docstring)."""
    if name == "gate_up_proj":  # [E, H, 2I] interleaved -> [E, 2I, H] gate rows then up rows
        t = tensor.transpose(1, 2)
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
    if name in ("gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales"):
        # [E, 2I] or MXFP4's packed rows [E, 2I, K/32, (16)]: rows interleaved, each row whole
        return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
    if name == "down_proj":  # [E, I, H] -> [E, H, I]
        return tensor.transpose(1, 2)
    return tensor


class GptOssAttention(DecoderAttention):
    """The shared attention plus a learned sink logit per head (``self_attn.sinks``)."""

    def make_sinks(self, ctx: ModelContext) -> torch.Tensor:
        sinks = nn.Parameter(torch.empty(self.num_heads, dtype=ctx.dtype), requires_grad=False)
        # Under tensor parallelism this rank's query heads' sinks (qkv_proj splits the heads).
        sinks.weight_loader = partial(  # type: ignore[attr-defined]
            _load_head_rows, first=self.qkv_proj.tp_rank * self.num_heads,
            total=self.qkv_proj.total_num_heads,
            name=f"{self.qkv_proj.prefix.rpartition('.')[0]}.sinks")
        return sinks


def _load_head_rows(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None, *,
                    first: int, total: int, name: str) -> None:
    """Copy ``param``'s heads ``first ..`` of a per-head checkpoint tensor of ``total``."""
    heads = param.shape[0]
    if tuple(loaded.shape) != (total,):
        raise ValueError(f"shape mismatch for {name}: the checkpoint tensor has shape "
                         f"{tuple(loaded.shape)}, the model expects ({total},)")
    param.data.copy_(loaded.narrow(0, first, heads))


class GptOssForCausalLM(DecoderForCausalLM):
    """Biases on q/k/v/o (``config.attention_bias``)."""

    def make_attention(self, layer_idx: int) -> nn.Module:
        return GptOssAttention(self.ctx, self.module_prefix(layer_idx, "self_attn"), layer_idx,
                               self.options)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.ctx.hf_config
        router = RouterSpec(cfg.num_local_experts, cfg.num_experts_per_tok, "topk_softmax")
        # transformers before ~5.20 has no swiglu_alpha in the config: its experts hard-code
        # 1.702 (seen on the GPU machine's 5.17).
        activation = ExpertActivation("swigluoai", alpha=getattr(cfg, "swiglu_alpha", 1.702),
                                      limit=cfg.swiglu_limit)
        return SparseMoeBlock(self.ctx, cfg.hidden_size, cfg.intermediate_size, router,
                              self.module_prefix(layer_idx, self.mlp_name), gate_name="router",
                              gate_bias=True, activation=activation, expert_bias=True,
                              checkpoint_transform=from_gpt_oss_layout)
