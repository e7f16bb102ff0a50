"""Native kernels: `cpu` builds csrc/*.cpp for the machine it runs on (the GPU ones come with the GPU backends)."""
