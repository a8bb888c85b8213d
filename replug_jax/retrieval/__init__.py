"""Retrieval (paper §3.1): corpora and chunking, batched encoding, FAISS indexes."""
