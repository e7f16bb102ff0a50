"""Loading a checkpoint: the model config, weight loading, GGUF conversion."""
