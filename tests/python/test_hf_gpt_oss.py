"""Hugging Face backend "tessera" on a tiny random-weight gpt-oss (attention sinks, alternating
sliding-window and full layers) against attn_implementation="eager", on the CPU. gpt-oss's
eager attention concatenates each head's sink logit (``s_aux``, the module's ``sinks``) to the
scaled logits before the softmax and drops that column after it: Tessera's sinks, in the same
units. Skipped without torch or a transformers that has gpt_oss."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
try:
    from transformers import GptOssConfig, GptOssForCausalLM
except ImportError:
    pytest.skip("this transformers has no gpt_oss", allow_module_level=True)

import tessera.integrations.transformers as tessera_hf  # noqa: E402
from _hf import set_attention  # noqa: E402

try:
    tessera_hf.register()
except ImportError as error:
    pytest.skip(f"transformers too old: {error}", allow_module_level=True)

SLIDING_WINDOW = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = GptOssConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=500, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=SLIDING_WINDOW, max_position_embeddings=1024,
        layer_types=["sliding_attention", "full_attention"] * 2, attn_implementation="eager")
    model = GptOssForCausalLM(config).float().eval()
    with torch.no_grad():  # sinks of both signs, some dominating their rows
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(config.num_attention_heads) * 2.0)
    return model


def logits(model, name, input_ids, attention_mask=None):
    set_attention(model, name)
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask).logits


def test_logits_match_eager(model):
    input_ids = torch.randint(0, 500, (2, 3 * SLIDING_WINDOW + 5))
    torch.testing.assert_close(logits(model, "tessera", input_ids),
                               logits(model, "eager", input_ids), atol=2e-4, rtol=2e-4)


def test_logits_match_eager_with_left_padding(model):
    input_ids = torch.randint(0, 500, (2, 2 * SLIDING_WINDOW + 3))
    mask = torch.ones_like(input_ids)
    mask[1, :7] = 0  # request 1 is left-padded
    actual = logits(model, "tessera", input_ids, mask)
    expected = logits(model, "eager", input_ids, mask)
    torch.testing.assert_close(actual[:, 7:], expected[:, 7:], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(actual[0], expected[0], atol=2e-4, rtol=2e-4)


def test_sinks_matter(model):
    """The tessera logits change when the sinks change (s_aux reaches the kernels)."""
    input_ids = torch.randint(0, 500, (1, 20))
    before = logits(model, "tessera", input_ids)
    layer = model.model.layers[1].self_attn
    saved = layer.sinks.detach().clone()
    with torch.no_grad():
        layer.sinks.add_(3.0)
    try:
        after = logits(model, "tessera", input_ids)
        expected = logits(model, "eager", input_ids)
    finally:
        with torch.no_grad():
            layer.sinks.copy_(saved)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, atol=2e-4, rtol=2e-4)
