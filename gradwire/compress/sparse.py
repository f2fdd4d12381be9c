"""Sparsifiers (placeholder until written)."""
