"""Hugging Face checkpoints of a swarm's model: writing one from the stages' weights, sampling from it.

The layout a checkpoint directory gets (what `node export` writes, `node generate` reads):

    config.json          transformers.LlamaConfig for LlamaForCausalLM (llama.llama_config_dict)
    model.safetensors    the weights, float32, under LlamaForCausalLM's names
    tokenizer.json       (+ tokenizer_config.json) when the swarm trained on prepared data
    pipeswarm.json       the swarm config, its hash, and where each stage's weights came from

Stage weights map to LlamaForCausalLM names as llama.export_llama_state_dict does: stage 0's
embed_tokens / norm / lm_head become model.embed_tokens, model.norm and lm_head (untied: pipeswarm
keeps a separate LM head), layer j of block stage s becomes model.layers.{(s-1) * layers_per_stage + j}.

transformers and safetensors are the `export` extra: imported here only when a function needs them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from node.config import ModelConfig, SwarmConfig
from node.model.corpus import END_OF_TEXT
from node.model.llama import BlockStage, EdgeStage, llama_config_dict

WEIGHTS_FILE = "model.safetensors"
SWARM_FILE = "pipeswarm.json"
TOKENIZER_FILE = "tokenizer.json"
EDGE_NAMES = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
EDGE_NAMES["lm_head.weight"] = "lm_head.weight"


class ExportError(ValueError):
    """A checkpoint cannot be written or read (wrong weights, missing files, bad prompt)."""


class MissingExtra(RuntimeError):
    """transformers / safetensors are not installed (the `export` extra)."""


def require_transformers() -> ModuleType:
    """transformers, or MissingExtra with the one line that says how to get it."""
    try:
        import safetensors.torch  # noqa: F401
        import transformers
    except ImportError as e:
        raise MissingExtra(
            f"this command needs the export extra ({e.name} is missing): pip install 'pipeswarm[export]'"
        ) from None
    transformers.logging.set_verbosity_error()  # its advice about generation flags is noise here
    transformers.logging.disable_progress_bar()  # a bar for loading a few tensors from one file
    return transformers


def stage_shapes(model: ModelConfig, stage: int) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of one stage, from a module on the meta device (no memory)."""
    with torch.device("meta"):
        module = EdgeStage(model) if stage == 0 else BlockStage(model)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def assemble_state_dict(
    model: ModelConfig, num_stages: int, stages: Mapping[int, Mapping[str, Tensor]]
) -> dict[str, Tensor]:
    """LlamaForCausalLM's state dict from the weights of all `num_stages` stages (stage -> name ->
    tensor); refuses a missing stage or a name or shape that is not the config's (ExportError)."""
    out: dict[str, Tensor] = {}
    per_stage = model.layers_per_stage
    for stage in range(num_stages):
        if stage not in stages:
            raise ExportError(f"no weights for stage {stage}")
        weights, expected = stages[stage], stage_shapes(model, stage)
        if set(weights) != set(expected):
            missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
            raise ExportError(
                f"stage {stage}: weights differ from the config's model (missing {missing[:3]}, extra {extra[:3]})"
            )
        for name, tensor in weights.items():
            if tuple(tensor.shape) != expected[name]:
                raise ExportError(f"stage {stage} {name}: shape {tuple(tensor.shape)}, expected {expected[name]}")
            if stage == 0:
                target = EDGE_NAMES[name]
            else:  # "layers.{j}.rest" of block stage s
                _, local, rest = name.split(".", 2)
                target = f"model.layers.{(stage - 1) * per_stage + int(local)}.{rest}"
            out[target] = tensor.detach().to("cpu", torch.float32).contiguous()  # host: written to a file
    return out


