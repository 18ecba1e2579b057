"""The eval tests use the shared tiny-model fixtures of tests/conftest.py (tiny_model, tiny_pipe, knowledge_model)."""
