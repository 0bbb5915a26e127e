"""What the Hugging Face model tests share (test_hf_gpu.py, test_hf_gpt_oss.py)."""

from __future__ import annotations


def set_attention(model, name: str) -> None:
    """Switches a loaded model's attention implementation (any transformers >= 4.48)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
