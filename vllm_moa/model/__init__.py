"""Drafter math every kind shares, no vLLM imports: config base and target shape (config.py,
target_info.py), layers (layers.py, packed_linear.py), rotary embeddings (rope.py), masks, the
KV cache, and a draft vocabulary's logits over the whole vocabulary (draft_logits.py).

The kinds themselves live in vllm_moa.drafters (with the presets sizing each kind for a target,
drafters/presets.py). Nothing is re-exported here.
"""
