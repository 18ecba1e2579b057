"""The knowledge-graph stage: triples I/O, TransE (pykeen), KnowledgeStore, EntityLinker."""
