"""Datasets as users hold them: directories (save_to_disk, hub snapshots), hub names read offline from the local
cache, conversational prompts, system prompts and templates, the other columns passed to the reward function, every
bad input named before any work, and no prompt cut silently. Every dataset here is written by the test."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import datasets
import pandas as pd
import pytest

from dsrl.config import ConfigError, DataConfig, ModelConfig
from dsrl.rl.data.prompts import PromptSampler, PromptSource, dataset_size, load_prompts
from dsrl.rl.data.sources import DatasetSource, column_names, read_rows, split_names
from dsrl.rl.policy.tokenizer import load_tokenizer
from dsrl.rl.rewards.contract import reward_columns
from dsrl.rl.rewards.functions import as_batched, load_reward_fn

REWARD = "exact"  # a dataset needs a reward; the built-in exact needs no extra


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def rows(tag: str, n: int) -> list[dict]:
    return [{"question": f"{tag} {i}: add: {i}+1 =", "answer": f"#### {i + 1}", "level": i % 3} for i in range(n)]


def write_parquet(path: Path, data: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(data).to_parquet(path)


def write_jsonl(path: Path, data: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    return path


def snapshot(root: Path) -> Path:
    """A hub snapshot's layout without its README: two configurations in sub-folders."""
    write_parquet(root / "main" / "train-00000-of-00001.parquet", rows("main-train", 4))
    write_parquet(root / "main" / "test-00000-of-00001.parquet", rows("main-test", 2))
    write_parquet(root / "socratic" / "train-00000-of-00001.parquet", rows("socratic-train", 3))
    return root


def data(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), prompt_key=kw.pop("prompt_key", "question"),
                      reward_fn=kw.pop("reward_fn", REWARD), **kw)


# ------------------------------------------------------------------------------------ where rows come from


def test_a_folder_of_shards_as_a_hub_snapshot_lays_them_out(tmp_path):
    write_parquet(tmp_path / "ds" / "data" / "train-00000-of-00002.parquet", rows("a", 3))
    write_parquet(tmp_path / "ds" / "data" / "train-00001-of-00002.parquet", rows("b", 2))
    write_parquet(tmp_path / "ds" / "data" / "test-00000-of-00001.parquet", rows("t", 1))
    cfg = data(tmp_path / "ds")
    records = load_prompts(cfg, 0)
    assert dataset_size(cfg) == len(records) == 5 and sorted(split_names(DatasetSource.of(cfg))) == ["test", "train"]
    assert {r["prompt"].split(" ")[0] for r in records} == {"a", "b"}
    assert load_prompts(data(tmp_path / "ds", split="test"), 0)[0]["prompt"] == "t 0: add: 0+1 ="
    jsonl = tmp_path / "js"
    jsonl.mkdir()
    write_jsonl(jsonl / "train.jsonl", rows("j", 2))
    assert len(load_prompts(data(jsonl), 0)) == 2


def test_subsets_of_a_snapshot_are_chosen_never_mixed(tmp_path):
    root = snapshot(tmp_path / "gsm")
    main = load_prompts(data(root, subset="main"), 0)
    assert [r["prompt"] for r in main][:1] == ["main-train 0: add: 0+1 ="] and len(main) == 4
    assert len(load_prompts(data(root, subset="main", split="test"), 0)) == 2
    assert split_names(DatasetSource(str(root), "main")) == ["train", "test"]
    with pytest.raises(ConfigError, match=r"dsrl.data.subset is unset but .* holds the sub-folders main, socratic"):
        load_prompts(data(root), 0)
    with pytest.raises(ConfigError, match=r"dsrl.data.subset = 'nope': .* \(it has: main, socratic\)"):
        load_prompts(data(root, subset="nope"), 0)
    with pytest.raises(ConfigError, match=r"dsrl.data.split = 'validation': .*has no such split \(it has train, test"):
        load_prompts(data(root, subset="main", split="validation"), 0)


def test_save_to_disk_directories(tmp_path):
    one = datasets.Dataset.from_list(rows("one", 3))
    one.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": one, "test": datasets.Dataset.from_list(rows("two", 2))}).save_to_disk(
        str(tmp_path / "dict"))
    assert len(load_prompts(data(tmp_path / "one"), 0)) == 3
    assert [r["prompt"] for r in load_prompts(data(tmp_path / "dict", split="test"), 0)][1] == "two 1: add: 1+1 ="
    assert split_names(DatasetSource(str(tmp_path / "dict"))) == ["train", "test"]
    with pytest.raises(ConfigError, match=r"dsrl.data.split = 'test': .* has no such split \(it has train\)"):
        load_prompts(data(tmp_path / "one", split="test"), 0)


