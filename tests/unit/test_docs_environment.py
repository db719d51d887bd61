"""docs/environments.md's complete example runs: its tool, its episodes through dsrl's contract, and its
demonstration through the chat template of the tiny tokenizer (what the supervised warm-up trains on)."""

from __future__ import annotations

import re

from conftest import REPO

from dsrl.config import DataConfig, ModelConfig, RolloutConfig
from dsrl.rl.episodes.driver import demonstration
from dsrl.rl.episodes.environment import ObservationEncoder, Turn, load_environment
from dsrl.rl.policy.tokenizer import load_tokenizer
from dsrl.rollout.base import stop_token_ids


def test_the_documented_calculator_environment(tmp_path):
    doc = (REPO / "docs" / "environments.md").read_text()
    code = re.search(r"`my_env.py`:\n\n```python\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "my_env.py").write_text(code)
    env = load_environment(DataConfig(task="calculator", environment=f"{tmp_path}/my_env.py:CalcEpisode"))
    evaluate = env.factory.__init__.__globals__["evaluate"]
    assert evaluate("17 * 23 + 4") == "395" and evaluate("7 / 2") == "3.5"
    assert evaluate("1/0") == "error: division by zero" and evaluate("__import__('os')").startswith("error:")
    episode, _ = env.start("What is 2 ** 10?", "1024", "a sample")
    step = env.step(episode, Turn("Let me compute. <calc>2 ** 10</calc>", [1], 0, True), "a sample")
    assert (step.observation, step.reward, step.done) == ("1024", 0.0, False)
    assert env.step(episode, Turn("so the answer is 1000", [1], 1, True), "a sample").reward == 0.0
    tok = load_tokenizer(ModelConfig())
    record = {"prompt": "What is 17 * 23 + 4?", "answer": "395"}
    t = demonstration(env, tok, ObservationEncoder(tok, chat_template=True), stop_token_ids(tok, None, RolloutConfig()),
                      record, tok(record["prompt"])["input_ids"], 1024)
    assert tok.decode(t.completion_ids) == "<calc>17 * 23 + 4</calc></s>tool: 395\nassistant:so the answer is 395</s>"
    observation = len("tool: 395\nassistant:")
    assert t.mask == [1] * 25 + [0] * observation + [1] * 21 and t.ended_by == "done"
