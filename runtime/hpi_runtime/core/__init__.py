"""Engine core: requests, the block pool and KV cache manager, the scheduler and the engine loop."""
