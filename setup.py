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

setup(
    name="msds",
    version="0.1.0",
    description="Multi-level (V-cycle) BERT/GPT pretraining integrated with DeepSpeed and megatron-core",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["msds", "msds.*", "kernels", "kernels.*"]),
    install_requires=RUNTIME,
    extras_require={
        "kernels": ["triton==3.9.0"],
        "dev": ["pytest", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["msds=msds.cli:main"]},
)
