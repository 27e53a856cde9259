"""Drafter math every kind shares, no vLLM imports: config base and target shape (config.py),
layers, rotary embeddings (rope.py), masks, the KV cache, a draft vocabulary's logits over the
whole vocabulary (draft_logits.py), and presets sizing each kind for a target (presets.py).

The kinds themselves live in vllm_moa.drafters. Nothing is re-exported here: presets.py imports
each kind's config, which imports config.py here, so a re-export would make an import cycle.
"""
