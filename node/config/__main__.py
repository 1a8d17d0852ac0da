"""`python -m node.config > docs/config.md`."""

from node.config.reference import render_reference

print(render_reference(), end="")
