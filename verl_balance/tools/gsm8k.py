"""verl's example tool, a gsm8k answer checker (``calc_gsm8k_reward``), reimplemented.

``execute({"answer": "..."})`` scores ``#### <answer>`` against the sample's ``create_kwargs`` ground
truth with the gsm8k rule; step reward 0 unless the score dropped below the instance's best (then
-0.05, verl's retry penalty). ``calc_reward`` is the instance's last score.
"""

from __future__ import annotations

import uuid
from typing import Any

from verl_balance.rewards.gsm8k import score_gsm8k
from verl_balance.tools.base import BaseTool, ToolResponse

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k (1.0 if the answer is correct, 0.0 otherwise)",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The model's answer to the GSM8K math problem"}},
            "required": ["answer"],
        },
    },
}


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config or {}, tool_schema or SCHEMA)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth", kwargs.get("ground_truth"))
        self._instances[instance_id] = {"ground_truth": ground_truth, "answer": "", "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        state = self._instances[instance_id]
        answer = str(parameters.get("answer", ""))
        state["answer"] = answer if answer.startswith("#### ") else "#### " + answer
        previous = state["reward"]
        score = await self.calc_reward(instance_id)
        state["reward"] = score
        penalty = 0.0 if score >= previous else -0.05
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={score}"), penalty, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return float(score_gsm8k(solution_str=state["answer"], ground_truth=state["ground_truth"])["score"])

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)
