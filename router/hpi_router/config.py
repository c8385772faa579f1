"""The router's settings: one frozen tree that the CLI fills and everything else reads."""

from __future__ import annotations

from dataclasses import dataclass, field

STRATEGIES = ("load", "round-robin")


@dataclass(frozen=True)
class PolicySettings:
    """How a backend is picked (see policy.py and docs/router.md)."""

    # "load": the load- and speed-aware score with prefix affinity; "round-robin": turns in order, blind to
    # load (what a plain Service does, per request): a baseline and a fallback.
    strategy: str = "load"
    # Characters of the rendered prompt hashed for prefix affinity; 0 turns affinity off.
    affinity_prefix_chars: int = 256
    # Bounded load: an affinity target takes a request only while its load stays under this factor times its
    # capacity-weighted fair share of the fleet's load (Mirrokni et al.'s 1 + epsilon). 1.5 rather than the
    # classic 1.25: a prefix-cache hit saves a whole prefill, and at the few requests in flight per replica of
    # LLM serving the bound's rounding spills a shared prefix onto a second replica early (docs/router.md).
    affinity_load_factor: float = 1.5
    # KV-cache usage above which a backend's score is inflated (preemptions start near a full cache).
    kv_usage_soft_limit: float = 0.8

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown routing strategy {self.strategy!r} (choose from {', '.join(STRATEGIES)})")
        if self.affinity_prefix_chars < 0:
            raise ValueError(f"affinity prefix chars must be >= 0, got {self.affinity_prefix_chars}")
        if self.affinity_load_factor < 1.0:
            raise ValueError(f"affinity load factor must be >= 1, got {self.affinity_load_factor}")
        if not 0.0 < self.kv_usage_soft_limit <= 1.0:
            raise ValueError(f"kv usage soft limit must be in (0, 1], got {self.kv_usage_soft_limit}")


@dataclass(frozen=True)
class QueueSettings:
    """The router's request queue (queue.py): how many requests may wait for a backend, and for how long."""

    # 0 turns the queue off: with no backend to take it, a request gets a 503 at once.
    max_queued: int = 1024
    # Longer than a cold start (scheduling, image, weights, warm-up: one to three minutes for an 8B model on a GPU,
    # more when a node must be provisioned first), so a request that arrives at zero replicas is served.
    max_wait_s: float = 300.0
    # Hold requests while every ready backend already has at least this many waiting in its engine (by its last
    # scrape, plus what this router sent it since); 0: only while no backend is ready.
    saturated_waiting: int = 0
    # Slots of each backend's max_num_seqs (from its pool profile) that only urgent bands (priority < 0) may fill:
    # requests of the default band and less urgent ones wait here once a backend is that close to full, so an
    # urgent request finds a free slot instead of waiting for one to end. 0: no reservation.
    reserved_slots: int = 0

    def __post_init__(self) -> None:
        if self.max_queued < 0:
            raise ValueError(f"queue max requests must be >= 0, got {self.max_queued}")
        if not self.max_wait_s > 0:
            raise ValueError(f"queue timeout must be > 0 seconds, got {self.max_wait_s}")
        if self.saturated_waiting < 0:
            raise ValueError(f"queue saturated-waiting must be >= 0, got {self.saturated_waiting}")
        if self.reserved_slots < 0:
            raise ValueError(f"queue reserved-slots must be >= 0, got {self.reserved_slots}")


@dataclass(frozen=True)
class DiscoverySettings:
    """Backends from the EndpointSlices of a (headless) Service."""

    service: str
    namespace: str
    port_name: str | None = None  # the EndpointSlice port to use; None: the first one


@dataclass(frozen=True)
class RouterSettings:
    backend_urls: tuple[str, ...] = ()
    discovery: DiscoverySettings | None = None
    policy: PolicySettings = field(default_factory=PolicySettings)
    queue: QueueSettings = field(default_factory=QueueSettings)
    # API keys and tenants (tenants.py); None: the router checks no key, the backends check the client's.
    tenants_file: str | None = None
    # Router replicas behind the Service: each enforces its share of every tenant's limits (tenants.Limits.share).
    num_replicas: int = 1
    # What the router presents to the backends when it checks tenants' keys itself (the pods' $HPI_API_KEY).
    backend_api_key: str | None = field(default=None, repr=False)
    scrape_interval_s: float = 0.25
    probe_interval_s: float = 1.0
    scrape_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    max_attempts: int = 3  # per request: the first try plus retries on other backends, before the first byte
    max_request_body_bytes: int = 4 * 2**20
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.backend_urls and self.discovery is None:
            raise ValueError("no backends: give --backend URL (repeatable) or --discover-service NAME")
        for url in self.backend_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://, got {url!r}")
        if self.scrape_interval_s <= 0 or self.probe_interval_s <= 0:
            raise ValueError("scrape and probe intervals must be positive")
        if self.num_replicas < 1:
            raise ValueError(f"router replicas must be at least 1, got {self.num_replicas}")
        if self.max_attempts < 1:
            raise ValueError(f"max attempts must be at least 1, got {self.max_attempts}")
