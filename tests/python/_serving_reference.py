"""The serving tests' reference: the same numpy Llama model with dense attention and no Tessera.

Every generated token recomputes the whole sequence: RoPE from Hugging Face's formulas (with
Llama 3.1 scaling), a causal mask over all positions, GQA by repeating the kv heads, in float64.
"""

from __future__ import annotations

import math
from typing import List, Sequence

import numpy as np

from tessera.serving import LlamaModel
from tessera.serving.model import LlamaConfig


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim / 2]`` (HF's default and ``_compute_llama3_parameters``)."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return np.where(medium, smoothed, scaled)


def rotate(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """NeoX/Llama RoPE (``rotate_half``) of ``x`` ``[T, H, D]``."""
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, D/2]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def dense_attention(model: LlamaModel):
    """attention(layer, q, k, v) over one whole sequence at positions 0..T-1."""
    cfg = model.config
    inv_freq = rope_inv_freq(cfg)
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def attention(layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        del layer
        tokens = q.shape[0]
        positions = np.arange(tokens)
        q = rotate(q.astype(np.float64), positions, inv_freq)
        k = np.repeat(rotate(k.astype(np.float64), positions, inv_freq), group, axis=1)
        v = np.repeat(v.astype(np.float64), group, axis=1)
        scores = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(cfg.head_dim)
        causal = np.tril(np.ones((tokens, tokens), bool))
        scores = np.where(causal[None], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        return np.einsum("hij,jhd->ihd", weights, v).astype(model.dtype)

    return attention


def reference_generate(model: LlamaModel, prompt: Sequence[int], max_new_tokens: int,
                       eos_token_id=None) -> List[int]:
    """Greedy tokens, recomputing the full sequence for each."""
    attention = dense_attention(model)
    tokens = list(prompt)
    output: List[int] = []
    while len(output) < max_new_tokens:
        logits = model.forward(np.asarray(tokens), attention, np.asarray([len(tokens) - 1]))
        token = int(np.argmax(logits[0]))
        output.append(token)
        tokens.append(token)
        if token == eos_token_id:
            break
    return output
