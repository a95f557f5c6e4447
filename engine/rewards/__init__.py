"""Rewards: programs that score a model's answer to a prompt, for training by reward (GRPO).

A user picks built-in rewards (a regular expression, the row's reference answer, a JSON object, a length window)
or points to a Python file of their own, each with a weight; a run's total reward for an answer is the weighted
sum of the scores. This package is plain Python (no torch): the command line parses ``--reward`` with it, the app
builds and tries rewards with it, and training calls :func:`build_rewards` once and :func:`score_completions`
per step.

- engine.rewards.spec: :class:`RewardSpec` (what was chosen, saved in config.json), the :class:`Reward` protocol,
  :class:`RewardError`;
- engine.rewards.builtin: the built-in rewards and their settings;
- engine.rewards.user_file: a user's reward file, and the rule for where it may come from;
- engine.rewards.matching: the answer-to-reference comparison shared with the report's exact match;
- engine.rewards.build: :func:`build_rewards` and :func:`score_completions`;
- engine.rewards.flag: the ``--reward`` syntax (:func:`parse_reward_flag`).
"""

from engine.rewards.build import RewardScores, build_rewards, reward_names, score_completions
from engine.rewards.flag import USAGE, format_reward_flag, parse_reward_flag
from engine.rewards.spec import KINDS, Reward, RewardError, RewardKind, RewardSpec

__all__ = [
    "KINDS",
    "USAGE",
    "Reward",
    "RewardError",
    "RewardKind",
    "RewardScores",
    "RewardSpec",
    "build_rewards",
    "format_reward_flag",
    "parse_reward_flag",
    "reward_names",
    "score_completions",
]
