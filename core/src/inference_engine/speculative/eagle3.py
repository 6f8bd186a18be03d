"""EAGLE-3 proposer: a one-layer drafter fed with the target's hidden states from chosen layers.

Checkpoint layout followed: the public EAGLE-3 Llama drafters as vLLM loads them
(``vllm/model_executor/models/llama_eagle3.py``, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]``, ``hidden_size``,
heads, ``intermediate_size``, ``rms_norm_eps``, rope settings, ``draft_vocab_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (default ``(2, L // 2, L - 3)`` of the
target's L layers); tensors ``fc.weight [H, 3 * H_target]``, ``midlayer.hidden_norm``,
``midlayer.input_layernorm``, ``midlayer.self_attn.{q,k,v,o}_proj`` (q/k/v take ``2 * H``:
the normed token embedding concatenated with the normed feature),
``midlayer.post_attention_layernorm``, ``midlayer.mlp.{gate,up,down}_proj``, ``norm``,
``lm_head [draft_vocab, H]`` and ``d2t`` (target id = draft id + d2t[draft id]); the token
embedding is the target's unless the checkpoint carries ``embed_tokens.weight``.

Per request: the target's forwards record the inputs of the chosen layers (``h + residual``,
as vLLM's aux hidden states) for every position they compute; the drafter row at position
i takes token i + 1 and ``fc(aux_i)``, writes its K/V at position i of its own paged cache
(the target's block ids and geometry) and predicts token i + 2. After the verified rows, k
more rows feed back each draft with the drafter's own pre-norm output as the feature.
Drafting is greedy (a point mass for the rejection sampler).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inference_engine.config import SpeculativeConfig
from inference_engine.interfaces.attention import KVCacheSpec
from inference_engine.interfaces.proposer import DraftRequest, Proposal, Proposer, ProposerContext
from inference_engine.speculative.draft_sampling import DraftSampler
from inference_engine.speculative.paged_drafter_cache import PagedDrafterCache, rms_norm, rope

__all__ = ["read_attention_geometry", "Eagle3Drafter", "Eagle3Proposer", "HiddenStateTap"]


class HiddenStateTap:
    """Records hidden states of the target on every forward, so a drafter can read them per
    position after the step: for ``i < L`` the input of decoder layer ``i``
    (``hidden + residual``, vLLM's aux hidden states), for ``i == L`` the final normed
    output (transformers' ``hidden_states[L]``). Index ``i`` is transformers'
    ``output_hidden_states`` index.

    Raises:
        ValueError: the target has no ``model.layers`` decoder stack, or an index is out
            of range.
    """

    def __init__(self, target: Any, layer_ids: Sequence[int]) -> None:
        model = getattr(target, "model", None)
        layers = getattr(model, "layers", None)
        if layers is None:
            raise ValueError(f"speculative methods that read target hidden states need a "
                             f"decoder-layer target; {type(target).__name__} has none")
        for i in layer_ids:
            if not 0 <= i <= len(layers):
                raise ValueError(f"target layer id {i} is outside the target's {len(layers)} "
                                 f"layers")
        self.layer_ids = list(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self.target = target
        for i in sorted(set(self.layer_ids)):
            if i < len(layers):
                layers[i].register_forward_pre_hook(self._pre_hook(i))
            else:
                model.norm.register_forward_hook(self._norm_hook(i))

    def _pre_hook(self, index: int) -> Any:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            hidden, residual = args[0], args[1]
            self.captured[index] = hidden if residual is None else hidden + residual
        return pre_hook

    def _norm_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self.captured[index] = output[0] if isinstance(output, tuple) else output
        return hook

    def disable_fused_decode(self) -> None:
        """The C++ CPU decode step runs every layer in one call, past the hooks: drop it
        (once the target's cache is bound) so one-token steps record too."""
        model = getattr(self.target, "model", None)
        if getattr(model, "decode_step", None) is not None:
            model.decode_step = None

    def take(self) -> torch.Tensor:
        """``[T, len(layer_ids) * H]`` of the last forward, in ``layer_ids`` order."""
        return torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)


def read_attention_geometry(module: Any, cfg: dict[str, Any]) -> int:
    """Set ``num_heads``, ``num_kv_heads``, ``head_dim``, ``eps`` and ``rope_theta`` on a
    drafter ``module`` from its Llama/Qwen3-style config dict; returns ``hidden_size``."""
    h = cfg["hidden_size"]
    module.num_heads = cfg["num_attention_heads"]
    module.num_kv_heads = cfg.get("num_key_value_heads", module.num_heads)
    module.head_dim = cfg.get("head_dim") or h // module.num_heads
    module.eps = cfg.get("rms_norm_eps", 1e-6)
    rope_params = cfg.get("rope_parameters") or {}
    module.rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return h


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 Llama drafter (one decoder layer over ``[embedding, feature]``)."""

    def __init__(self, cfg: dict[str, Any], target_hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        h = read_attention_geometry(self, cfg)
        inter = cfg["intermediate_size"]
        vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
        num_aux = 3

        def lin(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False, dtype=dtype)

        self.fc = lin(num_aux * target_hidden, h)
        self.hidden_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.input_layernorm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.q_proj = lin(2 * h, self.num_heads * self.head_dim)
        self.k_proj = lin(2 * h, self.num_kv_heads * self.head_dim)
        self.v_proj = lin(2 * h, self.num_kv_heads * self.head_dim)
        self.o_proj = lin(self.num_heads * self.head_dim, h)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.gate_proj = lin(h, inter)
        self.up_proj = lin(h, inter)
        self.down_proj = lin(inter, h)
        self.norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.lm_head = lin(h, vocab)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.int64))
        self.embed_tokens: nn.Module | None = None  # the target's unless the checkpoint has one

    # Checkpoint name -> our parameter (vLLM's names; "midlayer." is its one layer).
    NAMES = {
        "fc.weight": "fc.weight", "norm.weight": "norm", "lm_head.weight": "lm_head.weight",
        "d2t": "d2t", "midlayer.hidden_norm.weight": "hidden_norm",
        "midlayer.input_layernorm.weight": "input_layernorm",
        "midlayer.post_attention_layernorm.weight": "post_attention_layernorm",
        **{f"midlayer.self_attn.{p}.weight": f"{p}.weight"
           for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
        **{f"midlayer.mlp.{p}.weight": f"{p}.weight"
           for p in ("gate_proj", "up_proj", "down_proj")},
    }

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in by name.

        Raises:
            ValueError: a missing or misshapen tensor, named.
        """
        state = self.state_dict()
        for ckpt, ours in self.NAMES.items():
            if ckpt not in tensors:
                if ckpt == "d2t":
                    continue  # a full-vocabulary drafter needs no mapping
                raise ValueError(f"EAGLE-3 checkpoint is missing {ckpt!r}")
            tensor = tensors[ckpt]
            if tuple(tensor.shape) != tuple(state[ours].shape):
                raise ValueError(f"EAGLE-3 tensor {ckpt!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(state[ours].shape)}")
            with torch.no_grad():
                state[ours].copy_(tensor.to(state[ours].dtype))

    def forward(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: PagedDrafterCache, block_tables: list[Sequence[int]],
                rows_per_seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T]`` tokens, ``[T, 3H_t or H]`` features and positions of ``len(rows_per_seq)``
        sequences laid end to end -> (``[T, draft_vocab]`` logits, ``[T, H]`` pre-norm
        hidden states: the next row's feature)."""
        if features.shape[-1] != self.fc.out_features:
            features = self.fc(features)
        residual = features
        embeds = rms_norm(self.embed_tokens(token_ids), self.input_layernorm, self.eps)
        x = torch.cat([embeds, rms_norm(features, self.hidden_norm, self.eps)], dim=-1)
        # q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        attn = cache.attend(q, k, v, positions, block_tables, rows_per_seq)
        hidden = self.o_proj(attn.reshape(len(token_ids), -1)) + residual
        residual = hidden
        hidden = rms_norm(hidden, self.post_attention_layernorm, self.eps)
        hidden = self.down_proj(nn.functional.silu(self.gate_proj(hidden)) * self.up_proj(hidden))
        prenorm = hidden + residual
        logits = self.lm_head(rms_norm(prenorm, self.norm, self.eps))
        return logits, prenorm


class Eagle3Proposer(Proposer):
    """``{"method": "eagle3", "model": PATH, "num_speculative_tokens": k}``.

    Raises:
        ValueError: no ``model``, a config or checkpoint that is not an EAGLE-3 drafter of
            this target (named), or a target without decoder layers.
    """

    reads_target_hidden_states = True

    supports_probabilistic_drafts = True

    def __init__(self, spec: SpeculativeConfig, context: ProposerContext) -> None:
        super().__init__(spec, context)
        self.draft_sampler = DraftSampler(spec.draft_sample_method, context.config.model.seed)
        if not spec.model:
            raise ValueError("speculative_config 'model' is required for method eagle3 (the "
                             "EAGLE-3 drafter's folder)")
        from safetensors.torch import load_file

        path = Path(spec.model)
        cfg = json.loads((path / "config.json").read_text())
        target_cfg = context.target_model.ctx.hf_config
        num_layers = target_cfg.num_hidden_layers
        eagle = cfg.get("eagle_config") or {}
        layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids") or [
            2, num_layers // 2, num_layers - 3]
        if len(layer_ids) != 3:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids must name 3 target layers, got "
                             f"{layer_ids}")
        if cfg.get("vocab_size", context.vocab_size) != context.vocab_size:
            raise ValueError(f"EAGLE-3 drafter {spec.model!r} has vocab_size "
                             f"{cfg.get('vocab_size')}; the target's is {context.vocab_size}")
        device = context.platform.device()
        self.dtype = context.dtype
        with torch.device(device):
            self.drafter = Eagle3Drafter(cfg, target_cfg.hidden_size, context.dtype)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(file))
        self.drafter.load(tensors)
        if "embed_tokens.weight" in tensors:
            self.drafter.embed_tokens = nn.Embedding.from_pretrained(
                tensors["embed_tokens.weight"].to(device=device, dtype=context.dtype))
        else:
            self.drafter.embed_tokens = context.target_model.model.embed_tokens
        self.drafter.eval()
        self.tap = HiddenStateTap(context.target_model, layer_ids)
        self.cache = PagedDrafterCache(self.drafter.num_kv_heads, self.drafter.head_dim,
                                       context.block_size, context.dtype, device)
        # request id -> drafter K/V valid below this position; and the target's recorded
        # aux states (start position, [n, 3H]) not yet fed to the drafter.
        self._done: dict[str, int] = {}
        self._pending: dict[str, list[tuple[int, torch.Tensor]]] = {}

    @property
    def num_lookahead_slots(self) -> int:
        return self.num_speculative_tokens

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [self.cache.spec()]

    def bind_kv_cache(self, num_blocks: int) -> None:
        self.cache.allocate(num_blocks)
        self.tap.disable_fused_decode()

    def remove(self, request_id: str) -> None:
        self._done.pop(request_id, None)
        self._pending.pop(request_id, None)

    def on_target_step(self, request_ids: Sequence[str], num_computed: Sequence[int],
                       query_lens: Sequence[int]) -> None:
        aux = self.tap.take()
        offset = 0
        for rid, start, n in zip(request_ids, num_computed, query_lens, strict=True):
            rows = aux[offset : offset + n]
            offset += n
            # Rows from ``start`` on supersede older ones (recompute after preemption,
            # rejected drafts); the drafter redoes its K/V from there.
            kept = [(s, t[: max(0, start - s)]) for s, t in self._pending.get(rid, [])
                    if s < start]
            self._pending[rid] = [*[(s, t) for s, t in kept if len(t)], (start, rows)]
            self._done[rid] = min(self._done.get(rid, start), start)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_drafts > 0]
        if not active:
            return Proposal(drafts)
        device = self.cache.device
        tokens, feats, positions, rows, tables = [], [], [], [], []
        for i in active:
            r = requests[i]
            last = len(r.token_ids) - 2  # the newest verified aux state's position
            done = self._done.get(r.request_id, 0)
            feat = self._features(r.request_id, done, last)
            tokens.append(torch.tensor(list(r.token_ids[done + 1 : last + 2]), dtype=torch.int64))
            feats.append(feat)
            positions.append(torch.arange(done, last + 1))
            rows.append(last + 1 - done)
            tables.append(r.block_ids)
            self._done[r.request_id] = last + 1
        logits, hidden = self.drafter(torch.cat(tokens).to(device), torch.cat(feats),
                                      torch.cat(positions).to(device), self.cache, tables, rows)
        ends = torch.tensor(rows).cumsum(0) - 1
        asks = [requests[i] for i in active]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        next_tok = self._pick(logits[ends.to(device)], asks, [drafts[i] for i in active],
                              [probs[i] for i in active])
        feat = hidden[ends.to(device)]
        pos = torch.tensor([len(requests[i].token_ids) - 1 for i in active])
        for step in range(self.num_speculative_tokens):
            picked = next_tok.tolist()
            for j, i in enumerate(active):
                if len(drafts[i]) < requests[i].max_drafts:
                    drafts[i].append(int(picked[j]))
            if step == self.num_speculative_tokens - 1:
                break
            logits, feat = self.drafter(next_tok, feat, (pos + step).to(device), self.cache,
                                        tables, [1] * len(active))
            next_tok = self._pick(logits, asks, [drafts[i] for i in active],
                                  [probs[i] for i in active])
        if not any(probs):
            return Proposal(drafts)
        return Proposal(drafts, [torch.stack(p[: len(d)]) if p and d else None
                                 for p, d in zip(probs, drafts, strict=True)])

    def _pick(self, logits: torch.Tensor, asks: Sequence[DraftRequest],
              drafts: Sequence[list[int]], probs: Sequence[list[torch.Tensor]]
              ) -> torch.Tensor:
        """Next target-vocabulary draft per row from draft-vocabulary ``logits``; under
        probabilistic drafting appends each row's q (over the target vocabulary) to
        ``probs``."""
        if not self.draft_sampler.is_probabilistic:
            return self._to_target(logits.argmax(-1))
        # The draft vocabulary's logits at their target ids, -inf elsewhere.
        ids = self._to_target(torch.arange(logits.shape[1], device=logits.device))
        full = logits.new_full((logits.shape[0], self.context.vocab_size), float("-inf"))
        full[:, ids] = logits
        picked, q = self.draft_sampler.pick(
            full, [r.params for r in asks],
            [list(r.token_ids[r.num_prompt_tokens:]) + d for r, d in zip(asks, drafts,
                                                                         strict=True)],
            [r.token_ids[:r.num_prompt_tokens] for r in asks])
        for row, qi in zip(probs, q, strict=True):
            if qi is not None:
                row.append(qi)
        return torch.tensor(picked, dtype=torch.int64, device=logits.device)

    def _features(self, rid: str, first: int, last: int) -> torch.Tensor:
        """The recorded aux states of positions ``first..last`` (contiguous)."""
        parts = []
        for start, rows in self._pending.get(rid, []):
            lo, hi = max(first, start), min(last + 1, start + len(rows))
            if lo < hi:
                parts.append(rows[lo - start : hi - start])
        feat = torch.cat(parts) if parts else torch.empty(0)
        if len(feat) != last + 1 - first:
            raise RuntimeError(f"EAGLE-3: target hidden states of positions {first}..{last} "
                               f"of request {rid} were not recorded")
        # Keep only what a later rejection could still need (from the last position on).
        self._pending[rid] = [(s, r) for s, r in self._pending[rid] if s + len(r) > last]
        return feat

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.drafter.d2t[draft_ids]
