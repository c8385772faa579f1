"""The worker side of the engine: the model runner, the sampler and the executor that owns them."""
