import pytest
import torch
from conftest import make_hf_model

from vllm_moa.hf_target import HFTarget, check_supported

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
# fp32 tiny models: cached vs full-sequence forwards differ only by summation order (~1e-6).
TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_passes_equal_hf_full_forward(arch):
    model = make_hf_model(arch)
    target = HFTarget(model)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids[None], output_hidden_states=True)
    outs = [
        target.forward(ids[:9], hidden_layers=(0, 2, 3)),
        target.forward(ids[9:10]),
        target.forward(ids[10:]),
    ]
    torch.testing.assert_close(torch.cat([o.logits for o in outs]), ref.logits[0], **TOL)
    for layer in (0, 2, 3):  # inputs of layers 0 and 2, and the final normalised output
        torch.testing.assert_close(
            outs[0].hidden_states[layer], ref.hidden_states[layer][0, :9], **TOL
        )
    # layer_kv is HF's post-RoPE cache, per layer [k_h0 | v_h0 | k_h1 | v_h1 ...].
    kv = torch.cat([o.layer_kv for o in outs])  # [T, L, 2*E_kv]
    cache = ref.past_key_values
    for layer in range(3):
        k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [Hkv, T, D]
        expected = torch.stack([k, v], dim=2).permute(1, 0, 2, 3).flatten(1)
        # A sliding-window HF cache (mistral) keeps only the last rows.
        torch.testing.assert_close(kv[-expected.shape[0] :, layer], expected, **TOL)


def test_crop_then_recompute_is_exact(llama_target):
    t = llama_target
    ids = torch.arange(20) % 256
    t.reset()
    full = t.forward(ids).logits
    t.reset()
    t.forward(ids[:12])
    t.forward(torch.tensor([5, 6, 7]))  # rejected continuation
    t.crop(12)
    assert t.seq_len == 12
    torch.testing.assert_close(t.forward(ids[12:]).logits, full[12:], **TOL)


def test_tail_layers_reproduce_the_target(llama_target):
    t = llama_target
    ids = torch.arange(1, 15)
    t.reset()
    ref = t.forward(ids, hidden_layers=(1, 2, 3))
    for n in (1, 2):
        t.reset()
        t.forward(ids[:-1])
        # Feeding the true input of the last n layers gives the true final state.
        last = t.shape.num_layers - n
        out = t.run_tail_layers(ref.hidden_states[last][-1:], torch.tensor([13]), n)
        torch.testing.assert_close(out, ref.hidden_states[3][-1:], **TOL)
        assert t.cache.length(last) == 14 and t.cache.length(0) == 13
        t.crop(13)
        assert all(t.cache.length(i) == 13 for i in range(3))


def test_context_limit_is_a_clear_error():
    t = HFTarget(make_hf_model(max_positions=16))
    with pytest.raises(ValueError, match="exceeds the target's context of 16"):
        t.forward(torch.zeros(17, dtype=torch.long))


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=1, vocab_size=50))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: llama"):
        check_supported(model)


def test_missing_module_is_named():
    model = make_hf_model()
    del model.model.rotary_emb
    with pytest.raises(ValueError, match=r"has no `model\.rotary_emb`"):
        HFTarget(model)
