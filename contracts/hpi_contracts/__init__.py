"""What the runtime, the router and the operator must agree on, stated once: metric names, the `hpi serve`
flags the operator emits, allowed block sizes, the KV-cache bytes formula. Dependency-free, so the operator
image (no torch) and the router image import it as the runtime does."""
