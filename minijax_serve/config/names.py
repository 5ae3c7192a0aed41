"""The names a configuration may choose from. The scheduler, the attention registry and the
simulator implement them; they live here so that configuration imports none of those."""

POLICY_NAMES = ("fcfs", "lpm", "dfs-weight", "lof", "random")  # scheduler/policy.py
RETRACT_POLICIES = ("length", "fcfs")  # scheduler/retract.py
ATTENTION_BACKENDS = ("auto", "xla", "pallas", "pallas_mgpu")  # attention/registry.py
SIMULATED_DEVICES = ("h200", "h100", "cpu")  # the profiles of simulate/profiles.py
SPECULATIVE_METHODS = ("ngram", "draft")  # speculative/
SIMULATED_HOST_TIMES = ("measured", "modeled")  # core/clock.py's VirtualClock(follow_wall=)
QUANTIZATIONS = (None, "fp8", "fp8_w8a8")  # models/quantize.py
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # attention/kv_cache.py
