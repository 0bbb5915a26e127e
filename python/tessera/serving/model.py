"""A Llama-architecture decoder over an array namespace (numpy on the CPU, torch on a GPU).

The weights are a dict with Hugging Face's state-dict names and layouts
(``model.embed_tokens.weight`` ``[vocab, hidden]``, ``model.layers.{i}.self_attn.q_proj.weight``
``[out, in]``, ..., ``model.norm.weight``, ``lm_head.weight``), so a ``LlamaForCausalLM``'s
``state_dict()`` loads as is (:func:`weights_from_state_dict`) and :func:`random_llama_weights`
makes the same dict from a config without any download.

The model does everything but attention: embedding, RMSNorm, the q/k/v/o projections, the SwiGLU
MLP and the LM head, all with the framework's matmul. Attention (RoPE, the KV cache and the
attention itself) is a callable the caller passes to :meth:`LlamaModel.forward`: the serving
engine's goes through Tessera (:mod:`.engine`), the tests' reference is dense numpy.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

import numpy as np

Array = Any  # numpy.ndarray or torch.Tensor
# attention(layer, q [T, num_heads, head_dim], k, v [T, num_kv_heads, head_dim]) -> o like q;
# q and k are not rotated yet (RoPE belongs to the attention).
AttentionFn = Callable[[int, Array, Array, Array], Array]

# Small configs by name (Hugging Face LlamaConfig field names). "tiny" is what CI runs on the CPU.
CONFIGS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=256,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
    "small": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, num_hidden_layers=4, vocab_size=4096,
                  rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, num_hidden_layers=32,
                      vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0,
                                        original_max_position_embeddings=8192)),
}


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of Hugging Face's ``LlamaConfig`` this model reads."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # Llama 3.1 rope scaling (rope_scaling.rope_type == "llama3"); None = plain RoPE.
    rope_scaling: Optional[Dict[str, Any]] = None

    @staticmethod
    def from_dict(config: Mapping[str, Any]) -> "LlamaConfig":
        """From a dict of LlamaConfig field names (``head_dim`` defaults to hidden_size /
        num_attention_heads; ``num_key_value_heads`` to num_attention_heads)."""
        missing = [name for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                                     "num_hidden_layers", "vocab_size") if name not in config]
        if missing:
            raise ValueError(f"'config': missing {', '.join(missing)}")
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"'config': num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        scaling = config.get("rope_scaling")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"'config': rope_scaling type {kind!r} is not supported "
                                 "(only 'llama3' or none)")
        return LlamaConfig(int(config["hidden_size"]), int(config["intermediate_size"]), heads,
                           kv_heads, int(config["num_hidden_layers"]),
                           int(config["vocab_size"]), head_dim,
                           float(config.get("rms_norm_eps", 1e-5)),
                           float(config.get("rope_theta", 10000.0)),
                           bool(config.get("tie_word_embeddings", False)),
                           None if scaling is None else dict(scaling))


def random_llama_weights(config: Mapping[str, Any], seed: int = 0, dtype: Any = np.float32,
                         init_std: float = 0.02, device: Optional[str] = None
                         ) -> Dict[str, Array]:
    """Random weights with Hugging Face's names and layouts: normal(0, ``init_std``) matrices
    (LlamaConfig's ``initializer_range`` is 0.02), norms at 1. ``lm_head.weight`` is left out
    when ``tie_word_embeddings`` is set (HF's state_dict of a tied model has it equal to the
    embedding). numpy arrays of ``dtype``; with ``device`` (e.g. "cuda") torch tensors made
    there, ``dtype`` then a torch dtype (no host copy of a large model).

    With the default 0.02 a small model's logits are nearly uniform (top-2 gaps of ~0.04), so
    float rounding can flip a greedy choice between two runs that batch differently; the tests
    use ``init_std=0.5`` (gaps of ~1)."""
    cfg = LlamaConfig.from_dict(config)
    if device is None:
        rng = np.random.default_rng(seed)

        def matrix(rows: int, cols: int) -> Array:
            return (rng.standard_normal((rows, cols), np.float32) * init_std).astype(dtype)

        def ones(size: int) -> Array:
            return np.ones(size, dtype)
    else:
        import torch

        generator = torch.Generator(device=device).manual_seed(seed)

        def matrix(rows: int, cols: int) -> Array:
            return (torch.randn(rows, cols, generator=generator, device=device) *
                    init_std).to(dtype)

        def ones(size: int) -> Array:
            return torch.ones(size, dtype=dtype, device=device)

    h, d = cfg.hidden_size, cfg.head_dim
    weights = {"model.embed_tokens.weight": matrix(cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = matrix(cfg.num_attention_heads * d, h)
        weights[p + "self_attn.k_proj.weight"] = matrix(cfg.num_key_value_heads * d, h)
        weights[p + "self_attn.v_proj.weight"] = matrix(cfg.num_key_value_heads * d, h)
        weights[p + "self_attn.o_proj.weight"] = matrix(h, cfg.num_attention_heads * d)
        weights[p + "mlp.gate_proj.weight"] = matrix(cfg.intermediate_size, h)
        weights[p + "mlp.up_proj.weight"] = matrix(cfg.intermediate_size, h)
        weights[p + "mlp.down_proj.weight"] = matrix(h, cfg.intermediate_size)
        weights[p + "input_layernorm.weight"] = ones(h)
        weights[p + "post_attention_layernorm.weight"] = ones(h)
    weights["model.norm.weight"] = ones(h)
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = matrix(cfg.vocab_size, h)
    return weights


def to_torch(weights: Mapping[str, np.ndarray], device: str = "cuda",
             dtype: Any = None) -> Dict[str, Any]:
    """The numpy weights as torch tensors on ``device`` (``dtype``: e.g. torch.bfloat16)."""
    import torch

    return {name: torch.from_numpy(np.ascontiguousarray(w)).to(device=device, dtype=dtype)
            for name, w in weights.items()}


def weights_from_state_dict(state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """The weights of a transformers ``LlamaForCausalLM``'s ``state_dict()`` (tensors kept
    where they are; rotary buffers dropped)."""
    return {name: tensor.detach() for name, tensor in state_dict.items()
            if not name.endswith("rotary_emb.inv_freq")}


class _Ops:
    """The few non-GEMM operations the model needs, for numpy or torch arrays."""

    def __init__(self, like: Array) -> None:
        self.torch = sys.modules.get("torch") if not isinstance(like, np.ndarray) else None

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        # Like HF's LlamaRMSNorm: in float32, then back to the input's dtype, times the weight.
        if self.torch is not None:
            x32 = x.float()
            x32 = x32 * self.torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            return weight * x32.to(x.dtype)
        x32 = x.astype(np.float32)
        x32 = x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return weight * x32.astype(x.dtype)

    def silu(self, x: Array) -> Array:
        if self.torch is not None:
            return self.torch.nn.functional.silu(x)
        # x * sigmoid(x), with sigmoid(x) = (1 + tanh(x / 2)) / 2: no overflow of exp(-x).
        return x * (0.5 + 0.5 * np.tanh(0.5 * x))

    def argmax(self, logits: Array) -> Array:
        if self.torch is not None:
            return self.torch.argmax(logits, dim=-1)
        return np.argmax(logits, axis=-1)


class LlamaModel:
    """A Llama-architecture decoder over HF-named weights (numpy arrays or torch tensors).

    ``forward(token_ids, attention, logit_rows)`` runs a flat batch of tokens (several requests'
    chunks concatenated; the attention callable knows which token belongs to which request)
    and returns the logits of the rows in ``logit_rows`` only (the last token of each request
    that samples this step), so the LM head costs one row per sampled token.
    """

    def __init__(self, config: Mapping[str, Any], weights: Mapping[str, Array]) -> None:
        self.config = LlamaConfig.from_dict(config)
        cfg = self.config
        missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight")
                   if n not in weights]
        if missing:
            raise ValueError(f"'weights': missing {', '.join(missing)}")
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.lm_head = weights.get("lm_head.weight")
        if self.lm_head is None:
            if not cfg.tie_word_embeddings:
                raise ValueError("'weights': missing lm_head.weight (tie_word_embeddings is off)")
            self.lm_head = self.embed
        self.ops = _Ops(self.embed)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            try:
                layer = {name: weights[p + name] for name in (
                    "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                    "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                    "input_layernorm.weight", "post_attention_layernorm.weight")}
            except KeyError as error:
                raise ValueError(f"'weights': missing {error.args[0]}") from None
            expected = (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
            if tuple(layer["self_attn.q_proj.weight"].shape) != expected:
                raise ValueError(f"'weights': {p}self_attn.q_proj.weight has shape "
                                 f"{tuple(layer['self_attn.q_proj.weight'].shape)}, the config "
                                 f"says {expected}")
            # x @ W.T with W [out, in]: keep the transposed views once (no copy).
            self.layers.append({name: (w.T if w.ndim == 2 else w) for name, w in layer.items()})

    @property
    def dtype(self) -> Any:
        return self.embed.dtype

    @property
    def is_torch(self) -> bool:
        return self.ops.torch is not None

    # The three pieces of a step, separately callable so a CUDA graph can capture the parts
    # between two attentions (:mod:`.graphs`).

    def embed_tokens(self, token_ids: Array) -> Array:
        """``[T]`` int -> hidden ``[T, hidden_size]``."""
        return self.embed[token_ids]

    def qkv(self, layer: int, hidden: Array):
        """The attention inputs of ``layer``: ``(q [T, H, D], k [T, H_kv, D], v)``, not rotated."""
        cfg, w = self.config, self.layers[layer]
        x = self.ops.rms_norm(hidden, w["input_layernorm.weight"], cfg.rms_norm_eps)
        tokens = hidden.shape[0]
        q = (x @ w["self_attn.q_proj.weight"]).reshape(tokens, cfg.num_attention_heads,
                                                       cfg.head_dim)
        k = (x @ w["self_attn.k_proj.weight"]).reshape(tokens, cfg.num_key_value_heads,
                                                       cfg.head_dim)
        v = (x @ w["self_attn.v_proj.weight"]).reshape(tokens, cfg.num_key_value_heads,
                                                       cfg.head_dim)
        return q, k, v

    def after_attention(self, layer: int, hidden: Array, attn: Array) -> Array:
        """o_proj + residual, then the SwiGLU MLP + residual: the next layer's hidden."""
        cfg, w = self.config, self.layers[layer]
        hidden = hidden + attn.reshape(attn.shape[0], -1) @ w["self_attn.o_proj.weight"]
        x = self.ops.rms_norm(hidden, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = self.ops.silu(x @ w["mlp.gate_proj.weight"])
        return hidden + (gate * (x @ w["mlp.up_proj.weight"])) @ w["mlp.down_proj.weight"]

    def logits(self, hidden: Array) -> Array:
        """Final norm and LM head: ``[R, hidden]`` -> ``[R, vocab]`` (float32)."""
        x = self.ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        out = x @ self.lm_head.T
        return out.float() if self.is_torch else out.astype(np.float32, copy=False)

    def forward(self, token_ids: Array, attention: AttentionFn, logit_rows: Array) -> Array:
        """Logits ``[len(logit_rows), vocab]`` of a flat batch of tokens."""
        hidden = self.embed_tokens(token_ids)
        for layer in range(self.config.num_hidden_layers):
            q, k, v = self.qkv(layer, hidden)
            hidden = self.after_attention(layer, hidden, attention(layer, q, k, v))
        return self.logits(hidden[logit_rows])

    def greedy(self, logits: Array) -> Array:
        """Greedy sampling: the argmax token of each row."""
        return self.ops.argmax(logits)

