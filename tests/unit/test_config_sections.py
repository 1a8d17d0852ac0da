"""Each component takes the config sections it reads, not the whole SwarmConfig (torchtitan's habit,
issue 43): a signature says what a component depends on (`model: ModelConfig`, `training:
TrainingConfig`, `num_stages: int`), so a reader need not open the body to learn it, and a test can
build the component from the one section it needs.

Checked with `ast` over node/: a parameter annotated SwarmConfig (of a function, a method, or a
dataclass field, which is its constructor's parameter) is allowed only in a definition listed in
COMPOSITION_ROOTS, each with why it needs the whole swarm. A listed entry that takes no SwarmConfig
any more fails too, so the list only shrinks by hand and never goes stale.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHOLE_CONFIG = re.compile(r"\bSwarmConfig\b")  # a bare name, a string, `X | None`, node.config.SwarmConfig

# "path" (every definition of the module) or "path::Name" (a top-level function or class, its
# methods and fields included) -> why it takes the whole SwarmConfig. Reviewed: add an entry only
# for a composition root, something about the whole swarm, or a reader of three or more sections.
COMPOSITION_ROOTS: dict[str, str] = {
    "node/config/__init__.py::validate": "the config's own check, every section against the others",
    "node/model/data.py::open_source": "a stage-0 data source: data section, model.vocab_size, training.sequence_length, seed",
    "node/model/data.py::open_heldout": "the held-out source: the same four as open_source",
    "node/model/synthetic.py::markov_source": "the embedded chain: data section, model.vocab_size, training.sequence_length, seed",
    "node/model/memory.py::estimate_stage_memory": "a whole stage's memory: model, training, gossip, recovery, num_stages",
    "node/model/memory.py::fitting_in_flight": "the estimate (above) at each window of the training section",
    "node/model/memory_tables.py": "docs/model.md's tables: every preset's whole config through the estimate",
    "node/model/hf.py::write_checkpoint": "a checkpoint records the whole config and its hash beside the weights",
    "node/stage/stage_worker.py::StageWorker": "one stage on one peer: model, training, seed, num_stages; verifiers read worker.config",
    "node/pipeline/validation.py::open_validator": "validation section plus open_heldout's four",
    "node/recovery/rebuild.py::rebuild_stage": "the swarm's strategy: recovery, num_stages, swarm_id (checkpoints), model and seed (re-init)",
    "node/simulate/swarm.py::SimulatedSwarm": "composition root of a simulated swarm: every stage's workers, gossip, routing, data",
    "node/simulate/sources.py::training_source": "open_source's four, or the chain from model and seed",
    "node/simulate/sources.py::held_out_source": "open_heldout's four, or the chain from model and seed",
    "node/server/daemon.py": "the node's start-up: founds or joins the swarm whose config it publishes or checks",
    "node/server/doctor.py::check_memory": "a stage's memory estimate (the whole stage) against this device",
    "node/server/doctor.py::check_auto_memory": "every stage's memory estimate against this device",
    "node/server/stage_fit.py::stage_fits": "the memory estimate of whole stages in the precision training resolves to",
    "node/server/stage_service.py": "composition root of a served stage: worker, pipeline, gossip, recovery, data",
    "node/monitor/status.py": "the status observer: a snapshot of the whole swarm and its config's figures",
    "node/monitor/observer.py::Observer": "holds the swarm's config for the status snapshots",
    "node/monitor/export.py::Collected": "an export carries the whole config into the checkpoint",
    "node/demo.py::DemoRun": "composition root of the demo: a local swarm of every stage",
    "node/pipeline/origin.py::Origin": "stage 0's pipeline: training, model (anchor ids), heartbeat (retries), recovery (swapped order), num_stages",
    "node/p2p/swarm_peers.py::swarm_transport": "a joined peer's transport and peers: swarm_id, training (codec), heartbeat (bans)",
}


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


def whole_config_parameters(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(top-level definition, line, parameter) of every parameter annotated SwarmConfig: function
    and method arguments of every kind, and the fields of dataclasses."""
    found = []
    for top in tree.body:
        if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(top):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                arguments = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                found += [
                    (top.name, arg.lineno, f"{node.name}({arg.arg})")
                    for arg in arguments
                    if arg.annotation is not None and WHOLE_CONFIG.search(ast.unparse(arg.annotation))
                ]
            elif isinstance(node, ast.ClassDef) and _is_dataclass(node):
                found += [
                    (top.name, field.lineno, f"{node.name}.{ast.unparse(field.target)}")
                    for field in node.body
                    if isinstance(field, ast.AnnAssign) and WHOLE_CONFIG.search(ast.unparse(field.annotation))
                ]
    return found


def section_findings(root: Path, allowed: dict[str, str]) -> list[str]:
    """A SwarmConfig parameter outside `allowed`, and an entry of `allowed` that names nothing which takes one."""
    findings, used = [], set()
    for path in sorted((root / "node").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        for definition, line, parameter in whole_config_parameters(ast.parse(path.read_text(encoding="utf-8"))):
            entry = next((key for key in (f"{name}::{definition}", name) if key in allowed), None)
            if entry is None:
                findings.append(f"  {name}:{line}: {parameter} takes the whole SwarmConfig")
            else:
                used.add(entry)
    findings += [f"  {entry}: listed, but takes no SwarmConfig: drop it" for entry in sorted(set(allowed) - used)]
    return findings


def test_components_take_their_config_sections_not_the_whole_swarm_config():
    findings = section_findings(ROOT, COMPOSITION_ROOTS)
    assert not findings, (
        "pass the sections a component reads (model: ModelConfig, num_stages: int, ...), or list a "
        "composition root in COMPOSITION_ROOTS with its reason:\n" + "\n".join(findings)
    )


def test_every_composition_root_says_why():
    assert all(why.strip() for why in COMPOSITION_ROOTS.values())


def test_the_check_sees_every_kind_of_parameter_and_stale_entries(tmp_path):
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "a.py").write_text(
        "from dataclasses import dataclass\n"
        "def f(model: ModelConfig, config: SwarmConfig) -> None: ...\n"
        "async def g(*, config: 'SwarmConfig | None' = None): ...\n"
        "class C:\n"
        "    def __init__(self, config: node.config.SwarmConfig): ...\n"
        "@dataclass\n"
        "class D:\n"
        "    config: SwarmConfig\n"
        "class E:\n"
        "    config: SwarmConfig\n"  # a plain class's annotation is no parameter
        "def h(training: TrainingConfig, configs: list[SwarmConfigs]): ...\n"
    )
    assert section_findings(tmp_path, {}) == [
        "  node/a.py:2: f(config) takes the whole SwarmConfig",
        "  node/a.py:3: g(config) takes the whole SwarmConfig",
        "  node/a.py:5: __init__(config) takes the whole SwarmConfig",
        "  node/a.py:8: D.config takes the whole SwarmConfig",
    ]
    allowed = {"node/a.py::f": "why", "node/a.py::C": "why", "node/a.py::h": "why", "node/b.py": "why"}
    assert section_findings(tmp_path, allowed) == [
        "  node/a.py:3: g(config) takes the whole SwarmConfig",
        "  node/a.py:8: D.config takes the whole SwarmConfig",
        "  node/a.py::h: listed, but takes no SwarmConfig: drop it",
        "  node/b.py: listed, but takes no SwarmConfig: drop it",
    ]
    assert section_findings(tmp_path, {"node/a.py": "why"}) == []
