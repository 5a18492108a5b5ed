"""Drafters: build one from a base model (sibling, depth-pruned, LoRA-wrapped) and the checks before training it."""
