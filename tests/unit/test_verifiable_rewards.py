"""The built-in verifiable rewards ``math`` and ``exact``: final-answer extraction, math-verify's equivalence, GSM8K
answer columns, wrong and empty answers, and bounds that hold on pathological input, on any thread."""

from __future__ import annotations

import math
import signal
import threading
import time

import pytest

import dsrl.tasks
from dsrl.config import ConfigError, DataConfig
from dsrl.rl.rewards.functions import load_accuracy_fn, load_reward_fn
from dsrl.tasks import verifiable
from dsrl.tasks.answers import final_answer, normalize

needs_math_verify = pytest.mark.skipif(not verifiable.has_math_verify(), reason='needs pip install -e ".[math]"')
GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                  "altogether in April and May.\n#### 72")
HOSTILE = "\\boxed{9^{9^{9^{9}}}}"  # math-verify without a bound runs for minutes on it (measured: > 300 s)


# ------------------------------------------------------------------------------------ final answers


@pytest.mark.parametrize("text,found", [
    ("so \\boxed{\\frac{1}{2}} and", "\\frac{1}{2}"),
    ("first \\boxed{3}, then \\boxed{a{b{c}}d}", "a{b{c}}d"),  # the last box, nested braces
    ("\\boxed{7} then cut off \\boxed{12", "7"),  # an unclosed box (cut by the token limit) is skipped
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not nest
    ("work... \\fbox{42}", "42"),
    ("lots of work\n#### 72", "72"),
    ("x\n####   $1,200 dollars.\nmore", "1,200"),  # a leading number alone, currency and unit dropped
    ("#### 3x+2", "3x+2"),
    ("#### 50%", "50"),
    ("the answer is 1,234.", "1,234"),  # else the last number
    ("between -3.5 and 3/4", "3/4"),
    ("no digits here", None),
    ("", None),
])
def test_final_answer_of_a_completion(text, found):
    assert final_answer(text) == found


def test_final_answer_of_an_answer_column_and_normal_form():
    assert final_answer(GSM8K_SOLUTION, fallback="text") == "72"
    assert final_answer("\\frac{1}{2}", fallback="text") == "\\frac{1}{2}"  # a bare answer is the whole text
    assert final_answer("  Paris ", fallback="text") == "Paris"
    assert normalize("  The   ANSWER\u00a0is Paris. ") == "the answer is paris"


def test_extraction_is_linear_on_hostile_text():
    for text in ("\\boxed{" * 50_000, "{" * 200_000 + "\\boxed{1}", "1," * 100_000 + "x", "#" * 100_000):
        start = time.monotonic()
        final_answer(text)
        assert time.monotonic() - start < 2.0  # quadratic would be minutes at these lengths


# ------------------------------------------------------------------------------------ math


