"""Evaluation: FID, CLIP score, retrieval recall, knowledge accuracy, reports."""
