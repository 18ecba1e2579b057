"""kshapes: the procedurally generated Chinese benchmark (DESIGN.md, "kshapes").

- :func:`generate_kshapes` writes images, captions, the KG and evaluation prompts;
- :func:`detect_attributes` reads colour, shape, background and position back off an image
  (how generated images are scored).
"""

from rapiddiff.data.kshapes.detect import detect_attributes
from rapiddiff.data.kshapes.entities import (
    ENTITIES,
    Entity,
    choose_heldout,
    choose_validation,
    kg_aliases,
    kg_triples,
)
from rapiddiff.data.kshapes.generate import SMALL_PRESET, KShapesConfig, generate_kshapes
from rapiddiff.data.kshapes.palette import BACKGROUNDS, COLOURS, LAYOUTS, SHAPES
from rapiddiff.data.kshapes.render import ShapeSpec, render, render_mask

__all__ = [
    "BACKGROUNDS",
    "COLOURS",
    "ENTITIES",
    "LAYOUTS",
    "SHAPES",
    "SMALL_PRESET",
    "Entity",
    "KShapesConfig",
    "ShapeSpec",
    "choose_heldout",
    "choose_validation",
    "detect_attributes",
    "generate_kshapes",
    "kg_aliases",
    "kg_triples",
    "render",
    "render_mask",
]