def test_a_single_file_holds_one_split(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", rows("f", 2))
    assert split_names(DatasetSource(str(f))) == ["train"] and column_names(DatasetSource(str(f))) == [
        "question", "answer", "level"]
    with pytest.raises(ConfigError, match=r"dsrl.data.split = 'test' but dsrl.data.path = .*p.jsonl' is a single file"):
        load_prompts(data(f, split="test"), 0)


def write_hub_cache(cache: Path, repo_id: str, subset: str, splits: dict[str, list[dict]], tmp: Path) -> None:
    """The local cache entry ``datasets.load_dataset(repo_id, subset)`` leaves after a download (Arrow files and
    their info under ``<namespace>___<name>/<subset>/0.0.0/<hash>/``), made from local parquet files."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {}
    for split, data_rows in splits.items():
        files[split] = str(tmp / f"{split}.parquet")
        write_parquet(Path(files[split]), data_rows)
    namespace, name = repo_id.split("/")
    Parquet(cache_dir=str(cache), dataset_name=name, config_name=subset, config_id=subset, hash="0123abcd",
            data_files=files).download_and_prepare()
    os.rename(cache / name, cache / f"{namespace}___{name}")


def test_a_hub_name_reads_offline_from_the_local_cache(tmp_path, monkeypatch):
    write_hub_cache(tmp_path / "cache", "someone/mathset", "main", {"train": rows("hub", 3), "test": rows("ht", 2)},
                    tmp_path)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_DATASETS_OFFLINE=1 sets it at import
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    cfg = DataConfig(path="someone/mathset", subset="main", split="test", prompt_key="question", reward_fn=REWARD)
    assert [r["prompt"] for r in load_prompts(cfg, 0)] == ["ht 0: add: 0+1 =", "ht 1: add: 1+1 ="]
    assert sorted(split_names(DatasetSource.of(cfg))) == ["test", "train"]
    with pytest.raises(ConfigError, match=r"dsrl.data.path = 'someone/absent', split 'train': there is no local file "
                                          r"or directory 'someone/absent' .* and as a hub dataset it is not in the "
                                          r"local Hugging Face cache and the hub cannot be reached.*Fix: give"):
        load_prompts(DataConfig(path="someone/absent", prompt_key="question", reward_fn=REWARD), 0)
    with pytest.raises(ConfigError, match=r"dsrl.data.path = './nope': no such file or directory"):
        load_prompts(DataConfig(path="./nope", reward_fn=REWARD), 0)


def test_another_split_through_the_same_loaders(tmp_path):
    """What an evaluation calls: the training prompts' settings, another source (or split)."""
    root = snapshot(tmp_path / "gsm")
    cfg = data(root, subset="main")
    held_out = DatasetSource.of(cfg, split="test")
    assert held_out == DatasetSource(str(root), "main", "test", "dsrl.data")
    assert [r["prompt"] for r in load_prompts(cfg, 0, source=held_out)] == [
        "main-test 0: add: 0+1 =", "main-test 1: add: 1+1 ="]
    assert dataset_size(cfg, held_out) == 2
    other = DatasetSource(str(write_jsonl(tmp_path / "e.jsonl", [{"question": "", "answer": "1"}])), field="dsrl.eval")
    # the source is the evaluation's, the prompt settings are dsrl.data's (dsrl.eval has no prompt_key)
    with pytest.raises(ConfigError, match=r"dsrl.data.prompt_key = 'question': row 0 of dsrl.eval.path = .* is empty"):
        load_prompts(cfg, 0, source=other)


# ------------------------------------------------------------------------------------ prompts as the model sees them


def test_conversational_prompts_system_prompt_and_template(tmp_path, tok):
    f = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "add: 2+3 ="}], "answer": "5"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add: 1+1 ="}],
         "answer": "2"}])
    cfg = DataConfig(path=str(f), prompt_key="messages", reward_fn=REWARD, system_prompt="you add.")
    records = load_prompts(cfg, 0, tok)
    source = PromptSource(records, PromptSampler(2, 2), tok, cfg)
    _, ids = source.encode([0, 1])
    assert [tok.decode(x) for x in ids] == [  # message lists always go through the chat template
        "<s>system: you add.\nuser: add: 2+3 =\nassistant:",
        "<s>system: be brief\nuser: add: 1+1 =\nassistant:"]  # a row's own system message wins
    plain = write_jsonl(tmp_path / "plain.jsonl", rows("q", 1))
    tpl = DataConfig(path=str(plain), reward_fn=REWARD, prompt_template="solve {question} (level {level}) \\boxed{}",
                     chat_template=True, max_prompt_tokens=128)
    (record,) = load_prompts(tpl, 0, tok)
    assert record["prompt"] == "solve q 0: add: 0+1 = (level 0) \\boxed{}"  # other braces kept as written
    _, (ids,) = PromptSource([record], PromptSampler(1, 1), tok, tpl).encode([0])
    assert tok.decode(ids) == "<s>user: solve q 0: add: 0+1 = (level 0) \\boxed{}\nassistant:"
    with pytest.raises(ConfigError, match=r"dsrl.data.system_prompt is set but the prompts .* are text and "
                                          r"dsrl.data.chat_template is false"):
        load_prompts(DataConfig(path=str(plain), prompt_key="question", reward_fn=REWARD, system_prompt="x"), 0)
    with pytest.raises(ConfigError, match=r"dsrl.data.prompt_template = 'Solve' names no column"):
        DataConfig(path=str(plain), reward_fn=REWARD, prompt_template="Solve")
    with pytest.raises(ConfigError, match=r"dsrl.data.prompt_template is set but prompts come from the built-in task"):
        DataConfig(task="add", prompt_template="{prompt}")


