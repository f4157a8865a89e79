"""Node preparation: CPU topology and pinning, NVML, MPS and MIG."""
