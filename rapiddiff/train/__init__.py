"""Training: LightningModules and LightningCLI entries (clip, vae, unet, finetune, upscaler)."""
