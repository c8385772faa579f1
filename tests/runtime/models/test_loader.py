"""The safetensors loader: shards with and without an index, merged qkv / gate_up, clear errors, which
weight files count (and are fetched), the progress bar."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hpi_kernels.cpu import packed_weight_rows
from hpi_runtime import cpu_features
from hpi_runtime.attention.torch_backend import TorchAttentionBackend
from hpi_runtime.evaluation.perplexity import perplexity
from hpi_runtime.models import cpu_layout, loader
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.cpu_layout import pack_cpu_weights, use_sgemm_layout
from hpi_runtime.models.linear import LinearBase
from hpi_runtime.models.loader import load_model, safetensors_files, weight_file_patterns
from hpi_runtime.quantization.quantize import QuantizationConfig, quantize_model

CPU = torch.device("cpu")


def _load(model_dir: Path, dtype: torch.dtype = torch.float32):
    return load_model(load_model_config(model_dir), dtype, CPU, TorchAttentionBackend(dtype))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, tiny_model_factory) -> Path:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("qwen2", tie_word_embeddings=False)
    out = tmp_path_factory.mktemp("sharded")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.save_pretrained(out, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((model_dir / name).read_bytes())
    return out


def _reference(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _check_matches(model, reference: dict[str, torch.Tensor]) -> None:
    layer = model.model.layers[1]
    attn = "model.layers.1.self_attn"
    expected_qkv = torch.cat([reference[f"{attn}.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, expected_qkv, rtol=0, atol=0)
    expected_bias = torch.cat([reference[f"{attn}.{p}_proj.bias"] for p in "qkv"])
    torch.testing.assert_close(layer.self_attn.qkv_proj.bias, expected_bias, rtol=0, atol=0)
    mlp = "model.layers.1.mlp"
    expected_gate_up = torch.cat([reference[f"{mlp}.gate_proj.weight"], reference[f"{mlp}.up_proj.weight"]])
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, expected_gate_up, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, reference["lm_head.weight"], rtol=0, atol=0)


def test_sharded_checkpoint_with_and_without_index(sharded_dir: Path) -> None:
    assert len(list(sharded_dir.glob("*.safetensors"))) > 2
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    reference = _reference(sharded_dir)
    _check_matches(_load(sharded_dir), reference)
    (sharded_dir / "model.safetensors.index.json").unlink()
    _check_matches(_load(sharded_dir), reference)


def test_tied_embeddings_share_storage_and_bf16_loads(tiny_model_dir: Path) -> None:
    model = _load(tiny_model_dir, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_missing_and_unexpected_tensors_are_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(tiny_model_dir / "model.safetensors")
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    without_v = {k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.v_proj.weight"}
    save_file(without_v, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensors.*qkv_proj\.weight:v"):
        _load(tmp_path)
    save_file({**tensors, "model.layers.0.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.0.extra.weight' has no matching parameter"):
        _load(tmp_path)


def test_progress_bar_reaches_its_total(sharded_dir: Path, monkeypatch, capsys) -> None:
    finished: list[tuple[int, int]] = []

    class RecordingBar(loader.tqdm):
        def close(self) -> None:
            if not self.disable:  # a second close (from __del__) finds it disabled
                finished.append((self.n, self.total))
            super().close()

    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(loader, "tqdm", RecordingBar)
    _load(sharded_dir)
    tensor_bytes = sum(t.numel() * t.element_size() for t in _reference(sharded_dir).values())
    assert finished == [(tensor_bytes, tensor_bytes)]
    assert "loading weights" in capsys.readouterr().err


MISTRAL_LIKE_REPO = [
    "config.json",
    "params.json",
    "consolidated.safetensors",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
]


def _selected(patterns: list[str], repo_files: list[str]) -> list[str]:
    return [f for f in repo_files if any(fnmatch(f, pattern) for pattern in patterns)]


def test_weight_file_patterns_skip_unlisted_copies() -> None:
    index = {"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}}
    patterns = weight_file_patterns(index)
    assert patterns == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert _selected(patterns, MISTRAL_LIKE_REPO) == patterns
    unindexed = ["consolidated.safetensors", "model.safetensors", "adapter.safetensors", "config.json"]
    assert _selected(weight_file_patterns(None), unindexed) == ["model.safetensors"]
    with pytest.raises(ValueError, match="empty weight_map"):
        weight_file_patterns({"weight_map": {}})


def test_unindexed_directory_ignores_a_consolidated_copy(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, tmp_path / "consolidated.safetensors")
    assert safetensors_files(tmp_path) == [tmp_path / "model.safetensors"]
    _load(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")  # any name, when it is the only one
    (tmp_path / "consolidated.safetensors").unlink()
    assert safetensors_files(tmp_path) == [tmp_path / "weights.safetensors"]


def test_sgemm_layout_moves_fp32_cpu_linears_only(sharded_dir: Path, tiny_model_dir: Path) -> None:
    """use_sgemm_layout re-stores each fp32 CPU linear weight column-major: the same logical [out, in]
    values (the checkpoint's, exactly) and the same model outputs; bf16 weights and int8-quantized layers
    stay as they are."""
    model = _load(sharded_dir)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    tokens = [3, 17, 5, 9, 40, 2, 11]
    before = perplexity(model, TorchAttentionBackend(torch.float32), tokens)
    assert use_sgemm_layout(model) == len(linears) == 8
    for linear in linears:
        out_features = linear.weight.shape[0]
        assert linear.weight.stride() == (1, out_features) and linear.weight.t().is_contiguous()
    _check_matches(model, _reference(sharded_dir))
    assert perplexity(model, TorchAttentionBackend(torch.float32), tokens) == pytest.approx(before, rel=1e-5)
    assert use_sgemm_layout(model) == 0  # already there

    bf16 = _load(tiny_model_dir, torch.bfloat16)
    assert use_sgemm_layout(bf16) == 0
    assert all(m.weight.is_contiguous() for m in bf16.modules() if isinstance(m, LinearBase))
    int8 = quantize_model(_load(tiny_model_dir), QuantizationConfig(method="int8"))
    assert use_sgemm_layout(int8) == 0  # every linear is quantized: their packed weights stay as they are


def test_pack_cpu_weights_packs_fp32_linears_and_the_lm_head(sharded_dir: Path, tiny_model_dir: Path) -> None:
    """pack_cpu_weights replaces each fp32 CPU linear weight and the LM head by the C++ kernel's panels:
    the checkpoint's values exactly, read back from the panels, and the same model outputs."""
    model = _load(sharded_dir)  # untied: the LM head has its own matrix
    reference = _reference(sharded_dir)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    out_features = [m.weight.shape[0] for m in linears]
    tokens = [3, 17, 5, 9, 40, 2, 11]
    before = perplexity(model, TorchAttentionBackend(torch.float32), tokens)
    assert pack_cpu_weights(model) == len(linears) + 1 == 9
    assert [m.packed_out_features for m in linears] == out_features
    assert model.lm_head.packed and not model.model.embed_tokens.packed
    qkv = model.model.layers[1].self_attn.qkv_proj
    expected_qkv = torch.cat([reference[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    hidden = model.config.hidden_size
    assert torch.equal(packed_weight_rows(qkv.weight, torch.arange(qkv.packed_out_features), hidden), expected_qkv)
    vocab_size = model.config.vocab_size
    assert torch.equal(packed_weight_rows(model.lm_head.weight, torch.arange(vocab_size), hidden),
                       reference["lm_head.weight"])  # fmt: skip
    assert perplexity(model, TorchAttentionBackend(torch.float32), tokens) == pytest.approx(before, rel=1e-5)
    assert pack_cpu_weights(model) == use_sgemm_layout(model) == 0  # packed already; nothing left to re-lay

    int8 = quantize_model(_load(tiny_model_dir), QuantizationConfig(method="int8"))
    assert pack_cpu_weights(int8) == 1  # the float LM head only: quantized layers keep their own format


def test_an_fp32_model_keeps_a_bf16_checkpoints_weights_in_bf16_panels(tiny_model_factory, monkeypatch) -> None:
    """An fp32 model from a bf16 checkpoint (dtype "auto" on a CPU without fast bf16) holds only bf16 values, so
    pack_cpu_weights packs them as bf16 panels, half the bytes, and the model computes exactly what fp32 panels
    give (the widen tile: the same products in the same order); the tied embedding reads its rows from those
    panels widened back to fp32. Weights with values bf16 cannot hold keep fp32 panels."""
    model_dir = tiny_model_factory("llama", dtype="bfloat16")  # tied embeddings
    tokens = [3, 17, 5, 9, 40, 2, 11]
    unpacked = _load(model_dir)
    reference = perplexity(unpacked, TorchAttentionBackend(torch.float32), tokens)
    half = _load(model_dir)
    assert pack_cpu_weights(half) == 9  # 2 layers x (qkv, o, gate_up, down) + the LM head
    linears = [m for m in half.modules() if isinstance(m, LinearBase)]
    assert {m.weight.dtype for m in linears} == {half.lm_head.weight.dtype} == {torch.bfloat16}
    embed = half.model.embed_tokens
    assert embed.packed and embed.weight is half.lm_head.weight
    ids = torch.tensor([[0, 5, 63], [7, 7, 1]])
    assert torch.equal(embed(ids), unpacked.model.embed_tokens(ids))  # fp32 rows, the checkpoint's values
    with monkeypatch.context() as patch:
        patch.setattr(cpu_layout, "_panel_weight", lambda weight: weight)  # fp32 panels, as before
        full = _load(model_dir)
        pack_cpu_weights(full)
    assert full.lm_head.weight.dtype == torch.float32
    bytes_ = [sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, LinearBase))
              for model in (half, full)]  # fmt: skip
    assert bytes_[0] * 2 == bytes_[1]
    packed = perplexity(half, TorchAttentionBackend(torch.float32), tokens)
    assert packed == perplexity(full, TorchAttentionBackend(torch.float32), tokens)
    assert packed == pytest.approx(reference, rel=1e-5)
    with torch.no_grad():  # one value off a bf16 one: that weight stays fp32
        unpacked.model.layers[0].mlp.down_proj.weight[0, 0] += 2**-20
    pack_cpu_weights(unpacked)
    assert unpacked.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert unpacked.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16


def test_packed_o_proj_and_down_proj_add_the_residual_stream(tiny_model_factory, monkeypatch) -> None:
    """The decoder hands each layer's residual stream to o_proj and down_proj (the packed op adds it, in the GEMM's
    fp32 sums on the prefill path) and to no other linear; the outputs are what adding it after gives."""
    from hpi_runtime.models import decoder

    model_dir = tiny_model_factory("llama")
    tokens = [(7 * i) % 300 + 3 for i in range(400)]  # 400 rows: the prefill path's GEMM (above the tiles' 320)
    got_residual: dict[str, bool] = {}
    forward = LinearBase.forward

    def spy(self, x, residual=None):
        got_residual[names[id(self)]] = residual is not None
        return forward(self, x, residual)

    folded = _load(model_dir)
    assert pack_cpu_weights(folded) == 9
    names = {id(m): name for name, m in folded.named_modules() if isinstance(m, LinearBase)}
    with monkeypatch.context() as patch:
        patch.setattr(LinearBase, "forward", spy)
        with_fold = perplexity(folded, TorchAttentionBackend(torch.float32), tokens)
    folds = {n for n in names.values() if n.endswith(("o_proj", "down_proj"))}
    assert {n for n, r in got_residual.items() if r} == folds
    assert len(got_residual) == len(names) == 8
    with monkeypatch.context() as patch:  # the add after the linear, as without the packed op
        patch.setattr(decoder.DecoderAttention, "adds_residual", False)
        patch.setattr(decoder.GatedMLP, "adds_residual", False)
        unfolded = _load(model_dir)
        pack_cpu_weights(unfolded)
        assert perplexity(unfolded, TorchAttentionBackend(torch.float32), tokens) == pytest.approx(with_fold, rel=1e-5)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_quantized_load_holds_one_float_layer_at_a_time(tiny_model_factory, arch: str) -> None:
    """With quantization at load (the executor's path), each decoder layer is read and quantized before the next
    one has storage: when a layer is handed over, the layers before it are quantized and those after it are still
    on the meta device. The result is what quantizing the whole float model gives, tensor for tensor."""
    model_dir = tiny_model_factory(arch)
    config = load_model_config(model_dir)
    quantization = QuantizationConfig(method="int8")
    handed: list[tuple[str | None, set[str], set[str]]] = []

    def after_layer(model, layer: str | None) -> None:
        float_layers, meta_layers = set(), set()
        for name, param in model.named_parameters():
            group = loader._group_of(name)
            if group is not None and param.is_meta:
                meta_layers.add(group)
            elif group is not None and name.endswith(("proj.weight", "w13.weight", "w2.weight")) and param.numel():
                float_layers.add(group)
        handed.append((layer, float_layers, meta_layers))
        quantize_model(model, quantization, layer)

    streamed = load_model(config, torch.float32, CPU, TorchAttentionBackend(torch.float32), after_layer=after_layer)
    layers = [f"model.layers.{i}" for i in range(config.num_layers)]
    assert [h[0] for h in handed] == [*layers, None]
    for i, (layer, float_layers, meta_layers) in enumerate(handed[:-1]):
        assert float_layers == {layer} and meta_layers == set(layers[i + 1:]), (layer, float_layers, meta_layers)
    assert handed[-1][1:] == (set(), set())
    whole = quantize_model(_load(model_dir), quantization)
    got, expected = streamed.state_dict(), whole.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    tokens = [3, 17, 5, 9, 40, 2, 11]
    assert perplexity(streamed, TorchAttentionBackend(torch.float32), tokens) == perplexity(
        whole, TorchAttentionBackend(torch.float32), tokens)


def test_pack_cpu_weights_packs_bf16_unless_onednn_runs_them(sharded_dir: Path, monkeypatch) -> None:
    """bf16 weights pack too (the checkpoint's values rounded to bf16, read back exactly from the pairs), and
    the model's outputs agree with oneDNN's bf16 GEMMs over the unpacked weights; on a CPU with AMX (flags
    substituted: this machine may have none) they stay as loaded, for oneDNN's AMX GEMMs, unless the packed
    linear's AMX tile was chosen (which needs a real AMX CPU: that half runs only there)."""
    from hpi_kernels.cpu import bf16_tile

    reference = _reference(sharded_dir)
    tokens = [3, 17, 5, 9, 40, 2, 11]
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    previous = bf16_tile()
    try:
        bf16_tile("widen")
        amx = _load(sharded_dir, torch.bfloat16)
        assert pack_cpu_weights(amx) == 0
        try:
            bf16_tile("amx")
        except ValueError:
            pass  # no AMX on this machine
        else:
            assert pack_cpu_weights(_load(sharded_dir, torch.bfloat16)) == 9
    finally:
        bf16_tile(previous)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    model = _load(sharded_dir, torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert pack_cpu_weights(model) == len(linears) + 1 == 9
    assert model.lm_head.packed and all(m.weight.dtype == torch.bfloat16 for m in linears)
    down = model.model.layers[0].mlp.down_proj
    expected = reference["model.layers.0.mlp.down_proj.weight"].bfloat16()
    assert torch.equal(packed_weight_rows(down.weight, torch.arange(down.packed_out_features), expected.shape[1]),
                       expected)  # fmt: skip
    # fp32 sums rounded once against oneDNN's: the same to well within bf16's own error
    packed_ppl = perplexity(model, TorchAttentionBackend(torch.bfloat16), tokens)
    assert packed_ppl == pytest.approx(perplexity(amx, TorchAttentionBackend(torch.bfloat16), tokens), rel=2e-2)


def test_tied_bf16_embedding_reads_the_packed_lm_head(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    model = _load(tiny_model_dir, torch.bfloat16)
    embed = model.model.embed_tokens
    ids = torch.tensor([0, 5, model.config.vocab_size - 1, 5])
    rows = embed(ids)
    assert pack_cpu_weights(model) > 0
    assert model.lm_head.weight is embed.weight and embed.packed and embed.weight.dim() == 4
    assert torch.equal(embed(ids), rows)


def test_tied_embedding_reads_the_packed_lm_head(tiny_model_dir: Path) -> None:
    model = _load(tiny_model_dir)
    embed = model.model.embed_tokens
    ids = torch.tensor([0, 5, model.config.vocab_size - 1, 5])
    rows = embed(ids)
    tokens = [3, 17, 5, 9, 40, 2, 11]
    before = perplexity(model, TorchAttentionBackend(torch.float32), tokens)
    assert pack_cpu_weights(model) > 0
    assert model.lm_head.weight is embed.weight and embed.packed and embed.weight.dim() == 3
    assert torch.equal(embed(ids), rows)
    assert perplexity(model, TorchAttentionBackend(torch.float32), tokens) == pytest.approx(before, rel=1e-5)


def test_without_the_cpu_kernels_weights_stay_for_use_sgemm_layout(tiny_model_dir: Path, monkeypatch) -> None:
    # A machine without a C++ toolchain cannot be made here once the kernels are loaded: the availability
    # check is replaced (test_cpu_attention runs the real missing-compiler case in a child process).
    monkeypatch.setattr(cpu_layout, "cpu_kernels_available", lambda: False)
    model = _load(tiny_model_dir)
    assert pack_cpu_weights(model) == pack_cpu_weights(_load(tiny_model_dir, torch.bfloat16)) == 0
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert all(m.weight.dim() == 2 and m.packed_out_features is None for m in linears)
    assert use_sgemm_layout(model) > 0


def test_bf16_gemms_are_chosen_and_logged_at_start(caplog) -> None:
    """A bf16 CPU model settles its packed tile and its prefill GEMM at start-up and says which; overrides are
    honoured; other dtypes leave them alone."""
    from hpi_kernels.cpu import bf16_tile, prefill_attention_tile, prefill_gemm

    previous = {"tile": bf16_tile(), "prefill": prefill_gemm(), "attention": prefill_attention_tile()}
    try:
        with caplog.at_level("INFO", logger="hpi_runtime.models.cpu_layout"):
            assert cpu_layout.choose_bf16_gemms(torch.bfloat16) == previous
        assert f"the {previous['tile']} tile up to prefill size" in caplog.text
        assert f"prefill in {previous['prefill']}" in caplog.text
        assert f"prefill attention on {previous['attention']} tiles" in caplog.text
        assert cpu_layout.choose_bf16_gemms(torch.float32) is None
        for forced in ("fp32", "bf16"):
            prefill_gemm(forced)
            assert cpu_layout.choose_bf16_gemms(torch.bfloat16)["prefill"] == forced
        bf16_tile("widen")
        assert cpu_layout.choose_bf16_gemms(torch.bfloat16)["tile"] == "widen"
        prefill_attention_tile("vector")
        assert cpu_layout.choose_bf16_gemms(torch.bfloat16)["attention"] == "vector"
    finally:
        prefill_gemm(previous["prefill"])
        bf16_tile(previous["tile"])
        prefill_attention_tile(previous["attention"])
