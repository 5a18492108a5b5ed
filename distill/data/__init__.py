"""Data: prompt sources and their split, generated datasets, and the training examples built from them."""
