"""The model runner and what it owns: the paged KV cache, the block table, memory profiling."""
