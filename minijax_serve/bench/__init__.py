"""Benchmarks behind ``minijax-serve bench``: datasets, metrics and the offline throughput run."""
