"""ModelSleeper on a toy model: each storage freed once (tied weights share one), the same tensor objects kept,
a rebuilt model of another layout refused by name; on CUDA (marker gpu) level 1's host copy and the device
memory actually given back. The served round trip is tests/runtime/server/test_sleep.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hpi_runtime.worker.sleep import ModelSleeper, model_storage_bytes


class Toy(nn.Module):
    """Tied embedding and head, a buffer, and one attention layer's KV cache: what sleep looks at."""

    def __init__(self, device: str = "cpu", vocab: int = 64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, 16, device=device)
        self.head = nn.Linear(16, vocab, bias=False, device=device)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(16, device=device))
        shape = (4, 16, 2, 8)
        self.attn = SimpleNamespace(k_cache=torch.rand(shape, device=device), v_cache=torch.rand(shape, device=device))

    def attention_layers(self) -> list:
        return [self.attn]


def _values(model: Toy) -> list[torch.Tensor]:
    return [t.clone() for t in (*model.parameters(), *model.buffers())]


def test_level_2_frees_each_storage_once_and_restores_the_rebuilt_weights() -> None:
    model = Toy()
    weights = _values(model)
    objects = [id(t) for t in (*model.parameters(), *model.buffers(), model.attn.k_cache)]
    weight_bytes, kv_bytes = model_storage_bytes(model)
    assert weight_bytes == (64 * 16 + 16) * 4  # the tied head adds nothing
    sleeper = ModelSleeper(model, lambda: Toy())
    assert sleeper.sleep(2) == weight_bytes + kv_bytes
    assert model_storage_bytes(model) == (0, 0)
    assert sleeper.wake_up() == weight_bytes + kv_bytes
    assert [id(t) for t in (*model.parameters(), *model.buffers(), model.attn.k_cache)] == objects
    assert all(torch.equal(a, b) for a, b in zip(_values(model), weights, strict=True))
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()  # still one storage
    assert not model.attn.k_cache.any()  # the KV cache comes back zeroed, as allocated at start-up


def test_level_1_on_cpu_keeps_the_weights() -> None:
    model = Toy()
    weight_bytes, kv_bytes = model_storage_bytes(model)
    sleeper = ModelSleeper(model, lambda: pytest.fail("level 1 never rebuilds"))
    assert sleeper.sleep(1) == kv_bytes
    assert model_storage_bytes(model) == (weight_bytes, 0)
    assert sleeper.wake_up() == kv_bytes


def test_a_rebuilt_model_of_another_layout_is_refused_by_name() -> None:
    model = Toy()
    sleeper = ModelSleeper(model, lambda: Toy(vocab=32))
    sleeper.sleep(2)
    with pytest.raises(RuntimeError, match="embed.weight"):
        sleeper.wake_up()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("level", [1, 2])
def test_on_cuda_the_device_memory_is_given_back_and_restored(level: int) -> None:
    model = Toy("cuda")
    weights = _values(model)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    sleeper = ModelSleeper(model, lambda: Toy("cuda"))
    freed = sleeper.sleep(level)
    assert freed == sum(model_storage_bytes(Toy("cuda")))  # level 1 too: the weights wait in host memory
    assert torch.cuda.memory_allocated() <= allocated - freed
    assert sleeper.wake_up() == freed
    assert all(torch.equal(a, b) for a, b in zip(_values(model), weights, strict=True))
