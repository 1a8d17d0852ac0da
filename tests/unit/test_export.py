"""node/model/hf.py and node/monitor/export.py without a network: stage weights -> a Hugging Face
checkpoint whose logits equal our own forward, the inverse mapping, which weights a state gives,
and `generate` on the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from node.config import ModelConfig, SwarmConfig
from node.model.hf import (
    ExportError,
    MissingExtra,
    assemble_state_dict,
    generate,
    require_transformers,
    split_state_dict,
    write_checkpoint,
)
from node.model.llama import ReferenceModel, export_llama_state_dict
from node.monitor.export import WeightsKind, weights_of
from protocol.stage_state import StageState

transformers = pytest.importorskip("transformers")

GQA = SwarmConfig(num_stages=4).replace(model={"num_key_value_heads": 2, "layers_per_stage": 2})
TOLERANCE = 1e-5


def trained_like(config: SwarmConfig) -> ReferenceModel:
    """Stages whose weights are not the initial ones (norms included), as after training."""
    model = ReferenceModel(config.model, config.num_stages, config.seed)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def stage_weights(model: ReferenceModel) -> dict[int, dict[str, torch.Tensor]]:
    modules = [model.edge, *model.blocks]
    return {stage: dict(module.state_dict()) for stage, module in enumerate(modules)}


def test_assembled_names_are_transformers_and_the_inverse_holds() -> None:
    model = trained_like(GQA)
    stages = stage_weights(model)
    assembled = assemble_state_dict(GQA.model, GQA.num_stages, stages)
    reference = export_llama_state_dict(model.edge, list(model.blocks))  # tests/unit/test_model.py's mapping
    assert assembled.keys() == reference.keys()
    assert all(torch.equal(assembled[k], reference[k]) for k in reference)
    back = split_state_dict(GQA.model, GQA.num_stages, assembled)
    assert back.keys() == stages.keys()
    for stage in stages:
        assert back[stage].keys() == stages[stage].keys()
        assert all(torch.equal(back[stage][k], stages[stage][k]) for k in stages[stage])


def test_wrong_weights_are_refused() -> None:
    stages = stage_weights(ReferenceModel(GQA.model, GQA.num_stages, GQA.seed))
    with pytest.raises(ExportError, match="no weights for stage 2"):
        assemble_state_dict(GQA.model, GQA.num_stages, {s: w for s, w in stages.items() if s != 2})
    bad = {**stages, 1: {**stages[1], "layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}}
    with pytest.raises(ExportError, match="shape"):
        assemble_state_dict(GQA.model, GQA.num_stages, bad)
    with pytest.raises(ExportError, match="differ from the config"):
        assemble_state_dict(ModelConfig(), 4, stages)  # one layer per stage, not two


def test_checkpoint_logits_equal_our_forward(tmp_path) -> None:
    model = trained_like(GQA)
    out = write_checkpoint(GQA, stage_weights(model), tmp_path / "export", provenance=[{"stage": 0}])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf.eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings is False
    tokens = torch.randint(0, GQA.model.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model.logits(tokens), hf(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"max |logits difference| = {diff:.2e}")
    assert diff < TOLERANCE
    swarm = json.loads((out / "pipeswarm.json").read_text())
    assert swarm["config_hash"] == GQA.config_hash() and SwarmConfig.from_dict(swarm["config"]) == GQA

    text = generate(out, "1 2 3", max_new_tokens=5)  # no tokenizer: token ids in and out
    ids = [int(t) for t in text.split()]
    assert ids[:3] == [1, 2, 3] and len(ids) == 8 and all(0 <= i < GQA.model.vocab_size for i in ids)
    assert text == generate(out, "1 2 3", max_new_tokens=5)  # greedy is deterministic
    sampled = generate(out, "1 2 3", max_new_tokens=5, temperature=1.0, top_k=5, seed=3)
    assert len(sampled.split()) == 8
    with pytest.raises(ExportError, match="token ids"):
        generate(out, "hello", max_new_tokens=5)
    with pytest.raises(ExportError, match="no exported model"):
        generate(tmp_path, "1", max_new_tokens=5)


def test_outer_weights_win_when_complete() -> None:
    theta = {"a": torch.zeros(2), "b": torch.zeros(3)}
    phi = {"phi.a": torch.ones(2), "phi.b": torch.ones(3), "momentum.a": torch.zeros(2), "momentum.b": torch.zeros(3)}
    weights, kind = weights_of(StageState(stage=1, weights=theta, outer=phi, outer_round=1))
    assert kind == WeightsKind.OUTER and set(weights) == {"a", "b"} and torch.equal(weights["a"], torch.ones(2))
    weights, kind = weights_of(StageState(stage=1, weights=theta))
    assert kind == WeightsKind.INNER and weights["a"] is theta["a"]
    partial = {"phi.a": torch.ones(2)}
    assert weights_of(StageState(stage=1, weights=theta, outer=partial, outer_round=1))[1] == WeightsKind.INNER
    # before the first round phi is the initial weights: the trained theta is exported
    assert weights_of(StageState(stage=1, weights=theta, outer=phi, outer_round=0))[1] == WeightsKind.INNER


def test_missing_extra_is_one_line(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(MissingExtra, match=r"pip install 'pipeswarm\[export\]'") as refused:
        require_transformers()
    assert "\n" not in str(refused.value)
