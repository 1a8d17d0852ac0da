"""docs/config.md, generated from the attribute docstrings of node/config (Python keeps none at
runtime, so they are read from the source with `ast`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
from collections.abc import Collection, Mapping
from dataclasses import fields
from enum import StrEnum
from pathlib import Path
from typing import Any

import node.config as config_module
from node.config import _ENUM_TYPES, _SECTIONS, SECTION_TYPES, SOURCE_ALIASES, SwarmConfig, SyntheticSource

# str fields that name an enum member or something else (a path): listed with the enums all the same
_NAMED_VALUES: dict[tuple[str, str], type[StrEnum]] = {("data", "source"): SyntheticSource}

_INTRO = """\
# Configuration reference

Generated from the field docstrings in `node/config/__init__.py`; do not edit by hand. Regenerate with
`.venv/bin/python -m node.config > docs/config.md` (`tests/unit/test_config.py` fails while this
file and the code disagree).

## How a swarm gets its config

- The bootstrapper builds it: the defaults below, then a TOML file (`node bootstrap --config
  swarm.toml`), then its flags (table below); a later source wins, a flag left out changes nothing.
- Joiners read no config file: they fetch the swarm's config from the DHT and recompute its hash
  (the first 16 hex digits of a sha256 over every value below plus the protocol version). A peer
  refuses to join when its protocol version or that hash differs from what the bootstrapper
  announced, so every value here is the same on every peer; changing one means a new swarm.
- Per-peer settings (listen address, `--stage`, `--device`, `--data`, `--threads`, ...) are flags of
  `node join`, not config; `node join --swarm ID` picks the swarm when several share one DHT.
- In Python: `node.model.presets.load_config("swarm.toml", **{"gossip.inner_steps": 20})` (None values are ignored; a preset is resolved)
  and `config.replace(gossip={"inner_steps": 20})`.

| `node bootstrap` flag | key |
|---|---|
| `--swarm-id` | `swarm_id` |
| `--num-stages` | `num_stages` |
| `--seed` | `seed` |
| `--heartbeat-period` | `heartbeat.period` |
| `--heartbeat-ttl` | `heartbeat.ttl` |
| `--preset` | `model.preset` |

`node bootstrap --data DIR` (a directory of `node prepare-data`) sets three keys from it:
`data.tokenizer_hash` (the hash of its tokenizer), `data.manifest_hash` (the hash of its shard
manifest: stage-0 peers without `--data` fetch the shards, docs/model.md) and `model.vocab_size`
(the tokenizer's size).

TOML: top-level keys first, then one table per section; omitted keys keep their defaults.

```toml
swarm_id = "my-swarm"
num_stages = 4

[training]
learning_rate = 1e-3
wire_compression = "int8"
```

Unknown keys, wrong types and out-of-range values are refused with a message naming the key. An
integer is accepted where a float is expected; `true`/`false` are never accepted as numbers.

`--preset NAME` or `preset = "NAME"` in `[model]` fills the keys left unset with a published
shape and what training it needs: `[model]` (its layers split over the block stages),
`training.sequence_length`, `microbatch_size`, `min_in_flight` and `max_in_flight`, and
`num_stages` (docs/model.md, "Presets").
"""


def field_docs() -> dict[str, dict[str, str]]:
    """{class name: {field name: its docstring}} for every class of this module, read with `ast`
    from the source: the string literal on the line after a field is its docstring."""
    docs: dict[str, dict[str, str]] = {}
    for cls in ast.parse(Path(inspect.getfile(config_module)).read_text(encoding="utf-8")).body:
        if isinstance(cls, ast.ClassDef):
            found = docs.setdefault(cls.name, {})
            for stmt, doc in zip(cls.body, cls.body[1:]):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)
                ):
                    found[stmt.target.id] = doc.value.value.strip()
    return docs


def enum_member_docs(enum_type: type[StrEnum]) -> dict[str, str]:
    """{member value: the comment at the end of its line} from the enum's source ("" if none)."""
    source = textwrap.dedent(inspect.getsource(enum_type))
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    docs = {}
    for stmt in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            docs[enum_type[stmt.targets[0].id].value] = comments.get(stmt.lineno, "")
    return docs


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _type_cell(spec: dataclasses.Field) -> str:
    enum_type = _ENUM_TYPES.get(spec.type)  # type: ignore[arg-type]  # annotations are strings here
    if enum_type is not None:
        return "one of " + ", ".join(f"`{member.value}`" for member in enum_type)
    return "float, or unset" if spec.type == "float | None" else str(spec.type)


def _default_cell(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):  # enums included: StrEnum members are strings
        return f'`"{value}"`'
    return f"`{value!r}`"


def _table(cls: type, docs: Mapping[str, str], skip: Collection[str] = ()) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    lines += [
        f"| `{spec.name}` | {_cell(_type_cell(spec))} | {_default_cell(spec.default)} | {_cell(docs.get(spec.name, ''))} |"
        for spec in fields(cls)
        if spec.name not in skip
    ]
    return lines


def render_reference() -> str:
    """docs/config.md: how to set values, then one table per section (key as written in TOML, type or
    allowed values, default, description) and the members of every enum."""
    docs = field_docs()
    lines = [*_INTRO.splitlines(), "", "## Top level", "", inspect.getdoc(SwarmConfig) or "", ""]
    lines += _table(SwarmConfig, docs["SwarmConfig"], skip=_SECTIONS)
    for section, cls in SECTION_TYPES.items():
        lines += ["", f"## [{section}]", "", inspect.getdoc(cls) or "", "", *_table(cls, docs[cls.__name__])]
    lines += ["", "## Enum values"]
    for section, cls in SECTION_TYPES.items():
        for spec in fields(cls):
            enum_type = _ENUM_TYPES.get(spec.type) or _NAMED_VALUES.get((section, spec.name))  # type: ignore[arg-type]
            if enum_type is not None:
                lines += ["", f"`{section}.{spec.name}` ({enum_type.__name__}): {inspect.getdoc(enum_type)}", ""]
                lines += ["| value | meaning |", "|---|---|"]
                lines += [f"| `{value}` | {_cell(doc)} |" for value, doc in enum_member_docs(enum_type).items()]
                lines += [
                    f"| `{alias}` | the same as `{member.value}` (an older name, stored as `{member.value}`) |"
                    for alias, member in SOURCE_ALIASES.items()
                    if enum_type is SyntheticSource
                ]
    return "\n".join(lines) + "\n"
