"""Inference: RapidDiffusionPipeline, the fast path (accelerate), bench."""
