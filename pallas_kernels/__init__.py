"""Paged-attention kernels (Pallas) and their pure-jnp reference."""
