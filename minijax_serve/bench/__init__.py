"""Benchmarks behind ``minijax-serve bench``: datasets, the timed driver, metrics, reports,
``--compare``, plots and the HuggingFace baseline."""
