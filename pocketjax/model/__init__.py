"""The model layer: config, checkpoint reading, layers, the functional decoder, KV cache, quantization, sharding."""
