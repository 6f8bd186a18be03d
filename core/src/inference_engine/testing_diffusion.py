"""Tiny DiffusionGemma checkpoints and transformers' reference runs, for tests and benches.

Sizes avoid ties (see ``../shared/docs/headline-models.md``): two layers (sliding,
full), a canvas of 8, a sliding window of 8 so prompts run past it, 4 experts top-2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["DETERMINISTIC_RECIPE", "hf_diffusion_generate", "make_tiny_diffusion_gemma"]

# transformers' generate is repeatable with these (plus a pad start canvas and no EOS):
# near-zero temperature makes the candidates the argmax and every entropy ~0.
DETERMINISTIC_RECIPE: dict[str, Any] = {
    "max_denoising_steps": 8, "entropy_bound": 0.1, "t_min": 0.0, "t_max": 1e-6,
    "stability_threshold": 1, "confidence_threshold": 0.005, "start_canvas": "pad",
}


def make_tiny_diffusion_gemma(path: str | Path, seed: int = 0, canvas_length: int = 8,
                              tokenizer: Any | None = None, hidden_size: int = 64,
                              num_layers: int = 2, **text_overrides: Any) -> Path:
    """Save a random ``DiffusionGemmaForBlockDiffusion`` (and tokenizer) under ``path``."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from inference_engine.testing import train_tiny_tokenizer
    from inference_engine.testing_parity import randomize

    path = Path(path)
    tokenizer = tokenizer or train_tiny_tokenizer()
    layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                   for i in range(num_layers)]
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, sliding_window=8,
        layer_types=layer_types, num_experts=4, top_k_experts=2,
        moe_intermediate_size=hidden_size // 2, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    text.update(text_overrides)
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision,
                                  canvas_length=canvas_length)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    randomize(model, seed=seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.fill_(1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_diffusion_generate(model: Any, prompt_ids: list[int], max_new_tokens: int,
                          settings: dict[str, Any], seed: int | None = None,
                          eos: bool = False) -> list[int]:
    """transformers' ``generate`` for one prompt; the new ids (pads after an EOS dropped).

    ``settings`` holds our diffusion keys; ``start_canvas="pad"`` replaces transformers'
    random canvas draws (start and renoise) with the pad id, as the deterministic recipe
    does. ``seed``: ``torch.manual_seed`` first (the global RNG drives the draws).
    """
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen

    kwargs = {k: v for k, v in settings.items() if k not in ("entropy_bound", "start_canvas")}
    kwargs["sampler_config"] = gen.EntropyBoundSamplerConfig(
        entropy_bound=float(settings.get("entropy_bound", 0.1)))
    if "confidence_threshold" in kwargs:
        kwargs["confidence_threshold"] = float(kwargs["confidence_threshold"])
    pad = model.config.text_config.pad_token_id
    original = gen.EntropyBoundSampler.initialize_canvas
    if settings.get("start_canvas") == "pad":
        def pad_canvas(self: Any, batch_size: int, device: torch.device) -> torch.Tensor:
            return torch.full((batch_size, self.canvas_length), pad, dtype=torch.long,
                              device=device)
        gen.EntropyBoundSampler.initialize_canvas = pad_canvas
    try:
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             eos_token_id=model.config.text_config.eos_token_id if eos else None,
                             **kwargs)
    finally:
        gen.EntropyBoundSampler.initialize_canvas = original
    new = out.sequences[0, len(prompt_ids):].tolist()
    eos_id = model.config.text_config.eos_token_id
    if eos and eos_id in new:
        new = new[: new.index(eos_id) + 1]
    return new
