"""The GSM8K-with-Python environment: code blocks run as tool calls, a turn without code is
the final answer scored by the GSM8K verifier, and the calls limit holds."""

from __future__ import annotations

from pipeline.envs.pool import EnvPool
from pipeline.envs.python_tool import INSTRUCTION, PythonToolEnv
from pipeline.envs.registry import resolve
from pipeline.envs.types import Episode

EPISODE = Episode(
    uid="u0",
    prompt_text="Janet has 16 eggs, eats 3, bakes with 4 and sells the rest at $2. How much?",
    ground_truth="16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18",
    data_source="openai/gsm8k",
)


def started(**options: object) -> PythonToolEnv:
    env = PythonToolEnv(**options)
    env.reset(EPISODE)
    return env


def test_code_block_runs_and_its_output_comes_back() -> None:
    env = started()
    action = "First a guess:\n```python\nprint(1)\n```\nNo, better:\n```python\nprint((16 - 3 - 4) * 2)\n```"
    result = env.step(action)
    assert result.observation == "\n<output>\n18\n</output>\n"  # the last block ran
    assert result.tool_call and not result.tool_error
    assert (result.done, result.reward) == (False, 0.0)


def test_unclosed_block_at_the_end_still_runs() -> None:
    result = started().step("```python\nprint(6 * 7)\n")
    assert (result.observation, result.tool_call) == ("\n<output>\n42\n</output>\n", True)


def test_failing_code_is_a_tool_error_with_the_error_tail() -> None:
    env = started(max_output_chars=200)
    result = env.step("```python\nprint('partial')\n1 / 0\n```")
    assert result.tool_call and result.tool_error and not result.done
    assert result.observation.startswith("\n<output>\npartial\n")
    assert result.observation.endswith("ZeroDivisionError: division by zero\n</output>\n")


def test_timeout_is_a_tool_error() -> None:
    env = started(timeout_s=0.5)
    result = env.step("```python\nwhile True:\n    pass\n```")
    assert result.tool_error and "TimeoutError" in result.observation


def test_right_final_answer_scores_one() -> None:
    result = started().step("She sells 9 eggs at $2 each.\n#### 18")
    assert (result.done, result.reward, result.tool_call) == (True, 1.0, False)


def test_wrong_final_answer_scores_zero() -> None:
    result = started().step("She sells 8 eggs at $2 each.\n#### 16")
    assert (result.done, result.reward) == (True, 0.0)


def test_calls_limit() -> None:
    env = started(max_calls=2)
    for _ in range(2):
        assert env.step("```python\nprint(2 + 2)\n```").observation == "\n<output>\n4\n</output>\n"
    over = env.step("```python\nprint(2 + 2)\n```")
    assert over.tool_call and over.tool_error and not over.done
    assert "limit reached" in over.observation and "\n4\n" not in over.observation
    assert env.step("#### 18").reward == 1.0  # the answer still counts


def test_reset_text() -> None:
    assert PythonToolEnv().reset(EPISODE) == ""
    assert PythonToolEnv(instruction=True).reset(EPISODE) == INSTRUCTION


def test_registered_by_name() -> None:
    assert resolve("gsm8k_python") is PythonToolEnv


async def test_runs_in_an_environment_worker() -> None:
    pool = EnvPool("gsm8k_python", options={"max_calls": 1})
    try:
        assert await pool.open(EPISODE) == ""
        call = await pool.step(EPISODE.uid, "```python\nprint(9 * 2)\n```")
        assert (call.observation, call.tool_call) == ("\n<output>\n18\n</output>\n", True)
        answer = await pool.step(EPISODE.uid, "#### 18")
        assert (answer.done, answer.reward) == (True, 1.0)
        await pool.close_episode(EPISODE.uid, cancelled=False)
    finally:
        pool.close()
