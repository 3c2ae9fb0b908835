"""torch_patches: saved-tensor hooks as first-class citizens of torch.compile."""

import os
import re

from setuptools import find_packages, setup


def _version() -> str:
    path = os.path.join(os.path.dirname(__file__), "torch_patches", "__init__.py")
    with open(path) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


setup(
    name="torch_patches",
    version=_version(),
    description="Saved-tensor hooks inlined, placed and cached correctly under torch.compile",
    long_description=open(os.path.join(os.path.dirname(__file__), "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_patches", "torch_patches.*"]),
    package_data={"torch_patches._registry": ["fingerprints.json"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11,<2.16"],
    extras_require={
        # pytest below 9.2: pytest-xdist (3.8) groups a test with others (``--dist loadgroup``,
        # pytest.ini) by renaming it, through an attribute pytest 9.2 no longer reads; there
        # every group's tests are spread over the workers (test_export_upstream's
        # TestExport.test_one_worker_runs_the_group fails there).
        "test": ["pytest>=7,<9.2", "pytest-xdist>=3", "expecttest>=0.2", "hypothesis>=6", "numpy", "matplotlib"],
        "upstream": ["ghstack"],
        # The lint and type gate (CI's, and pre-commit's): versions pinned, so that the
        # formatter's output does not move under a change.
        "lint": ["ruff==0.17.6", "mypy==2.4.1"],
        # Real-model acceptance tests (test/test_models.py): HF Llama, GPT-2, ViT from configs;
        # peft for the harness's LoRA fine-tune (test/test_convergence.py).
        # Their timm ViT needs timm installed apart, `pip install --no-deps timm`: timm
        # requires torchvision, whose PyPI wheels are CUDA builds pinned to one torch release,
        # so resolving it here would replace a CPU torch (2.13.0+cpu -> 2.15.0 with CUDA
        # libraries); the test imports timm without torchvision.
        "models": ["transformers>=4.50", "peft>=0.13"],
        # The research harness (python -m benchmarks.convergence, from a clone) and the report's
        # pictures: the models, and the loss curves as a PNG (the tables print without matplotlib).
        "bench": ["transformers>=4.50", "peft>=0.13", "matplotlib"],
    },
    entry_points={"console_scripts": ["torch-patches=torch_patches.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
