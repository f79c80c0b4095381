"""Models, DP training workers, the legacy and TQ policies, losses and micro-batching."""
