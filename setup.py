"""Packaging for msds: multi-level (V-cycle) BERT/GPT pretraining on DeepSpeed."""
from setuptools import find_packages, setup

# Runtime pins. torch must be installed first from the CPU wheel (see Makefile): a bare
# "torch" requirement resolved by pip alone may pick a multi-GB CUDA build.
RUNTIME = [
    "torch==2.13.0",
    "deepspeed==0.19.8",
    "megatron-core==0.16.1",
    "transformers==5.23.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "datasets==5.2.0",
    "pyyaml==6.0.4",
    "tensorboard",
    "matplotlib",
]

PACKAGED_DIRS = {"msds.ds_configs": "ds_configs", "msds.recipes": "recipes", "msds.results": "benchmarks/results"}

setup(
    name="msds",
    version="0.1.0",
    description="Multi-level (V-cycle) BERT/GPT pretraining integrated with DeepSpeed and megatron-core",
    python_requires=">=3.11,<3.12",
    # The top-level ds_configs/, recipes/ and benchmarks/results/ are package data of msds
    # (msds/resources.py reads them): mapped to msds.ds_configs, msds.recipes and msds.results, they are inside the wheel of `pip install .` and,
    # with `pip install -e .`, found in the checkout.
    packages=find_packages(include=["msds", "msds.*", "kernels", "kernels.*"]) + list(PACKAGED_DIRS),
    package_dir=PACKAGED_DIRS,
    package_data={"msds.ds_configs": ["*.json"], "msds.recipes": ["*.yaml", "*/*.yaml"],
                  "msds.results": ["*.json"]},
    install_requires=RUNTIME,
    extras_require={
        "kernels": ["triton==3.9.0"],
        "dev": ["pytest", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["msds=msds.cli:main"]},
)