def test_bad_input_is_named_by_row_and_field_all_together(tmp_path, tok):
    f = write_jsonl(tmp_path / "bad.jsonl", [
        {"messages": [{"role": "user", "content": "fine"}], "answer": "1"},
        {"messages": [], "answer": "2"},  # empty message list
        {"messages": [{"role": "user", "text": "no content key"}], "answer": "3"},  # wrong shape
        {"messages": [{"role": "user", "content": "ok"}], "answer": ""},  # empty answer
    ])
    with pytest.raises(ConfigError) as e:
        load_prompts(DataConfig(path=str(f), prompt_key="messages", reward_fn="exact"), 0)
    text = str(e.value)
    assert len(e.value.problems) == 2, text
    assert "dsrl.data.prompt_key = 'messages': rows 1, 2 of dsrl.data.path = " in text
    assert "hold a malformed message list (row 1: an empty message list). Fix: write each prompt as a list" in text
    assert "dsrl.data.answer_key = 'answer': row 3 of" in text and "holds an empty answer" in text
    g = write_jsonl(tmp_path / "types.jsonl", [{"q": "", "a": [1, 2]}, {"q": "x", "a": True}, {"q": " ", "a": "ok"}])
    with pytest.raises(ConfigError) as e:
        load_prompts(DataConfig(path=str(g), prompt_key="q", answer_key="a", reward_fn="math"), 0)
    assert len(e.value.problems) == 2, str(e.value)
    assert "dsrl.data.prompt_key = 'q': rows 0, 2 of" in str(e.value) and "are empty. Fix: remove" in str(e.value)
    assert "dsrl.data.answer_key = 'a': rows 0, 1 of" in str(e.value), str(e.value)
    assert "hold an answer that is neither text nor a number (row 0: list [1, 2])" in str(e.value)
    with pytest.raises(ConfigError) as e:  # both missing columns in one message
        load_prompts(DataConfig(path=str(g), prompt_key="question", answer_key="solution", reward_fn=REWARD), 0)
    assert len(e.value.problems) == 2 and "no such column" in str(e.value)
    wide = write_jsonl(tmp_path / "wide.jsonl", [{"q": "" if i % 2 else "x", "a": "1"} for i in range(20)])
    with pytest.raises(ConfigError, match=r"rows 1, 3, 5, 7, 9 and 5 more of .* are empty"):
        load_prompts(DataConfig(path=str(wide), prompt_key="q", answer_key="a", reward_fn=REWARD), 0)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "x"}], "answer": "1"}])
    with pytest.raises(ConfigError, match=r"tokenizer 'no-template' has none"):  # messages need a chat template
        load_prompts(DataConfig(path=str(chat), prompt_key="messages", reward_fn=REWARD), 0, NoTemplate(tok))


class NoTemplate:
    """The tiny tokenizer without its chat template."""

    chat_template = None

    def __init__(self, tok):
        self.tok, self.bos_token_id, self.name_or_path = tok, tok.bos_token_id, "no-template"

    def __call__(self, *args, **kw):
        return self.tok(*args, **kw)


# ------------------------------------------------------------------------------------ the reward function's columns


def keyword_columns(prompts, completions, answers, level, source="none"):
    return [float(lv) + (0.5 if source == "none" else 0.0) for lv in level]


def trl_style(completions, answer, **kwargs):  # as TRL calls reward functions: everything by name
    assert set(kwargs) >= {"prompts", "question", "level"} and "completions" not in kwargs
    return [float(c == a.removeprefix("#### ")) for c, a in zip(completions, answer)]


