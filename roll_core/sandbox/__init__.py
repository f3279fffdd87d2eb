"""Sandboxes: isolated workspaces for agents and graders (see docs/swe.md)."""
