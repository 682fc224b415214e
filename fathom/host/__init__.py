"""Host side of the offloaded decode step: pinned, mapped host memory and its lifetime,
growing segments of the bit-plane store and K/V rows, cuda-python streams and events.
"""
