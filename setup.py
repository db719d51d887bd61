"""Package metadata for dsrl: exact, fast RL post-training on DeepSpeed and Megatron."""

from setuptools import find_packages, setup

setup(
    name="dsrl",
    version="0.1.0",
    description="Numerically exact RL post-training (PPO/GRPO/RLOO/DAPO) on DeepSpeed and Megatron",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dsrl", "dsrl.*"]),
    package_data={"dsrl": ["assets/*/*", "assets/*"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19.5",
        "transformers>=4.46",
        "tokenizers>=0.20",
        "datasets>=3.0",
        "tqdm",
        "numpy",
        "ninja",
    ],
    extras_require={
        "megatron": ["megatron-core==0.16.1"],
        "vllm": ["vllm>=0.10"],
        "plot": ["matplotlib"],
        "test": ["pytest>=8", "ruff", "tensorboard", "megatron-core==0.16.1", "matplotlib"],
    },
    entry_points={"console_scripts": ["dsrl=dsrl.cli.main:main"]},
)
