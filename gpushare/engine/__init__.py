"""The shared continuous-batching engine: scheduler, paged KV cache, sampling."""
