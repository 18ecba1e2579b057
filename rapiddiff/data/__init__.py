"""The data stage: image–caption datasets, transforms, entity annotation, kshapes."""
