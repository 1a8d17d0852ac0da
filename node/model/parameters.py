"""Closed-form parameter counts of the stages build_stage makes (node/model/llama.py), without torch.

Kept apart from llama.py so that what only sizes a swarm (presets, the memory estimate, `node
status`) can count parameters without importing torch; llama.py re-exports both functions and
tests/unit/test_presets.py checks them against modules built on the meta device.
"""

from __future__ import annotations

from node.config import ModelConfig

__all__ = ["block_layer_parameters", "count_parameters", "count_stage_parameters", "edge_parameters"]


def edge_parameters(model: ModelConfig) -> int:
    """Stage 0: the embedding, the final norm and the untied LM head."""
    return 2 * model.vocab_size * model.hidden_size + model.hidden_size


def block_layer_parameters(model: ModelConfig) -> int:
    """One decoder layer: q/o projections, grouped k/v projections, the SwiGLU MLP, two norms."""
    head_dim = model.hidden_size // model.num_attention_heads
    attention = 2 * model.hidden_size * model.num_attention_heads * head_dim
    attention += 2 * model.hidden_size * model.num_key_value_heads * head_dim
    return attention + 3 * model.hidden_size * model.intermediate_size + 2 * model.hidden_size


def count_stage_parameters(model: ModelConfig, stage: int) -> int:
    """Parameters held by one stage (equals sum(p.numel()) of build_stage)."""
    if stage == 0:
        return edge_parameters(model)
    return model.layers_per_stage * block_layer_parameters(model)


def count_parameters(model: ModelConfig, num_stages: int) -> int:
    """Parameters of the whole model (edge stage + all num_stages - 1 block stages)."""
    return count_stage_parameters(model, 0) + (num_stages - 1) * count_stage_parameters(model, 1)
