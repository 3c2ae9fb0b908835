"""Test helpers in upstream's layout: each module here becomes the
``torch/testing/_internal`` module of the same name."""
