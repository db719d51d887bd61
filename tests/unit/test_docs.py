"""README.md and docs/ as a user copies them (tests/docs_harness.py): every run file and fragment validates, every
command's flags are accepted by its parser, every pytest line selects tests, every install line installs this
checkout with extras that exist, every link and repository path resolves, no doc names an internal file, issue,
machine path or the developers' GPU tool, and every default a sentence states is the config's. Each check is shown
failing on a planted defect.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import docs_harness as harness  # noqa: E402

DOC = harness.REPO / "docs" / "planted.md"  # a name for planted text (never written)


@pytest.mark.parametrize("doc", harness.DOCS, ids=lambda p: p.name)
def test_every_doc_is_true(doc):
    assert harness.check_doc(doc) == []


def _problems(text: str) -> list[str]:
    return harness.check_doc(DOC, text)


@pytest.mark.parametrize(("text", "expected"), [
    # a stale default, in a sentence and in a command's flag
    ("`rollout.backend` (default `hf`) picks the backend.", "says rollout.backend defaults to 'hf'"),
    ("`run.stop_grace_s` (30 s by default) bounds it.", "says run.stop_grace_s defaults to 30.0"),
    ("```bash\ndsrl plan --ds_config configs/tiny_grpo_cpu.json --world-size 2\n```", "unknown flag(s) --world-size"),
    ("```bash\ndeepspeed --num_gpus 2 launch/train.py --ds_config configs/tiny_grpo_cpu.json "
     "--dsrl.rollout.backend_name hf\n```", "backend_name"),
    ("```bash\npython bench/e2e.py --no_such_flag\n```", "no_such_flag"),
    ("```bash\ndeepspeed --num_gpus 2 --module dsrl.check --ds_config configs/check_cpu.json --stages 1\n```",
     "--stages"),
    # paths and links
    ("See `configs/tiny_grpo_gone.json`.", "configs/tiny_grpo_gone.json does not exist"),
    ("See [the guide](nowhere.md).", "the link nowhere.md does not resolve"),
    # commands that run nothing, installs of another package
    ("```bash\npytest tests/distributed/test_multinode_pdsh.py\n```", "selects no test (tier suite)"),
    ("```bash\npip install 'dsrl[lora]'\n```", "unrelated 'dsrl'"),
    ("```bash\npip install -e \".[loras]\"\n```", "no extra loras"),
    ("Install with `pip install 'dsrl[megatron]'` first.", "unrelated 'dsrl'"),
    # internal names
    ("As ARCHITECTURE §2 says.", "design document"),
    ("Measured for issue 26.", "internal issue number"),
    ("One H100 (Device Tool), torch 2.11.", "tool a GPU was lent through"),
    ("One H100 (`nvidia-h100-x1`), torch 2.11.", "machine kind"),
    # run files
    ("```json\n{\"dsrl\": {\"run\": {\"rollouts\": 1}}}\n```", "is not a run file dsrl accepts"),
    ("<!-- excerpt of configs/tiny_grpo_cpu.json -->\n```json\n{\"dsrl\": {\"rollout\": {\"max_new_tokens\": 9}}}\n```",
     "rollout.max_new_tokens = 9 here, 8 in the file"),
])
def test_the_harness_finds_each_planted_defect(text, expected):
    found = _problems(text)
    assert any(expected in p for p in found), found


def test_the_harness_accepts_what_is_true():
    assert _problems("`rollout.backend` (default `auto`) and `run.stop_grace_s` (default 25 s).") == []
    assert _problems("One NVIDIA H100 80GB HBM3 and one NVIDIA H200 (141 GB); a device-side tool call.") == []
    assert _problems("```bash\ndsrl plan --ds_config configs/tiny_grpo_cpu.json --world_size 2 "
                     "--dsrl.batch.samples_per_prompt 4\n"
                     "pytest tests/distributed/test_multinode_pdsh.py --tier extended\n"
                     "pip install -e \".[lora]\"\n```") == []
    assert _problems("<!-- fragment of configs/tiny_grpo_cpu.json -->\n```json\n\"rollout\": {\"max_new_tokens\": 9}"
                     "\n```") == []
