"""Adapters that install gradwire through each framework's own extension points (optional extras):
`lightning`, `accelerate`, `hf_trainer` (the Hugging Face Trainer) and `torchtitan`. Each module
imports its framework; nothing else in gradwire imports these."""