def per_sample_columns(prompt, completion, answer, level):
    return float(level)


def every_column(prompts, completions, answers, **kwargs):
    return [float(len(kwargs))] * len(completions)


def test_the_reward_function_receives_the_other_columns(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", rows("r", 3))
    records = load_prompts(data(f), 0)
    columns = reward_columns(records)
    assert set(columns) == {"question", "answer", "level"} and columns["level"] == [0, 1, 2]
    args = ([r["prompt"] for r in records], ["1", "2", "9"], [r["answer"] for r in records])
    assert as_batched(keyword_columns)(*args, columns) == [0.5, 1.5, 2.5]
    assert as_batched(trl_style)(*args, columns) == [1.0, 1.0, 0.0]
    assert as_batched(per_sample_columns)(*args, columns) == [0.0, 1.0, 2.0]
    assert as_batched(every_column)(*args, columns) == [3.0] * 3  # prompts/answers/completions are not columns
    today = as_batched(lambda prompts, completions, answers: [1.0] * len(completions))
    assert today(*args) == today(*args, columns) == [1.0] * 3  # unchanged, with or without columns
    assert reward_columns([{"prompt": "p", "answer": "a"}]) == {"prompt": ["p"], "answer": ["a"]}  # a task's rows


def test_a_column_the_dataset_lacks_is_refused_before_any_work(tmp_path, monkeypatch):
    f = write_jsonl(tmp_path / "p.jsonl", rows("r", 2))
    module = tmp_path / "my_rewards.py"
    module.write_text("def wants_solution(prompts, completions, answers, solution):\n    return [0.0] * len(answers)\n"
                      "def two_args(prompts, answers):\n    return []\n")
    with pytest.raises(ConfigError, match=r"dsrl.data.reward_fn = '.*my_rewards.py:wants_solution' takes the parameter "
                                          r"'solution', naming no column of dsrl.data.path = .* \(columns: question, "
                                          r"answer, level\)"):
        load_reward_fn(DataConfig(path=str(f), reward_fn=f"{module}:wants_solution"))
    with pytest.raises(ConfigError, match=r"two_args' takes \(prompts, answers\): a reward function takes"):
        load_reward_fn(DataConfig(path=str(f), reward_fn=f"{module}:two_args"))


# ------------------------------------------------------------------------------------ nothing cut silently


def test_a_prompt_longer_than_the_bound_is_refused_or_counted(tmp_path, tok, caplog):
    long = "add: " + "1+" * 60 + "1 ="  # 128 characters: one token each with the tiny tokenizer, plus bos
    f = write_jsonl(tmp_path / "long.jsonl", [{"q": long, "a": "61"}, {"q": "add: 1+1 =", "a": "2"}] * 2)
    cfg = DataConfig(path=str(f), prompt_key="q", answer_key="a", reward_fn=REWARD)  # max_prompt_tokens 64
    with pytest.raises(ConfigError, match=r"2 of the 4 prompts of dsrl.data.path = .* are longer than "
                                          r"dsrl.data.max_prompt_tokens = 64 tokens as the model sees them \(rows 0, "
                                          r"2; the longest has 129\).*Fix: set dsrl.data.max_prompt_tokens to at least "
                                          r"129, or dsrl.data.prompt_truncation to 'left'"):
        load_prompts(cfg, 0, tok)
    assert len(load_prompts(cfg.model_copy(update={"max_prompt_tokens": 129}), 0, tok)) == 4  # fits exactly
    left = DataConfig(path=str(f), prompt_key="q", answer_key="a", reward_fn=REWARD, prompt_truncation="left")
    with caplog.at_level(logging.WARNING, logger="dsrl.data"):
        records = load_prompts(left, 0, tok)
    assert [r.getMessage().count("2 of the 4 prompts") for r in caplog.records] == [1]  # warned once, with the count
    source = PromptSource(records, PromptSampler(4, 4), tok, left)
    _, ids = source.encode([0, 1, 2, 3])
    assert [len(x) for x in ids] == [64, 11, 64, 11] and ids[0][0] == tok.bos_token_id
    assert source.take_truncated() == 2 and source.take_truncated() == 0  # per rollout
    source.encode([1])
    assert source.take_truncated() == 0
    task = DataConfig(task="add", max_prompt_tokens=4)  # a task's prompts are measured the same way
    with pytest.raises(ConfigError, match=r"prompts of the built-in task 'add' are longer"):
        load_prompts(task, 0, tok)
    assert read_rows(DatasetSource(str(f))).num_rows == 4
