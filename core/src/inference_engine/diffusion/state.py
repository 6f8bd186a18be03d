"""One diffusion request's denoising state between engine steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_engine.diffusion.settings import DiffusionSettings

__all__ = ["DiffusionState"]


@dataclass(eq=False)
class DiffusionState:
    """The current block's canvas and what the next denoising step needs.

    ``canvas`` None means the block has not started (its canvas is drawn on its first
    denoising step, after the encoder has cached everything before it).
    """

    settings: DiffusionSettings
    # Tokens per block.
    canvas_length: int
    # Draws the start canvas, the candidates and the renoising: seeded from
    # SamplingParams.seed, so a request repeats whatever runs beside it.
    generator: torch.Generator
    # [C] the canvas the next pass reads (accepted tokens + fresh noise).
    canvas: torch.Tensor | None = None
    # [C] argmax of the latest pass: what the block commits.
    argmax: torch.Tensor | None = None
    # [C, hidden] self-conditioning input (probability-weighted embeddings); None: zeros.
    soft: torch.Tensor | None = None
    # Denoising steps left in this block (N .. 1; the temperature schedule's step).
    step: int = 0
    # The last ``stability_threshold`` argmax canvases (the stable test).
    history: list[torch.Tensor] = field(default_factory=list)
    # Totals over the request: decoder passes and blocks committed.
    num_passes: int = 0
    num_blocks: int = 0

    @property
    def in_block(self) -> bool:
        return self.canvas is not None

    def start_block(self, vocab_size: int, pad_token_id: int, device: torch.device) -> None:
        """Draw (or pad) the block's first canvas and reset the step loop."""
        c = self.canvas_length
        if self.settings.start_canvas == "pad":
            self.canvas = torch.full((c,), pad_token_id, dtype=torch.int64, device=device)
        else:
            self.canvas = torch.randint(0, vocab_size, (c,), generator=self.generator,
                                        device=device)
        self.argmax = self.canvas
        self.soft = None
        self.step = self.settings.max_denoising_steps
        self.history = []

    def end_block(self) -> list[int]:
        """The block's committed ids (the argmax canvas); the next block starts fresh."""
        assert self.argmax is not None
        ids = self.argmax.tolist()
        self.canvas = self.argmax = self.soft = None
        self.history = []
        self.num_blocks += 1
        return ids
