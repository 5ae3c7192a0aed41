"""Execution: bucketed shapes, ForwardBatch lowering, the model runner and the sampler."""