def split_state_dict(model: ModelConfig, num_stages: int, state: Mapping[str, Tensor]) -> dict[int, dict[str, Tensor]]:
    """The inverse of assemble_state_dict: LlamaForCausalLM names -> stage -> stage names."""
    edge_names = {target: name for name, target in EDGE_NAMES.items()}
    per_stage = model.layers_per_stage
    stages: dict[int, dict[str, Tensor]] = {stage: {} for stage in range(num_stages)}
    for target, tensor in state.items():
        if target in edge_names:
            stages[0][edge_names[target]] = tensor
            continue
        index, rest = _layer_parts(target)
        if index >= per_stage * (num_stages - 1):
            raise ExportError(f"{target}: the config has {per_stage * (num_stages - 1)} layers")
        stages[1 + index // per_stage][f"layers.{index % per_stage}.{rest}"] = tensor
    return stages


def _layer_parts(target: str) -> tuple[int, str]:
    """The (index, rest) of a name "model.layers.{index}.{rest}"."""
    parts = target.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        raise ExportError(f"unexpected weight name {target!r}")
    return int(parts[2]), parts[3]


def write_checkpoint(
    config: SwarmConfig,
    stages: Mapping[int, Mapping[str, Tensor]],
    out: str | Path,
    tokenizer_path: str | Path | None = None,
    provenance: list[dict[str, Any]] | None = None,
) -> Path:
    """Write the checkpoint directory `out` (see the module docstring); returns it."""
    transformers = require_transformers()
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = assemble_state_dict(config.model, config.num_stages, stages)
    llama = dict(llama_config_dict(config.model, config.num_stages))
    tokenizer = None
    if tokenizer_path is not None:
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_path), eos_token=END_OF_TEXT, bos_token=END_OF_TEXT
        )
        llama.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    hf_config = transformers.LlamaConfig(**llama, architectures=["LlamaForCausalLM"])
    hf_config.save_pretrained(out)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", "pipeswarm_config_hash": config.config_hash()})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    swarm = {"config_hash": config.config_hash(), "config": config.to_dict(), "stages": provenance or []}
    (out / SWARM_FILE).write_text(json.dumps(swarm, indent=2) + "\n", encoding="utf-8")
    return out


def generate(
    model_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> str:
    """Continue `prompt` with the checkpoint in `model_dir`: greedy at temperature 0, else sampled
    (top_k > 0 keeps that many candidates). With a tokenizer the prompt is text and so is the
    result; without one (a swarm on synthetic or byte data) both are token ids separated by spaces."""
    transformers = require_transformers()
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file() or not (model_dir / WEIGHTS_FILE).is_file():
        raise ExportError(f"{model_dir} holds no exported model (config.json and {WEIGHTS_FILE})")
    if max_new_tokens < 1 or temperature < 0 or top_k < 0:
        raise ExportError("--max-new-tokens must be >= 1, --temperature and --top-k >= 0")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    tokenizer = None
    if (model_dir / TOKENIZER_FILE).is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]
    else:
        try:
            ids = [int(word) for word in prompt.split()]
        except ValueError:
            raise ExportError(f"{model_dir} has no tokenizer: --prompt must be token ids separated by spaces") from None
        if not ids or not all(0 <= i < vocab for i in ids):
            raise ExportError(f"--prompt needs at least one token id, each in 0..{vocab - 1}")
    room = model.config.max_position_embeddings - len(ids)
    if room < 1:
        raise ExportError(f"the prompt has {len(ids)} tokens, the model's context is {room + len(ids)}")
    torch.manual_seed(seed)
    input_ids = torch.tensor([ids])  # host: `node generate` samples on the CPU
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=min(max_new_tokens, room),
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=top_k if temperature > 0 and top_k > 0 else None,
            top_p=None,
            pad_token_id=model.config.eos_token_id if model.config.eos_token_id is not None else 0,
        )
    new = output[0, len(ids) :].tolist()
    if tokenizer is not None:
        return prompt + tokenizer.decode(new, skip_special_tokens=False)
    return " ".join(str(i) for i in ids + new)
