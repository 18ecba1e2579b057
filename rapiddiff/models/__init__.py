"""Models: the knowledge text encoder, the image tower, the model folder, the upscaler."""
