"""Every tensor the node creates or receives lives on its stage's device: a search of the code.

A GPU peer computes with tensors on its stage's device, and the wire is on the host
(node/runtime/device.py). A tensor made without a device lands on the CPU, and the first op that
mixes it with the stage's tensors fails on a GPU, never on the CPU machines the tests run on. So
this test reads node/ with `ast` and fails on every place that makes or moves a tensor to the host
without saying so:

- a torch factory call (torch.empty, zeros, randn, tensor, ...) without a `device=` argument;
- `.cpu()`, `.to("cpu", ...)`, `.to(device="cpu")`, `torch.device("cpu")`, `map_location="cpu"`.

A place whose tensor belongs on the host (a wire buffer, a file, the CPU generator that gives every
replica the same init, a local data source) passes `device="cpu"` explicitly or carries a comment
`# host: <why>` on its line or the line above: either way the choice is written down where a reader sees it.
protocol/ (bytes on the wire: host by definition) and dht/ (no tensors) are not searched.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEARCHED = ROOT / "node"
FACTORIES = {
    "empty",
    "zeros",
    "ones",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "arange",
    "linspace",
    "eye",
    "tensor",
    "as_tensor",
    "empty_strided",
    "frombuffer",
    "from_numpy",
}
HOST_MARK = "# host:"


def _is_cpu_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value == "cpu":
        return True
    # torch.device("cpu")
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "device"
        and bool(node.args)
        and _is_cpu_literal(node.args[0])
    )


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def violation(call: ast.Call) -> str | None:
    """Why this call makes or moves a tensor to the host without saying so (None: it does not)."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value
    if isinstance(owner, ast.Name) and owner.id == "torch" and func.attr in FACTORIES:
        device = _keyword(call, "device")
        if device is None:
            return f"torch.{func.attr}(...) without device="
        return None  # device="cpu" written out is a decision, and so is the stage's device
    if func.attr == "cpu" and not call.args:
        return ".cpu()"
    if func.attr == "to" and (
        any(_is_cpu_literal(a) for a in call.args) or _is_cpu_literal(_keyword(call, "device") or ast.Constant(None))
    ):
        return '.to("cpu")'
    if func.attr == "load" and _is_cpu_literal(_keyword(call, "map_location") or ast.Constant(None)):
        return 'torch.load(map_location="cpu")'
    return None


def unmarked_host_tensors(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            why = violation(node)
            if why is None:
                continue
            span = lines[max(0, node.lineno - 2) : (node.end_lineno or node.lineno)]  # the comment above counts
            if any(HOST_MARK in line for line in span):
                continue
            found.append(f"{path.relative_to(root)}:{node.lineno}: {why}: {lines[node.lineno - 1].strip()}")
    return found


def test_no_tensor_is_made_or_moved_to_the_host_without_saying_so():
    found = unmarked_host_tensors(SEARCHED)
    assert not found, (
        'tensors made or moved to the host without a device (pass the stage\'s device, or device="cpu" / a '
        f"'{HOST_MARK} why' comment where the host is meant):\n" + "\n".join(found)
    )


def test_the_search_finds_what_it_looks_for(tmp_path: Path):
    """The search itself: each unmarked form is found, each marked or placed one is not."""
    (tmp_path / "sample.py").write_text(
        "import torch\n"
        "a = torch.zeros(3)\n"
        "b = torch.zeros(3, device=dev)\n"
        "c = x.cpu()\n"
        "d = x.to('cpu', torch.float32)\n"
        "e = x.to(device='cpu')\n"
        "f = x.to(torch.device('cpu'))\n"
        "g = torch.load(p, map_location='cpu')\n"
        "h = torch.randn(2)  # host: a probe drawn for the wire\n"
        "i = x.to(dev)\n"
        "j = torch.empty(\n    4,\n)  # host: a wire buffer\n"
        "k = torch.tensor([1], device='cpu')\n"
        "# host: local data\n"
        "m = torch.from_numpy(n)\n"
        "o = torch.from_numpy(n)\n"
    )
    found = unmarked_host_tensors(tmp_path)
    assert [line.split(":")[1] for line in found] == ["2", "4", "5", "6", "7", "8", "17"], found
