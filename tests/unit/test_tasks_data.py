"""Tiny tokenizer, built-in tasks, prompt files, reward functions, prompt sampler, prompt encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrl.config import ConfigError, DataConfig, ModelConfig, load_config
from dsrl.core.plan import BatchPlan
from dsrl.rl.data.prompts import PromptSampler, dataset_size, encode_prompts, load_prompts, rollouts_for_epochs
from dsrl.rl.policy.tokenizer import TINY_TOKENIZER_PATH, load_tokenizer
from dsrl.rl.rewards.functions import as_batched, load_accuracy_fn, load_reward_fn
from dsrl.tasks import TASKS, get_task, partial_match_reward

DATA = Path(__file__).resolve().parents[1] / "data"
JSONL = str(DATA / "prompts.jsonl")
PARQUET = str(DATA / "prompts.parquet")
FIXTURE = str(DATA / "reward_fixture.py")
REWARD = "reward_fixture:exact_batched"  # a file needs a reward_fn; only its presence is checked here


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


# ------------------------------------------------------------------------------------ tokenizer


def test_tiny_tokenizer_loads_offline_with_auto_tokenizer(monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = AutoTokenizer.from_pretrained(TINY_TOKENIZER_PATH, local_files_only=True)
    assert (t.pad_token, t.bos_token, t.eos_token, t.unk_token) == ("<pad>", "<s>", "</s>", "<unk>")
    assert (t.pad_token_id, t.bos_token_id, t.eos_token_id, t.unk_token_id) == (0, 1, 2, 3)
    assert t.padding_side == "left"
    right = AutoTokenizer.from_pretrained(TINY_TOKENIZER_PATH, padding_side="right")
    assert right(["a", "abc"], padding=True)["input_ids"][0] == [1, right.convert_tokens_to_ids("a"), 0, 0]


def test_tokenizer_round_trips_task_strings(tok):
    assert len(tok) == 74
    for task in TASKS.values():
        for ex in task.make_prompts(50, 3):
            for text in (ex["prompt"], ex["answer"], ex["prompt"] + " " + ex["answer"]):
                ids = tok(text)["input_ids"]
                assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
                assert len(ids) == len(text) + 1  # one token per character
                assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok("x</s><pad>", add_special_tokens=False)["input_ids"], skip_special_tokens=True) == "x"
    assert tok("A")["input_ids"] == [1, tok.unk_token_id]


def test_load_tokenizer_settings(tmp_path):
    t = load_tokenizer(ModelConfig())
    assert t.padding_side == "left" and t.pad_token_id == 0
    # A tokenizer without a pad token gets eos as pad.
    src = json.loads((Path(TINY_TOKENIZER_PATH) / "tokenizer_config.json").read_text())
    src.pop("pad_token")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(src))
    (tmp_path / "tokenizer.json").write_text((Path(TINY_TOKENIZER_PATH) / "tokenizer.json").read_text())
    t2 = load_tokenizer(ModelConfig(tokenizer=str(tmp_path)))
    assert t2.pad_token == "</s>" and t2.padding_side == "left"
    with pytest.raises(ConfigError, match="dsrl.model.path"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "missing")))


# ------------------------------------------------------------------------------------ tasks


def test_tasks_are_deterministic_and_well_formed():
    assert get_task("reverse").make_prompts(3, 0) == get_task("reverse").make_prompts(3, 0)
    for name, task in TASKS.items():
        a, b = task.make_prompts(40, 7), task.make_prompts(40, 7)
        assert a == b and task.make_prompts(10, 7) == a[:10]
        assert task.make_prompts(40, 8) != a
        for ex in a:
            assert set(ex) == {"prompt", "answer"} and ex["prompt"].startswith(name + ": ")
            assert task.reward(ex["prompt"], ex["answer"], ex["answer"]) == 1.0
            assert task.accuracy(ex["prompt"], " " + ex["answer"] + "\n", ex["answer"]) == 1.0
    ex = get_task("reverse").make_prompts(20, 0)
    assert all(e["answer"] == e["prompt"][len("reverse: "):-2][::-1] for e in ex)
    assert all(1 <= len(e["answer"]) <= 3 and set(e["answer"]) <= set("abcde") for e in ex)
    add = get_task("add").make_prompts(20, 0)
    assert all(int(e["answer"]) == eval(e["prompt"][5:-2]) for e in add)  # noqa: S307 - digits and '+'


def test_reward_partial_credit_ordering():
    task = get_task("reverse")
    p, a = "reverse: abc =", "cba"
    scores = [task.reward(p, c, a) for c in ("cba", "cbaxx", "cbx", "cxx", "abc", "xxx", "", "x" * 16)]
    assert scores[0] == 1.0
    assert all(0.0 <= s <= 1.0 for s in scores)
    # exact > right characters but too long > one wrong > two wrong > none right
    assert scores[0] > scores[1] > scores[2] > scores[3] > scores[5] >= scores[6]
    # letters of the answer in the wrong place earn more than foreign letters
    assert scores[4] > scores[5]
    assert scores[7] == 0.0
    assert [task.accuracy(p, c, a) for c in ("cba", " cba ", "cbaa", "")] == [1.0, 1.0, 0.0, 0.0]
    # Hand values: "cbx" = 0.75 * (2 / 3) + 0.25 * 1 = 0.75; "cbaxx" = 0.75 * 1 + 0.25 * (1 - 2/3).
    assert task.reward(p, "cbx", a) == pytest.approx(0.75)
    assert task.reward(p, "cbaxx", a) == pytest.approx(0.75 + 0.25 / 3)
    assert partial_match_reward("", "") == 1.0


def test_unknown_task_names_field():
    with pytest.raises(ConfigError, match="dsrl.data.task"):
        get_task("sort")


# ------------------------------------------------------------------------------------ data sources


def test_task_prompts_and_size():
    cfg = DataConfig(task="copy", size=30)
    prompts = load_prompts(cfg, seed=5)
    assert dataset_size(cfg) == len(prompts) == 30
    assert prompts == get_task("copy").make_prompts(30, 5) == load_prompts(cfg, seed=5)
    assert load_prompts(cfg, seed=6) != prompts


@pytest.mark.parametrize("path,prompt_key,answer_key", [(JSONL, "question", "solution"), (PARQUET, "text", "answer")])
def test_file_prompts(path, prompt_key, answer_key):
    cfg = DataConfig(task=None, path=path, prompt_key=prompt_key, answer_key=answer_key, reward_fn=REWARD)
    prompts = load_prompts(cfg, seed=0)
    assert dataset_size(cfg) == len(prompts) == 5
    assert {k: prompts[0][k] for k in ("prompt", "answer")} == {"prompt": "copy: ab =", "answer": "ab"}
    assert {k: prompts[4][k] for k in ("prompt", "answer")} == {"prompt": "add: 9+9 =", "answer": "18"}
    assert prompts[0]["columns"][prompt_key] == "copy: ab =" and prompts[0]["columns"][answer_key] == "ab"


def test_json_array_file(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"prompt": "copy: a =", "answer": "a"}, {"prompt": "copy: b =", "answer": "b"}]))
    assert load_prompts(DataConfig(path=str(f), reward_fn=REWARD), 0)[1] == {
        "prompt": "copy: b =", "answer": "b", "columns": {"prompt": "copy: b =", "answer": "b"}}


def test_data_errors_name_the_field(tmp_path):
    # Rules on the settings alone are DataConfig's (raised when it is built); data.py checks the files.
    with pytest.raises(ConfigError, match=r"dsrl.data.task = 'reverse' and dsrl.data.path"):
        DataConfig(task="reverse", path=JSONL, reward_fn=REWARD)
    with pytest.raises(ConfigError, match=r"dsrl.data.path = .*unsupported file type '.csv'"):
        DataConfig(task=None, path=str(tmp_path / "p.csv"), reward_fn=REWARD)
    with pytest.raises(ConfigError, match=r"dsrl.data.size"):
        DataConfig(task="add", size=0)
    assert DataConfig(task=None).task == "reverse"  # no source given: the built-in default task
    with pytest.raises(ConfigError, match=r"dsrl.data.path = .*no such file"):
        dataset_size(DataConfig(task=None, path=str(tmp_path / "nope.jsonl"), reward_fn=REWARD))
    with pytest.raises(ConfigError, match=r"dsrl.data.prompt_key = 'prompt': no such column .*question"):
        load_prompts(DataConfig(task=None, path=JSONL, reward_fn=REWARD), 0)
    with pytest.raises(ConfigError, match=r"dsrl.data.answer_key = 'answer'"):
        load_prompts(DataConfig(task=None, path=JSONL, prompt_key="question", reward_fn=REWARD), 0)
    with pytest.raises(ConfigError, match=r"dsrl.data.prompt_key = 'id': rows 0, 1, 2, 3, 4 of .* hold neither"):
        load_prompts(DataConfig(task=None, path=JSONL, prompt_key="id", answer_key="solution", reward_fn=REWARD), 0)


# ------------------------------------------------------------------------------------ rewards


def test_task_reward_and_accuracy_fns():
    cfg = DataConfig(task="reverse")
    reward, acc = load_reward_fn(cfg), load_accuracy_fn(cfg)
    assert reward(["p", "p", "p"], ["cba", "cbx", "zzz"], ["cba"] * 3) == pytest.approx([1.0, 0.75, 0.25])
    assert acc(["p", "p"], ["cba", "cbx"], ["cba", "cba"]) == [1.0, 0.0]
    assert load_accuracy_fn(DataConfig(task=None, path=JSONL, reward_fn=REWARD)) is None


def test_reward_fn_dotted_paths(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA))
    args = (["p1", "p2"], ["ab", " cde"], ["ab", "xx"])
    for spec in ("reward_fixture:exact_batched", "reward_fixture.exact_batched", f"{FIXTURE}:exact_batched"):
        fn = load_reward_fn(DataConfig(task=None, path=JSONL, reward_fn=spec))
        assert fn(*args) == [1.0, 0.0]
    per_sample = load_reward_fn(DataConfig(task="copy", reward_fn="reward_fixture:length_per_sample"))
    assert per_sample(*args) == [1 / 3, 1 / 5]


def test_reward_fn_errors_name_the_field(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA))
    bad = {
        "no_such_module_xyz:f": "cannot import 'no_such_module_xyz'",
        "reward_fixture:missing": "has no attribute 'missing'",
        "reward_fixture:NOT_CALLABLE": "not a function",
        "justaname": "not a dotted path",
    }
    for spec, msg in bad.items():
        with pytest.raises(ConfigError, match=rf"dsrl.data.reward_fn = '{spec}'.*{msg}"):
            load_reward_fn(DataConfig(task=None, path=JSONL, reward_fn=spec))
    fn = load_reward_fn(DataConfig(task=None, path=JSONL, reward_fn="reward_fixture:wrong_length"))
    with pytest.raises(ConfigError, match="dsrl.data.reward_fn.*returned 1 rewards for 2"):
        fn(["a", "b"], ["a", "b"], ["a", "b"])
    with pytest.raises(ConfigError, match="reward_fn, dsrl.data.reward_model and dsrl.data.environment are unset"):
        DataConfig(task=None, path=JSONL)


def test_as_batched_marker():
    def score(p, c, a):
        return float(c == a)

    score.batched = False
    assert as_batched(score)(["x", "y"], ["a", "b"], ["a", "a"]) == [1.0, 0.0]


# ------------------------------------------------------------------------------------ sampler


def test_sampler_deterministic_and_covers_each_epoch():
    n, p = 10, 4
    a, b = PromptSampler(n, p, seed=3), PromptSampler(n, p, seed=3)
    draws = [a.next_indices() for _ in range(10)]
    assert draws == [b.next_indices() for _ in range(10)]
    assert all(len(d) == p for d in draws)
    stream = [i for d in draws for i in d]  # 40 indices = 4 full passes
    for e in range(4):
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    assert stream[:n] != stream[n:2 * n]  # each pass reshuffled
    assert PromptSampler(n, p, seed=4).permutation(0) != PromptSampler(n, p, seed=3).permutation(0)
    assert a.prompt_epochs == 4.0 and a.rollouts == 10


def test_sampler_more_prompts_per_rollout_than_dataset():
    s = PromptSampler(3, 7, seed=0)
    d = s.next_indices() + s.next_indices() + s.next_indices()  # 21 indices = 7 passes
    assert len(d) == 21 and all(sorted(d[i:i + 3]) == [0, 1, 2] for i in range(0, 21, 3))


def test_sampler_resume_is_exact():
    ref = PromptSampler(13, 5, seed=11)
    full = [ref.next_indices() for _ in range(12)]
    s = PromptSampler(13, 5, seed=11)
    for _ in range(7):
        s.next_indices()
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON round trip
    resumed = PromptSampler(13, 5, seed=11)
    resumed.load_state_dict(state)
    assert [resumed.next_indices() for _ in range(5)] == full[7:]
    with pytest.raises(ConfigError, match="num_prompts"):
        PromptSampler(14, 5, seed=11).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed"):
        PromptSampler(13, 5, seed=12).load_state_dict(state)


@pytest.mark.parametrize("rule", ["drop", "wrap"])
@pytest.mark.parametrize("epochs,n,p", [(1, 10, 4), (2, 10, 4), (1.5, 7, 3), (1, 8, 4), (3, 5, 8), (0.5, 100, 7)])
def test_rollouts_match_plan(rule, epochs, n, p):
    raw = {"dsrl": {"batch": {"prompts_per_rollout": p, "samples_per_prompt": 2, "micro_batch_size_per_rank": 1},
                    "run": {"epochs": epochs, "last_rollout": rule}}}
    want = rollouts_for_epochs(epochs, n, p, rule)
    if want < 1:
        return
    plan = BatchPlan.from_config(load_config(raw), 1, dataset_size=n)
    assert plan.rollouts == want == PromptSampler(n, p, 0, rule).rollouts_for_epochs(epochs)
    # 'drop' never draws a prompt more than ceil(epochs) times; 'wrap' draws every prompt >= floor(epochs) times.
    s = PromptSampler(n, p, 0, rule)
    counts = [0] * n
    for _ in range(want):
        for i in s.next_indices():
            counts[i] += 1
    if rule == "drop":
        assert sum(counts) <= epochs * n
    else:
        assert sum(counts) >= epochs * n


def test_sampler_rejects_an_empty_dataset():
    # prompts_per_rollout and last_rollout are validated by the config (dsrl.batch / dsrl.run); the data is not.
    with pytest.raises(ConfigError, match="empty"):
        PromptSampler(0, 2)


# ------------------------------------------------------------------------------------ encoding


def test_encode_prompts_truncates_left_and_keeps_bos(tok):
    ids = encode_prompts(tok, ["reverse: abc =", "copy: a ="], max_prompt_tokens=64, chat_template=False)
    assert ids[0] == tok("reverse: abc =")["input_ids"] and ids[0][0] == tok.bos_token_id
    short = encode_prompts(tok, ["reverse: abc ="], max_prompt_tokens=6, chat_template=False)[0]
    assert len(short) == 6 and short[0] == tok.bos_token_id
    assert tok.decode(short, skip_special_tokens=True) == "abc ="
    chat = encode_prompts(tok, ["copy: a ="], max_prompt_tokens=64, chat_template=True)[0]
    assert tok.decode(chat) == "<s>user: copy: a =\nassistant:"
    chat_short = encode_prompts(tok, ["copy: a ="], max_prompt_tokens=12, chat_template=True)[0]
    assert tok.decode(chat_short) == "<s>\nassistant:"


def test_encode_prompts_without_bos_or_template(tok):
    class NoBos:
        bos_token_id = None
        chat_template = None
        name_or_path = "nobos"

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [[ord(c) for c in t] for t in texts]}

    assert encode_prompts(NoBos(), ["abcdef"], 3, False) == [[ord("d"), ord("e"), ord("f")]]
    with pytest.raises(ConfigError, match="dsrl.data.chat_template"):
        encode_prompts(NoBos(), ["abc"], 3, True)
    with pytest.raises(ValueError, match="no tokens"):
        encode_prompts(NoBos(), [""], 3, False)
