"""Developer tools for torch_patches (not installed with the package)."""
