"""Shared types at the bottom of the package: requests and their states, sampling parameters, the
clock. Imports nothing else of the engine."""
