"""safetorch's benchmarks: run ``python -m bench`` from the repository root."""
