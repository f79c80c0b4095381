"""Generation backends, environments, rollouts, rollout actors and collectors."""
