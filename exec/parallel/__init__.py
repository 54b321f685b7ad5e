"""Parallel wrappers applied from outside the model: tensor parallelism and data-parallel buckets."""
