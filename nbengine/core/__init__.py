"""The engine core: scheduler, paged KV cache, and the step loop."""
