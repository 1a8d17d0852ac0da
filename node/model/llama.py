"""The model: a LLaMA-style decoder (Touvron et al. 2023) cut into pipeline stages.

Numerically this is transformers' ``LlamaForCausalLM`` (no biases, RMSNorm in float32, rotary
embeddings with the rotate_half convention, SwiGLU MLP, grouped-query attention, untied LM head),
written out in one file so it can be read beside the paper. The pipeline cut follows
docs/algorithms.md ("Pipeline layout used by CheckFree"):

    stage 0      EdgeStage   embed_tokens ........................ norm, lm_head, loss
                    |                                                   ^
    stages 1..S  BlockStage  layers_per_stage decoder layers each  ->  ... -> stage S

Every BlockStage has the same parameter names and shapes (``layers.{j}.self_attn.q_proj.weight``
with j local to the stage), so CheckFree can average two neighbouring stages parameter by
parameter. Initial weights are a pure function of (swarm seed, stage): every replica of a stage
starts bit-identical without talking to anyone.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from node.config import ModelConfig

INIT_STD = 0.02  # HF LlamaConfig.initializer_range


# ------------------------------------------------------------------------------------------------
# Building blocks
# ------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, the statistics computed in float32 (as HF does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # host: built there, moved by StageWorker
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin [T, head_dim] for positions 0..T-1, frequencies laid out as cat(freqs, freqs).

    Computed on the fly in float32 (a few hundred flops) rather than kept as a buffer, so a stage's
    state_dict holds parameters only and a .half() never degrades the frequencies.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, head_dim]; cos/sin [T, head_dim] broadcast over batch and heads."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query key/value heads and rotary positions."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.num_heads = m.num_attention_heads
        self.num_kv_heads = m.num_key_value_heads
        self.head_dim = m.hidden_size // m.num_attention_heads
        self.q_proj = nn.Linear(m.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(m.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(m.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, m.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # each kv head serves `groups` consecutive query heads (HF repeat_kv)
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(m.hidden_size, m.intermediate_size, bias=False)
        self.up_proj = nn.Linear(m.hidden_size, m.intermediate_size, bias=False)
        self.down_proj = nn.Linear(m.intermediate_size, m.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(m)
        self.mlp = MLP(m)
        self.input_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


# ------------------------------------------------------------------------------------------------
# Pipeline stages
# ------------------------------------------------------------------------------------------------


class EdgeStage(nn.Module):
    """Stage 0: token embedding at the start of the pipeline, final norm + LM head + loss at its end."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.config = m
        self.embed_tokens = nn.Embedding(m.vocab_size, m.hidden_size)
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.lm_head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens LongTensor[B, T] -> hidden [B, T, H]."""
        return self.embed_tokens(tokens)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [B, T, H] (output of the last block stage) -> logits [B, T, V]."""
        return self.lm_head(self.norm(hidden))

    def loss(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy over all B*T positions (targets are already the shifted inputs)."""
        logits = self.logits(hidden)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class BlockStage(nn.Module):
    """Stages 1..S: `layers_per_stage` decoder layers, hidden [B, T, H] -> hidden [B, T, H]."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.config = m
        self.layers = nn.ModuleList(DecoderLayer(m) for _ in range(m.layers_per_stage))

    def forward(self, hidden: Tensor) -> Tensor:
        m = self.config
        head_dim = m.hidden_size // m.num_attention_heads
        cos, sin = rotary_cos_sin(hidden.shape[1], head_dim, m.rope_theta, hidden.device, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return hidden


def stage_init_seed(seed: int, stage: int) -> int:
    """A stable 63-bit seed for (swarm seed, stage): sha256, independent of Python's hash salt."""
    digest = hashlib.sha256(f"pipeswarm/init/v1/{seed}/{stage}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(module: nn.Module, generator: torch.Generator, embedding_std: float = INIT_STD) -> None:
    """HF Llama init: every Linear weight ~ N(0, 0.02), the token embedding ~ N(0, embedding_std)
    (0.02 there too unless the model config says otherwise), every RMSNorm weight = 1.

    Parameters are visited in named_parameters() order, so the result depends on the generator
    seed only. Tensors are filled on CPU in float32.
    """
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            std = embedding_std if name.startswith("embed_tokens.") else INIT_STD
            p.normal_(0.0, std, generator=generator)


def build_stage(model: ModelConfig, stage: int, seed: int) -> EdgeStage | BlockStage:
    """The module for `stage` with its initial weights (float32, CPU, train mode).

    Stage 0 gives an EdgeStage, any later stage a BlockStage (whoever holds the swarm's num_stages
    checks the upper bound: StageWorker does). Weights are a deterministic function of (seed,
    stage): the swarm's seed, or another one for a "random re-init" recovery that must not
    reproduce the original initialisation.
    """
    if stage < 0:
        raise ValueError(f"stage {stage} is negative")
    module: EdgeStage | BlockStage = EdgeStage(model) if stage == 0 else BlockStage(model)
    generator = torch.Generator(device="cpu").manual_seed(stage_init_seed(seed, stage))
    init_weights(module, generator, model.embedding_init_std)
    return module


class ReferenceModel(nn.Module):
    """The whole model in one process: the stages build_stage gives, chained. Used by tests."""

    def __init__(self, model: ModelConfig, num_stages: int, seed: int) -> None:
        super().__init__()
        self.edge: EdgeStage = build_stage(model, 0, seed)  # type: ignore[assignment]
        self.blocks = nn.ModuleList(build_stage(model, s, seed) for s in range(1, num_stages))

    def hidden(self, tokens: Tensor) -> Tensor:
        h = self.edge.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h

    def logits(self, tokens: Tensor) -> Tensor:
        return self.edge.logits(self.hidden(tokens))

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        return self.edge.loss(self.hidden(tokens), targets)


# ------------------------------------------------------------------------------------------------
# Interoperability with transformers and sizes
# ------------------------------------------------------------------------------------------------


def export_llama_state_dict(edge: EdgeStage, blocks: list[BlockStage]) -> dict[str, Tensor]:
    """A state dict for transformers.LlamaForCausalLM; `blocks` are stages 1..S in order.

    Layer j of block stage s (1-based) becomes model.layers.{(s-1)*layers_per_stage + j}.
    Tensors are detached references (clone them before mutating).
    """
    out: dict[str, Tensor] = {"model.embed_tokens.weight": edge.embed_tokens.weight.detach()}
    index = 0
    for block in blocks:
        for layer in block.layers:
            for name, p in layer.named_parameters():
                out[f"model.layers.{index}.{name}"] = p.detach()
            index += 1
    out["model.norm.weight"] = edge.norm.weight.detach()
    out["lm_head.weight"] = edge.lm_head.weight.detach()
    return out


def llama_config_dict(m: ModelConfig, num_stages: int) -> dict:
    """Keyword arguments for transformers.LlamaConfig describing the same model (num_stages - 1 block stages)."""
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.layers_per_stage * (num_stages - 1),
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.rms_norm_eps,
        "rope_theta": m.rope_theta,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
