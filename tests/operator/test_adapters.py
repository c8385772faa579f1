"""spec.adapters as pure functions: the spec's rules, the pods' flags and volume, the ConfigMap a starting pod
loads, what a running pod must load and unload, and status.adapters (tests/operator/test_adapters_kmock.py runs
them under the real operator)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hpi_operator.adapter_spec import AdapterSpec
from hpi_operator.adapters import (
    AVAILABLE,
    DOWNLOADING,
    Download,
    adapters_status,
    build_adapters_configmap,
    download_of,
    loaded_adapters,
    pod_changes,
    wanted_on,
)
from hpi_operator.cache import JobState
from hpi_operator.children import PRUNED_KINDS
from hpi_operator.manifests import Owner, engine_args, runtime_args, selector_labels
from hpi_operator.profiles import Profile
from hpi_operator.spec import SpecError, parse_spec

HF_MODEL = {"source": "huggingface", "huggingface": {"id": "o/base"}, "cache": {"enabled": True}}
PVC_MODEL = {"source": "pvc", "pvc": {"claimName": "weights"}}
SQL = {"name": "sql", "source": {"huggingface": {"id": "acme/sql-lora", "revision": "v2"}}}
CHAT = {"name": "chat", "source": {"path": "/adapters/chat/"}, "pools": ["cpu-bf16"]}


def spec_with(adapters: list[dict[str, Any]], model: dict[str, Any] = HF_MODEL, **extra: Any):
    return parse_spec({"model": model, "adapters": adapters, **extra})


@pytest.mark.parametrize(("model", "adapters", "extra", "message"), [
    (HF_MODEL, [SQL, {**CHAT, "name": "sql"}], {}, "the name 'sql' is given twice"),
    (HF_MODEL, [{"name": "x", "source": {"path": "a", "huggingface": {"id": "a/b"}}}], {}, "exactly one of"),
    (HF_MODEL, [{"name": "x", "source": {}}], {}, "exactly one of"),
    (HF_MODEL, [{"name": "x", "source": {"path": "../etc"}}], {}, "inside the volume"),
    (HF_MODEL, [{"name": "x", "source": {"huggingface": {"id": "no-org"}}}], {}, "like org/name"),
    (HF_MODEL, [{"name": "-x", "source": {"path": "a"}}], {}, r"spec.adapters\[0\].name"),
    (PVC_MODEL, [SQL], {}, "downloaded onto the model cache"),
    ({}, [CHAT], {}, "model source embedded has none"),
    (HF_MODEL, [SQL], {"apiKeySecretRef": {"name": "k"}}, "cannot be used with spec.apiKeySecretRef"),
    ({**HF_MODEL, "servedName": "sql"}, [SQL], {}, "the base model's served name"),
])  # fmt: skip
def test_the_spec_refuses_adapters_it_cannot_serve_naming_the_field(model, adapters, extra, message) -> None:
    with pytest.raises(SpecError, match=message):
        spec_with(adapters, model, **extra)


def test_sources_parse_to_their_directories_in_the_pods() -> None:
    spec = spec_with([SQL, CHAT])
    assert spec.adapters == (AdapterSpec("sql", hf_id="acme/sql-lora", hf_revision="v2"),
                             AdapterSpec("chat", path="adapters/chat", pools=("cpu-bf16",)))  # fmt: skip
    downloads = {"sql": Download(AVAILABLE), "chat": Download(AVAILABLE)}
    assert wanted_on(spec, "cpu-bf16", downloads) == {"sql": "/model-cache/adapters/acme/sql-lora/v2",
                                                      "chat": "/model-cache/adapters/chat"}  # fmt: skip
    assert wanted_on(spec, "gpu-l4", downloads) == {"sql": "/model-cache/adapters/acme/sql-lora/v2"}  # not its pool
    assert wanted_on(spec, "cpu-bf16", {"chat": Download(AVAILABLE)}) == {"chat": "/model-cache/adapters/chat"}
    assert wanted_on(spec_with([CHAT], PVC_MODEL), "cpu-bf16", downloads) == {"chat": "/models/adapters/chat"}


def test_pods_get_the_lora_flags_only_with_adapters_and_profiling_never() -> None:
    profile = Profile("cpu", "bf16", "none", num_gpus=0, weight_bytes=1 << 28, kv_cache_bytes=1 << 30,
                      overhead_bytes=1 << 28, memory_budget_bytes=1 << 31)  # fmt: skip
    plain = runtime_args("demo", parse_spec({"model": HF_MODEL}), profile)
    assert not {"--enable-lora", "--lora-modules", "--max-loras"} & set(plain)
    args = runtime_args("demo", spec_with([SQL, CHAT], engine={"maxLoras": 2}), profile)
    assert "--enable-lora" in args and args[args.index("--lora-modules") + 1] == "@/etc/hpi/adapters/lora-modules.json"
    assert args[args.index("--max-loras") + 1] == "2" and args[args.index("--max-lora-rank") + 1] == "16"
    assert args[args.index("--max-cpu-loras") + 1] == "2"  # as many as the spec lists, at least maxLoras
    assert args[args.index("--lora-dtype") + 1] == "auto"
    bf16_slots = runtime_args("demo", spec_with([SQL], engine={"loraDtype": "bfloat16"}), profile)
    assert bf16_slots[bf16_slots.index("--lora-dtype") + 1] == "bfloat16"
    assert "--enable-lora" not in engine_args("demo", spec_with([SQL]), profile)  # a pool is measured without
    with pytest.raises(SpecError, match="loraDtype must be one of"):  # float16 is not every pool's to run
        spec_with([SQL], engine={"loraDtype": "float16"})


def test_the_configmap_lists_each_pools_available_adapters_and_escapes_the_prune() -> None:
    spec = spec_with([SQL, CHAT])
    downloads = {"sql": Download(DOWNLOADING), "chat": Download(AVAILABLE)}
    configmap = build_adapters_configmap(Owner("demo", "ml"), spec, "o/base", ["cpu-bf16", "gpu-l4"], downloads)
    assert configmap["metadata"]["name"] == "demo-adapters"
    data = {key: json.loads(value) for key, value in configmap["data"].items()}
    chat = {"name": "chat", "path": "/model-cache/adapters/chat", "base_model_name": "o/base"}
    assert data == {"cpu-bf16.json": [chat], "gpu-l4.json": []}
    # ConfigMaps are pruned by the reconciler when they carry the selector label and the plan lacks them: this one
    # follows the downloads, which the plan does not know, so it must not carry it.
    assert "ConfigMap" in PRUNED_KINDS
    assert not set(selector_labels("demo")) & set(configmap["metadata"]["labels"])


def test_a_pod_unloads_what_it_should_not_have_and_loads_what_it_lacks() -> None:
    models = {"object": "list", "data": [
        {"id": "o/base", "root": "/m"},  # the base: no parent, never unloaded
        {"id": "old", "root": "/a/old", "parent": "o/base"},
        {"id": "moved", "root": "/a/v1", "parent": "o/base"},
        {"id": "kept", "root": "/a/kept", "parent": "o/base"}]}  # fmt: skip
    loaded = loaded_adapters(models)
    assert loaded == {"old": "/a/old", "moved": "/a/v1", "kept": "/a/kept"}
    changes = pod_changes({"kept": "/a/kept", "moved": "/a/v2", "new": "/a/new"}, loaded)
    assert changes.unload == ("moved", "old") and changes.load == (("moved", "/a/v2"), ("new", "/a/new"))
    assert not pod_changes({"kept": "/a/kept"}, {"kept": "/a/kept"})
    with pytest.raises(ValueError, match="not a model list"):
        loaded_adapters({"error": "nope"})


def test_status_says_where_each_adapter_stands() -> None:
    spec = spec_with([SQL, CHAT])
    failed = JobState("demo-adapter-1", "Failed", 2, 4, "2026-01-01T00:00:00Z", "BackoffLimitExceeded")
    downloads = {"sql": download_of(spec.adapters[0], failed), "chat": Download(AVAILABLE)}
    entries = {e["name"]: e for e in adapters_status(spec, downloads, {"chat": 3}, {"chat": 2})}
    assert entries["sql"]["phase"] == "Failed" and "attempt 2 failed: BackoffLimitExceeded" in entries["sql"]["message"]
    assert entries["sql"]["source"] == "huggingface:acme/sql-lora@v2"
    assert (entries["chat"]["phase"], entries["chat"]["loadedPods"], entries["chat"]["wantedPods"]) == ("Partial", 2, 3)
    done = adapters_status(spec, downloads, {"chat": 3}, {"chat": 3})
    assert done[1]["phase"] == "Loaded" and done[1]["message"] == "loaded on 3 of 3 ready pod(s)"
