"""Block diffusion (DiffusionGemma): per-request settings, state and the denoising sampler."""

from inference_engine.diffusion.sampler import denoise_step
from inference_engine.diffusion.settings import DIFFUSION_KEYS, DiffusionSettings
from inference_engine.diffusion.state import DiffusionState

__all__ = ["DIFFUSION_KEYS", "DiffusionSettings", "DiffusionState", "denoise_step"]
