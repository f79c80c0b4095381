"""GRPO trainers: legacy driver-side batches (``trainer.grpo``) and the TQ path (``trainer.grpo_sync``)."""
