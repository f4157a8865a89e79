"""Model residency, supervisor side: which models exist, which are loaded on which device, the
memory budget, LRU evictions, keep_alive and the warm tier. Runs on the daemon's event loop."""