@needs_math_verify
def test_math_reward_equivalent_forms_gsm8k_columns_wrong_and_empty():
    cases = [  # (completion, answer column, reward)
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # fraction = decimal
        ("so it is 1/2", "\\frac12", 1.0),
        ("#### 1,234", "1234", 1.0),  # thousands separator
        ("we get 1234.", "#### 1,234", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # symbolic
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{18.00}", "18", 1.0),
        ("\\boxed{1{,}000}", "1000", 1.0),
        ("\\boxed{\\$18}", "18", 1.0),
        ("Natalia sold 72 clips.\n#### 72", GSM8K_SOLUTION, 1.0),  # a whole GSM8K solution as the answer column
        ("She sold 24 + 48 = 72 clips in total.", GSM8K_SOLUTION, 1.0),  # the last number
        ("I think 3", 3, 1.0),  # a numeric answer column
        ("I think 3", 3.0, 1.0),
        ("\\boxed{-5}", "-5", 1.0),
        ("\\boxed{5}", "-5", 0.0),  # wrong answers
        ("\\boxed{5}", "6", 0.0),
        ("#### 71", GSM8K_SOLUTION, 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("", "5", 0.0),  # empty completion
        ("no number at all", "5", 0.0),
        ("\\boxed{5}", "", 0.0),  # no gold answer
        ("\\boxed{5}", None, 0.0),
    ]
    got = dsrl.tasks.math_reward(["p"] * len(cases), [c for c, _, _ in cases], [a for _, a, _ in cases])
    assert got == [r for _, _, r in cases]
    assert verifiable.math_reward.batched is True and dsrl.tasks.exact_reward.batched is True


@needs_math_verify
def test_math_reward_through_the_run_file_and_accuracy_is_the_same_function():
    cfg = DataConfig(path="p.jsonl", reward_fn="math")
    reward, accuracy = load_reward_fn(cfg), load_accuracy_fn(cfg)
    args = (["p", "p"], ["#### 72", "\\boxed{70}"], [GSM8K_SOLUTION, GSM8K_SOLUTION])
    assert reward(*args) == accuracy(*args) == [1.0, 0.0]
    assert reward(*args, {"question": ["q", "q"]}) == [1.0, 0.0]  # columns are not passed to it


@needs_math_verify
def test_pathological_input_stays_within_its_bound():
    """The child's own timer stops a slow comparison; the sample scores 0.0 and the others are still checked."""
    start = time.monotonic()
    got = verifiable.math_reward(["p"] * 3, ["\\boxed{4}", HOSTILE, "#### 7"], ["4", "1", "7"], timeout_s=1.0)
    assert got == [1.0, 0.0, 1.0]
    assert time.monotonic() - start < 1.0 + 8.0  # the bound, plus starting the checker process on a loaded machine


@needs_math_verify
def test_a_comparison_no_signal_stops_is_ended_by_killing_the_checker():
    """Without the child's timer (as for C code that never returns to the interpreter) the parent kills the child at
    the bound and goes on with a fresh one."""
    checker = verifiable.MathVerifier(soft_fraction=None)
    try:
        assert checker.equivalent([("1", "1")], 5.0) == [True]  # started
        start = time.monotonic()
        got = checker.equivalent([("1", "9^{9^{9^{9}}}"), ("2", "2"), ("1", "9^{9^{9^{10}}}")], timeout_s=0.5)
        took = time.monotonic() - start
        assert got == [False, True, False] and checker.late == 2
        assert took < 2 * 0.5 + 2 * 8.0  # two bounds plus two restarts
    finally:
        checker.close()


@needs_math_verify
def test_the_bound_holds_off_the_main_thread():
    """math-verify's own timeouts raise off the main thread; the checker process bounds every thread alike."""
    out: list = []
    hostile = "\\boxed{8^{8^{8^{8}}}}"  # not compared before (equal pairs are compared once per process)
    worker = threading.Thread(target=lambda: out.append(verifiable.math_reward(
        ["p", "p"], [hostile, "\\boxed{2}"], ["1", "2"], timeout_s=1.0)))
    start = time.monotonic()
    worker.start()
    worker.join(30)
    took = time.monotonic() - start
    assert out == [[0.0, 1.0]] and 0.5 < took < 1.0 + 8.0


@needs_math_verify
def test_reward_timeout_s_bounds_a_whole_call_and_the_checker_survives_it():
    fn = load_reward_fn(DataConfig(path="p.jsonl", reward_fn="math", reward_timeout_s=0.5))
    start = time.monotonic()
    got = fn(["p"] * 4, [HOSTILE.replace("9}", f"{k}}}") for k in range(4)], ["1"] * 4)
    assert all(math.isnan(v) for v in got) and fn.take_timeouts() == 4  # masked and counted
    assert time.monotonic() - start < 0.5 + 2.0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no timer left behind
    assert fn(["p"], ["\\boxed{3}"], ["3"]) == [1.0]  # the interrupted checker was replaced


def test_math_without_math_verify_names_the_extra(monkeypatch):
    monkeypatch.setattr(verifiable, "has_math_verify", lambda: False)
    with pytest.raises(ConfigError, match=r"dsrl.data.reward_fn = 'math'.*math-verify.*pip install -e \"\.\[math\]\""):
        load_reward_fn(DataConfig(path="p.jsonl", reward_fn="math"))
    checker = verifiable.MathVerifier()
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[math\]\""):
        checker.equivalent([("1", "1")])
    assert load_reward_fn(DataConfig(path="p.jsonl", reward_fn="exact"))(["p"], ["a"], ["a"]) == [1.0]


# ------------------------------------------------------------------------------------ exact


def test_exact_reward_normalized_match():
    completions = ["Paris.", "\\boxed{ paris }", "london", "#### PARIS", "", "The answer is Paris"]
    got = dsrl.tasks.exact_reward(["p"] * 6, completions, ["paris", "#### Paris", "Paris", "Paris", "Paris", "Paris"])
    assert got == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert dsrl.tasks.exact_reward(["p"] * 3, ["42", "42", "x"], [42, 42.5, None]) == [1.0, 0.0, 0.0]
    acc = load_accuracy_fn(DataConfig(path="p.jsonl", reward_fn="exact"))
    assert acc(["p"], ["Paris"], ["paris"]) == [1.0]
