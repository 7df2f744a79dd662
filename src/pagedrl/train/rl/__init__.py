"""What the online algorithms share: rollouts from the engine, rewards, advantages, built-in tasks."""
