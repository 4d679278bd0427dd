"""Tiny, really trained Stable-Diffusion-architecture model and LoRA zoo.

It exists so the LoRA manager has an offline default that runs on a CPU in
well under a second per image, and whose outputs can be checked by simple
pixel metrics (colours, shape class, style) instead of by eye.
"""
