"""The engine layer: requests, slots, the jitted donating steps, the batched sampler, and the Engine."""
