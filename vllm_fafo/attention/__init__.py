"""Attention backend wrappers: real tokens go to vLLM's backend unchanged,
fumble-lane tail tokens attend to the compressed region (FAFO Sec. 4.4)."""
