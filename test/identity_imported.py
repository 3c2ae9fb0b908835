"""A module the identity tests' hooks import inside their body (never a global of theirs)."""

SCALE = 1.0
