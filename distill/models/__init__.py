"""Models: resolve and load a target or drafter (shipped, GGUF, folder, tiny), the reduced-vocabulary head, GGUF writing."""
