"""What rollout and policy both need, below both: models and tokenizers, the legacy batch, column names.

Modules: ``models`` (``load_model`` / ``load_tokenizer``, the offline tiny model and its tokenizer),
``batched_data_dict`` (``BatchedDataDict``, the legacy path's driver-side batch) and ``fields`` (the
per-sample column names both data paths share). This package imports nothing of ``tq``, ``rollout``,
``policy`` or ``trainer`` (tests/test_architecture.py enforces it).
"""
