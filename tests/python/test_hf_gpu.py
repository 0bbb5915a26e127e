"""Hugging Face transformers backend "tessera" vs "sdpa" on a small random-init Llama (GPU).
Skipped (with the reason) without torch, transformers >= 4.48, a CUDA device or a CUDA build."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import tessera  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to PyTorch", allow_module_level=True)
if tessera.cuda_device_count() == 0:
    pytest.skip("libtessera has no CUDA backend or sees no device", allow_module_level=True)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import tessera.integrations.transformers as tessera_hf  # noqa: E402
from _hf import set_attention  # noqa: E402

try:
    tessera_hf.register()
except ImportError as error:
    pytest.skip(f"transformers too old: {error}", allow_module_level=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                         max_position_embeddings=4096, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def logits(model, name, input_ids, attention_mask=None):
    set_attention(model, name)
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.float()


def assert_close_bf16(actual, expected):
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= 2e-2 * scale + 2e-3, f"max |diff| {diff} vs max |logit| {scale}"


def test_logits_match_sdpa(model):
    input_ids = torch.randint(0, 1000, (2, 300), device="cuda")
    assert_close_bf16(logits(model, "tessera", input_ids), logits(model, "sdpa", input_ids))


def test_logits_match_sdpa_with_left_padding(model):
    input_ids = torch.randint(0, 1000, (2, 48), device="cuda")
    mask = torch.ones_like(input_ids)
    mask[1, :13] = 0  # left padding of the second sequence
    ours = logits(model, "tessera", input_ids, mask)
    reference = logits(model, "sdpa", input_ids, mask)
    assert_close_bf16(ours[0], reference[0])
    assert_close_bf16(ours[1, 13:], reference[1, 13:])


def test_greedy_generate_identical(model):
    input_ids = torch.randint(0, 1000, (2, 32), device="cuda")
    runs = {}
    for name in ("sdpa", "tessera"):
        set_attention(model, name)
        with torch.no_grad():
            runs[name] = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                        max_new_tokens=8, do_sample=False, output_scores=True,
                                        return_dict_in_generate=True, pad_token_id=0)
    ours, reference = runs["tessera"].sequences, runs["sdpa"].sequences
    if torch.equal(ours, reference):
        return
    # A difference is only acceptable at a near tie of the reference's own logits (bf16 noise
    # between two kernels can flip an argmax there); anything else is a real mismatch.
    for step, scores in enumerate(runs["sdpa"].scores):
        column = input_ids.shape[1] + step
        for row in range(ours.shape[0]):
            if ours[row, column] != reference[row, column]:
                chosen = scores[row, ours[row, column]].item()
                best = scores[row].max().item()
                assert best - chosen <= 2e-2 * scores[row].abs().max().item(), (
                    f"token {step} of row {row} differs: {ours[row].tolist()} vs "
                    f"{reference[row].tolist()}")
                return  # the continuations legitimately diverge after a tie


def test_arbitrary_mask_is_rejected(model):
    layer = model.model.layers[0].self_attn
    query = torch.randn(1, 8, 4, 64, dtype=torch.bfloat16, device="cuda")
    key = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16, device="cuda")
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bfloat16, device="cuda")
    mask[0, 0, 3, 1] = torch.finfo(torch.bfloat16).min  # a hole: not causal + padding
    with pytest.raises(ValueError, match="attention_mask"):
        tessera_hf.tessera_attention_forward(layer, query, key, key, mask, scaling=0.125)
