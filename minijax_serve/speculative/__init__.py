"""Speculative decoding (docs/speculative.md): proposers (n-gram lookup, a draft model, the
simulator's), a verify step's sampling rows, the rejection sampler, and the Speculator that
the engine's tick calls. Imports the executor, the models and the scheduler; the engine imports
it."""
