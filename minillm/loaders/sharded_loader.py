"""Load one tensor-parallel rank's shard straight from a checkpoint, reading only the rows and columns it holds.

A rank builds its :class:`~minillm.model.llama_tp.TensorParallelLlamaForCausalLM` on the ``meta`` device from the
config alone (every weight has its shard's shape, no storage), allocates those shapes, then fills each from the
checkpoint through ``safetensors``' ``safe_open(...).get_slice``: query/KV heads' rows of ``q_proj``/``k_proj``/
``v_proj``, its columns of ``o_proj`` and ``down_proj``, its rows of ``gate_proj``/``up_proj``, its vocabulary rows
of the embedding (and LM head), the norms whole. Nothing of another rank's shard is materialized. A GGUF file is read
through its fp32 safetensors cache (:mod:`minillm.loaders.gguf_cache`), written on first use; with the cache off, each
rank dequantizes the file in memory and keeps only its slices. :func:`save_checkpoint` writes a model held in memory
(the tests' random tiny models) as such a checkpoint, for ranks to read.

vLLM counterpart: ``vllm/model_executor/model_loader/default_loader.py`` (``DefaultModelLoader.load_weights``) with
each parallel layer's ``weight_loader`` (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``), which narrow the full tensors that ``safetensors_weights_iterator`` yields.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch import nn

from minillm.config import LlamaConfig
from minillm.distributed.parallel_state import TensorParallelGroup
from minillm.model.layers import RotaryEmbedding
from minillm.model.llama import LlamaForCausalLM
from minillm.model.llama_tp import TensorParallelDecoderLayer, TensorParallelLlamaForCausalLM
from minillm.model.parallel_layers import shard_range

Span = tuple[int, int]


class WeightSource(Protocol):
    """Where a rank reads its slices from. ``bytes_read`` counts what it read (in the checkpoint's dtype)."""

    bytes_read: int

    def read(self, name: str, rows: Span | None = None, cols: Span | None = None) -> torch.Tensor:
        """Rows ``[a, b)`` or columns ``[a, b)`` (or all) of the tensor ``name``; only those are read."""
        ...


class SafetensorsSource:
    """The tensors of ``*.safetensors`` files, read slice by slice (``safe_open(...).get_slice``, memory-mapped)."""

    def __init__(self, files: Iterable[str | Path]) -> None:
        from safetensors import safe_open

        self.bytes_read = 0
        self._where: dict[str, Any] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                self._where[name] = handle

    def read(self, name: str, rows: Span | None = None, cols: Span | None = None) -> torch.Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        piece = handle.get_slice(name)
        t = piece[rows[0]:rows[1]] if rows else piece[:, cols[0]:cols[1]] if cols else piece[:]
        self.bytes_read += t.numel() * t.element_size()
        return t


class StateDictSource:
    """The tensors of a state dict already in memory (a GGUF file dequantized with the disk cache off)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.bytes_read = 0

    def read(self, name: str, rows: Span | None = None, cols: Span | None = None) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        t = self.state[name]
        t = t[rows[0]:rows[1]] if rows else t[:, cols[0]:cols[1]] if cols else t
        self.bytes_read += t.numel() * t.element_size()
        return t


def read_model_config(model: str | Path) -> LlamaConfig:
    """The :class:`LlamaConfig` of a checkpoint, without its weights: a directory's ``config.json``, or a GGUF file's
    metadata (from its cache entry when there is one)."""
    from minillm.loaders import gguf_cache
    from minillm.loaders.hf_loader import config_from_hf

    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (give a .gguf file or an HF directory)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face checkpoint directory")
        return config_from_hf(json.loads((path / "config.json").read_text()))
    entry = gguf_cache.entry_dir(path, "model")
    if entry is not None and (entry / "config.json").is_file():
        return LlamaConfig(**json.loads((entry / "config.json").read_text()))
    from gguf import GGUFReader

    from minillm.loaders.gguf_loader import read_gguf_config

    return read_gguf_config(GGUFReader(str(path)))


def open_checkpoint(model: str | Path) -> tuple[LlamaConfig, WeightSource]:
    """The config of a checkpoint and a :class:`WeightSource` over its weights (names as
    :class:`~minillm.model.llama.LlamaForCausalLM`'s). A GGUF file goes through its safetensors cache, converted here
    on first use."""
    from minillm.loaders import gguf_cache

    path = Path(model)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} has no *.safetensors files")
        return read_model_config(path), SafetensorsSource(files)
    if path.suffix != ".gguf":
        raise ValueError(f"model file {str(path)!r} is not a .gguf file")
    entry = gguf_cache.entry_dir(path, "model")
    if entry is None or not (entry / "model.safetensors").is_file():
        from minillm.loaders.gguf_loader import read_gguf_state

        config, state = read_gguf_state(path)
        gguf_cache.save_state(path, config, state)
        if entry is None or not (entry / "model.safetensors").is_file():  # the cache is off (or not writable)
            return config, StateDictSource(state)
        del state
    return read_model_config(path), SafetensorsSource([entry / "model.safetensors"])


def save_checkpoint(model: LlamaForCausalLM, directory: str | Path) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory: ``config.json`` (what
    :func:`~minillm.loaders.hf_loader.config_from_hf` reads back) and ``model.safetensors`` in the model's dtype (a
    tied LM head is not written twice). Returns the directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = model.config
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
          "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
          "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
          "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
          "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
          "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
          "eos_token_id": c.eos_token_id, "torch_dtype": str(model.dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(hf, indent=1))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (c.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(directory / "model.safetensors"))
    return directory


class TemporaryCheckpoint:
    """A model held in memory, written once to a temporary checkpoint directory for worker ranks to read their shards
    from; the directory is removed by :meth:`cleanup` (or when this object is collected, or at exit).

    Attributes:
        path: the directory (``config.json``, ``model.safetensors``).
    """

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.path = tempfile.mkdtemp(prefix="minillm-checkpoint-")
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)
        try:
            save_checkpoint(model, self.path)
        except BaseException:
            self.cleanup()
            raise

    def cleanup(self) -> None:
        """Remove the directory (idempotent)."""
        self._finalizer()


def load_tensor_parallel_model(model: str | Path, group: TensorParallelGroup | None = None, *,
                               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                               tp_rank: int | None = None, tp_size: int | None = None
                               ) -> tuple[TensorParallelLlamaForCausalLM, int]:
    """This rank's shard of the checkpoint ``model`` (a directory or a ``.gguf`` file), read slice by slice.

    Args:
        model: the checkpoint.
        group: the tensor-parallel group (its rank and size pick the shard); without one, ``tp_rank`` and
            ``tp_size`` do (as :class:`~minillm.model.llama_tp.TensorParallelLlamaForCausalLM` takes them).
        dtype, device: of the weights.

    Returns:
        ``(shard, bytes_read)``: the shard in eval mode, equal to ``TensorParallelLlamaForCausalLM(full model, ...)``,
        and the bytes this rank read from the checkpoint (its shard's, in the checkpoint's dtype).
    """
    config, source = open_checkpoint(model)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    # Built from the meta skeleton, every weight is a meta tensor of this rank's shape; the rest (RoPE) is real.
    shard = TensorParallelLlamaForCausalLM(skeleton, group, tp_rank=tp_rank, tp_size=tp_size)
    _materialize(shard, dtype, torch.device(device))
    with torch.no_grad():
        load_shard_weights(shard, source)
    return shard.eval(), source.bytes_read


def _materialize(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter real (uninitialized) storage of its shape; a tied parameter stays one."""
    new: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False)
            m._parameters[name] = new[id(p)]
    for m in module.modules():
        if isinstance(m, RotaryEmbedding) and m.inv_freq.device != device:
            m.inv_freq = m.inv_freq.to(device)


def load_shard_weights(shard: TensorParallelLlamaForCausalLM, source: WeightSource) -> None:
    """Fill every weight of ``shard`` (allocated, in its final dtype) with its slice of the checkpoint, as each
    parallel layer's ``__init__`` slices a full layer (vLLM: each layer's ``weight_loader``)."""
    def fill(param: torch.Tensor, pieces: list[torch.Tensor]) -> None:
        value = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        param.copy_(value.to(param.dtype))

    def vocab_rows(param: torch.Tensor, name: str, start: int, end: int) -> None:
        param.zero_()  # the last rank's padding rows (a vocabulary that does not split evenly)
        if end > start:
            param[: end - start].copy_(source.read(name, rows=(start, end)).to(param.dtype))

    emb = shard.model.embed_tokens
    vocab_rows(emb.weight, "model.embed_tokens.weight", emb.start, emb.end)
    for i, layer in enumerate(cast(Iterable[TensorParallelDecoderLayer], shard.model.layers)):
        p = f"model.layers.{i}."
        qkv = layer.self_attn.qkv_proj
        d = qkv.head_dim
        q_rows = (qkv.query_heads[0] * d, (qkv.query_heads[-1] + 1) * d)
        kv_rows = (qkv.kv_heads[0] * d, (qkv.kv_heads[-1] + 1) * d)
        fill(qkv.weight, [source.read(p + "self_attn.q_proj.weight", rows=q_rows),
                          source.read(p + "self_attn.k_proj.weight", rows=kv_rows),
                          source.read(p + "self_attn.v_proj.weight", rows=kv_rows)])
        o = layer.self_attn.o_proj
        fill(o.weight, [source.read(p + "self_attn.o_proj.weight", cols=(o.start, o.end))])
        gate_up = layer.mlp.gate_up_proj
        fill(gate_up.weight, [source.read(p + f"mlp.{name}.weight", rows=shard_range(
            size, gate_up.tp_rank, gate_up.tp_size, "intermediate_size"))
            for name, size in zip(("gate_proj", "up_proj"), gate_up.output_sizes, strict=True)])
        down = layer.mlp.down_proj
        fill(down.weight, [source.read(p + "mlp.down_proj.weight", cols=(down.start, down.end))])
        fill(layer.input_layernorm.weight, [source.read(p + "input_layernorm.weight")])
        fill(layer.post_attention_layernorm.weight, [source.read(p + "post_attention_layernorm.weight")])
    fill(shard.model.norm.weight, [source.read("model.norm.weight")])
    if not shard.config.tie_word_embeddings:  # tied: the LM head is the embedding's shard, filled above
        head = shard.lm_head
        vocab_rows(head.weight, "lm_head.weight", head.start, head.end)
    left = [name for name, p in shard.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"parameters left unloaded: {left[:5]}")
