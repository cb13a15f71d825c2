"""Reinforcement learning: rollouts with the engine and weight sync from a trainer (TRL's GRPO)."""
