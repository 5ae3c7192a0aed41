"""A simulated accelerator: the real engine and scheduler, driven by a roofline cost model of a
device instead of the device (``EngineConfig.simulate``; docs/parallel_and_simulator.md,
"Simulated accelerator").

Modules: ``profiles`` (what a device can do, as data), ``cost_model`` (a step's time on it),
``runner`` (the stand-in for the model runner, on a virtual clock; the engine builds the
model's config and the KV pool without loading weights in ``engine/simulated.py``); and its
calibration:
``calibration`` (a profile fitted to measured steps, step times read from a trace),
``recorded_run`` (a real run kept as data, replayed on the simulator).
"""
