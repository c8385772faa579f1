"""The layout cache (lora/layout_cache.py): tensors round-trip through their file; an adapter that host memory
dropped is written there and read back from it, without its directory being read or checked again, with the same
tokens as transformers + peft; an adapter changed on disk is read afresh; the files stay within their bound;
shutdown removes them."""

from __future__ import annotations

import os
import shutil

import torch

from hpi_runtime.llm import LLM
from hpi_runtime.lora import layers
from hpi_runtime.lora.layout_cache import LayoutCache, directory_key
from hpi_runtime.lora.peft_dir import CONFIG_FILE, WEIGHTS_FILE
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.sampling_params import SamplingParams
from hpi_testing.lora_adapters import reference_greedy


def test_tensors_round_trip_through_their_file(tmp_path) -> None:
    (tmp_path / CONFIG_FILE).write_text("{}")
    (tmp_path / WEIGHTS_FILE).write_bytes(b"x")
    key = directory_key(str(tmp_path))
    generator = torch.Generator().manual_seed(0)
    # Mixed dtypes and odd sizes: each tensor starts aligned in the file, so every view is legal.
    stored = {(0, "qkv"): (torch.randn(3, 5, generator=generator).bfloat16(), torch.randn(3, 7, generator=generator)),
              (1, "o"): (torch.randn(2, 4, generator=generator).bfloat16(),)}  # fmt: skip
    cache = LayoutCache()
    assert cache.get(key) is None
    cache.put(key, stored)
    got = cache.get(key)
    assert list(got) == list(stored)
    for name, group in stored.items():
        assert [(t.dtype, t.shape) for t in got[name]] == [(t.dtype, t.shape) for t in group]
        assert all(torch.equal(g, t) for g, t in zip(got[name], group, strict=True))
    directory = cache._dir
    assert directory is not None and any(directory.iterdir())
    os.utime(tmp_path / WEIGHTS_FILE, ns=(1, 1))  # the adapter changed on disk: another key
    assert directory_key(str(tmp_path)) != key and cache.get(directory_key(str(tmp_path))) is None
    assert directory_key(str(tmp_path / "missing")) is None
    cache.close()
    assert not directory.exists() and cache.get(key) is None


def test_the_files_stay_within_their_bound_least_recently_used_first(tmp_path) -> None:
    keys = [("adapter", i) for i in range(4)]
    one = {"x": (torch.ones(64, 64),)}  # 16 KiB
    cache = LayoutCache(max_bytes=40 << 10)  # two of them
    cache.put(keys[0], one)
    cache.put(keys[1], one)
    assert cache.get(keys[0]) is not None  # keys[0] used last: keys[1] goes first
    cache.put(keys[2], one)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None and cache.get(keys[2]) is not None
    assert len(list(cache._dir.iterdir())) == 2
    cache.put(keys[3], {"x": (torch.ones(128, 128),)})  # 64 KiB: larger than the bound, not stored
    assert cache.get(keys[3]) is None and cache.get(keys[0]) is not None
    cache.close()


def test_an_evicted_adapter_is_read_back_from_its_layout(tiny_model_dir, adapters, tmp_path, monkeypatch) -> None:
    copies = {name: shutil.copytree(adapters[name], tmp_path / name) for name in ("all", "attn")}
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(copies.items())}
    checked = []
    read_adapter = layers.read_adapter
    monkeypatch.setattr(layers, "read_adapter", lambda path, *rest: checked.append(os.path.basename(path))
                        or read_adapter(path, *rest))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with LLM(str(tiny_model_dir), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, dtype="float32",
             enforce_eager=True) as llm:  # fmt: skip
        prompt = llm.tokenizer("The capital of France is").input_ids
        # One slot and one host copy: each adapter evicts the other from host memory.
        runs = [(name, llm.generate([prompt], params, lora_request=loras[name])[0]) for name in
                ("all", "attn", "all", "attn")]  # fmt: skip
        assert checked == ["all", "attn"]  # read and checked once each; then read back from their layouts
        assert llm.engine.get_stats().lora_host_evictions >= 3
        for name, output in runs:
            assert list(output.output_token_ids) == reference_greedy(tiny_model_dir, adapters[name], prompt, 4)[0]
        # "all"'s directory now holds the MLP adapter: read and checked afresh, and its tokens are the MLP one's.
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            shutil.copy(adapters["mlp"] / file, copies["all"] / file)
        changed = llm.generate([prompt], params, lora_request=loras["all"])[0]
        assert checked == ["all", "attn", "all"]
        assert list(changed.output_token_ids) == reference_greedy(tiny_model_dir, adapters["mlp"], prompt, 4)[0]
        layouts = llm.engine.executor.runner.lora._layouts._dir
        assert layouts is not None and any(layouts.iterdir())
    assert not layouts.exists()  # removed at shutdown
