"""Mini SDXL and Flux pipelines built from config (no download): the real classes, block layouts and module names of
the GPU presets' base models, at widths small enough that a 32x32, 2-step image takes well under a second on a CPU.

A builder with the same seed gives the same random weights (drawn in float32 on the CPU, then moved and cast), so a
test or `gpu-check` can build a fresh pipeline for its plain-diffusers reference that matches the engine's exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
)

# The tiny preset's offline CLIP tokenizer (120 words, 12 tokens); the mini text encoders are sized to it.
TOKENIZER = Path(__file__).resolve().parents[1] / "presets" / "tiny" / "model" / "tokenizer"
VOCAB, MAX_TOKENS = 120, 12
WIDTH = 16  # hidden size of every mini text encoder

SDXL_GEN = {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 5.0}
# max_sequence_length: the T5 prompt is padded to it; FluxPipeline's default (512) would make T5 the bulk of the cost.
FLUX_GEN = {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 3.5, "max_sequence_length": 16}


def _clip_config(projection_dim: int = WIDTH) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=MAX_TOKENS,
        projection_dim=projection_dim,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def _vae(latent_channels: int, **kwargs) -> AutoencoderKL:
    """Two blocks: one downsample, so 32x32 images give 16x16 latents."""
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        mid_block_add_attention=False,
        **kwargs,
    )


def _ready(pipe, dtype: torch.dtype, device: str | torch.device):
    """Inference mode for every model (a model built from config starts in training mode), no progress bars, and
    the weights moved and cast only once drawn, so every dtype and device starts from the same values."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def mini_sdxl(
    seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> StableDiffusionXLPipeline:
    """SDXL's layout: DownBlock2D then two cross-attention blocks, 2 resnets a block, 1/1/2 transformer layers (the mid
    block takes the last), "text_time" added conditioning, CLIPTextModel + CLIPTextModelWithProjection."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(_clip_config())
        text_encoder_2 = CLIPTextModelWithProjection(_clip_config())
        unet = UNet2DConditionModel(
            sample_size=16,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(8, 16, 16),
            layers_per_block=2,
            transformer_layers_per_block=(1, 1, 2),
            attention_head_dim=(2, 2, 4),
            cross_attention_dim=2 * WIDTH,  # both encoders' hidden states, concatenated
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=4,
            projection_class_embeddings_input_dim=6 * 4 + WIDTH,  # six time ids, then the pooled projection
            norm_num_groups=4,
        )
        vae = _vae(latent_channels=4)
    tokenizer = CLIPTokenizer.from_pretrained(TOKENIZER)
    scheduler = EulerDiscreteScheduler(beta_schedule="scaled_linear", timestep_spacing="trailing")
    return _ready(
        StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=text_encoder,
            text_encoder_2=text_encoder_2,
            tokenizer=tokenizer,
            tokenizer_2=tokenizer,
            unet=unet,
            scheduler=scheduler,
            add_watermarker=False,
        ),
        dtype,
        device,
    )


def mini_flux(seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> FluxPipeline:
    """FLUX.1's layout: double-stream then single-stream blocks, guidance embedding, CLIP (pooled) + T5 (sequence).

    The T5 tokenizer is the CLIP one: FluxPipeline only needs ids below T5's vocabulary size from it.
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(_clip_config())
        text_encoder_2 = T5EncoderModel(
            T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=2 * WIDTH, num_layers=1, num_heads=2)
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 2x2-packed latents of 4 channels
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=WIDTH,
            pooled_projection_dim=WIDTH,
            guidance_embeds=True,
            axes_dims_rope=(2, 2, 4),
        )
        vae = _vae(latent_channels=4, shift_factor=0.1, scaling_factor=0.5)
    tokenizer = CLIPTokenizer.from_pretrained(TOKENIZER)
    return _ready(
        FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer,
            transformer=transformer,
        ),
        dtype,
        device,
    )
