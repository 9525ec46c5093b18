"""GSM8K with a Python tool (`gsm8k_python`): the model may run code before it answers.

A turn ends at end-of-sequence. A turn with a ```python code block is a tool call: the last
block runs in the sandbox (`pipeline.envs.sandbox`, a fresh interpreter each call, so no
state carries over) and its output comes back inside <output> tags. A turn without one is
the final answer, scored by the GSM8K verifier (strict: it wants `#### N`).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pipeline.envs.sandbox import SandboxLimits, SandboxResult, run_python
from pipeline.envs.types import Environment, Episode, StepResult
from pipeline.rewards.gsm8k import reward_fn

# the last block wins; an unclosed block at the end of the turn still counts (the model
# may stop right after the code)
_CODE_BLOCK = re.compile(r"```python[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)

INSTRUCTION = (
    "\nYou can run Python: write a ```python code block and end your turn; its output "
    "comes back in <output> tags. When you know the answer, reply without code and end "
    "with '#### <number>'.\n"
)


def observation(text: str) -> str:
    """The tool's answer as the policy sees it; the tags let it tell output from its own text."""
    return f"\n<output>\n{text}\n</output>\n"


class PythonToolEnv(Environment):
    """Options: `timeout_s`, `memory_mb`, `max_output_chars` (of each call's output, kept
    from the end for errors), `max_calls` per episode (calls after that are answered with a
    notice, as tool errors), `instruction` (reset returns INSTRUCTION instead of "").
    A step may take `timeout_s` plus a process start: keep the pool's step timeout above it."""

    # no stop strings: a turn ends at end-of-sequence. "```" cannot be one: it would end the
    # turn at a block's opening fence, before the code, and the driver wants one-token stop
    # strings (it is three for the char tokenizer). The last block runs even when unclosed.
    stop: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        timeout_s: float = SandboxLimits.timeout_s,
        memory_mb: int = SandboxLimits.memory_mb,
        max_output_chars: int = SandboxLimits.max_output_chars,
        max_calls: int = 4,
        instruction: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.limits = SandboxLimits(
            timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars
        )
        self.max_calls = max_calls
        self.instruction = instruction
        self.calls = 0
        self.ground_truth = ""
        self.data_source = ""

    def reset(self, episode: Episode) -> str:
        self.ground_truth, self.data_source = episode.ground_truth, episode.data_source
        return INSTRUCTION if self.instruction else ""

    def step(self, action: str) -> StepResult:
        blocks = _CODE_BLOCK.findall(action)
        if not blocks:
            reward = reward_fn(self.data_source, action, self.ground_truth, None)
            return StepResult(reward=reward, done=True)
        self.calls += 1
        if self.calls > self.max_calls:
            notice = f"Tool call limit reached ({self.max_calls}); give the final answer."
            return StepResult(observation=observation(notice), tool_call=True, tool_error=True)
        result = run_python(blocks[-1], self.limits)
        return StepResult(
            observation=observation(self._output_text(result)),
            tool_call=True,
            tool_error=not result.ok,
        )

    def _output_text(self, result: SandboxResult) -> str:
        stdout = result.stdout.rstrip("\n")
        if result.stdout_truncated:
            stdout += "\n[output truncated]"
        if result.ok:
            return stdout
        if result.timed_out:
            error = f"TimeoutError: the code ran past its {self.limits.timeout_s:g} s limit"
        else:
            error = result.stderr.strip() or f"exited with status {result.exit_code}"
        text = f"{stdout}\n{error}" if stdout else error
        # the error's last lines say what went wrong: keep the end
        return text[-self.limits.max_output_chars :]
