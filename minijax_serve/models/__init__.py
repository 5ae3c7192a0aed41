"""Models: the decoder family, its config, weight loading and aliases."""
