"""Attention as a model's layers call it (:class:`PagedAttention`, :class:`DenseAttention`) and the
backends that run it."""
