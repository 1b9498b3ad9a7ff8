"""Training the embedded model (optax loop, BPE tokenizer builder); not imported by `import pocketjax`."""
