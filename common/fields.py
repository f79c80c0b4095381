"""Column names and conventions shared by the legacy and TQ paths (rollout, policy and trainers).

Per-sample columns, as stored in TQ under each key (and as the legacy ``BatchedDataDict`` holds them,
padded to a common length):

- ``input_ids``: int64, jagged ``[len]`` - the whole conversation (prompt, responses, observations).
- ``input_lengths``: int64 scalar - ``len``.
- ``generation_logprobs``: float32, jagged ``[len]`` - log-prob the generator gave token ``t`` at
  position ``t`` (0 where the token was not generated).
- ``token_mask``: bool, jagged ``[len]`` - True for tokens the policy generated (trained on).
- ``sample_mask``: float32 scalar - loss multiplier of the sample (0 drops it from the loss).
- ``prev_logprobs`` / ``reference_policy_logprobs``: float32, jagged ``[len]`` - written back by the
  DP workers; ``lp[t] = log p(input_ids[t] | input_ids[:t])`` and ``lp[0] = 0``.
- ``advantages``: float32 scalar - written by the driver; workers broadcast it over the tokens.
"""

from typing import Any

DP_TRAIN_FIELDS = (
    "input_ids",
    "input_lengths",
    "generation_logprobs",
    "prev_logprobs",
    "reference_policy_logprobs",
    "advantages",
    "token_mask",
    "sample_mask",
)
LP_SEED_FIELDS = ("input_ids", "input_lengths", "token_mask", "sample_mask")

# Per-token columns a per-sample reduction reads, and the per-sample columns it writes
# (workers compute them on the TQ path so the driver reads per-sample columns only).
REDUCTION_INPUT_FIELDS = ("prev_logprobs", "generation_logprobs", "token_mask")
PER_SAMPLE_REDUCTION_FIELDS = ("seq_logprob_error", "seq_mult_prob_error", "num_valid_tokens")

# Token-aligned (jagged) columns: bulk data the TQ driver must not read.
TOKEN_FIELDS = ("input_ids", "generation_logprobs", "token_mask", "prev_logprobs", "reference_policy_logprobs")


def tensor_nbytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in ``obj``: itself, the values of a mapping, the items of a list
    or tuple, nested (a jagged column is a list of tensors or a ``tq.JaggedTensor``). A sum of
    ``nbytes``, no serialization, so cheap enough to count every data-plane call. Anything else
    (objects, strings) counts 0."""
    if isinstance(obj, dict):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(tensor_nbytes(v) for v in obj) if obj and not isinstance(obj[0], (str, int, float)) else 0
    if hasattr(obj, "values") and hasattr(obj, "offsets"):  # tq.JaggedTensor: its values and row offsets
        return tensor_nbytes(obj.values) + tensor_nbytes(obj.offsets)
    n = getattr(obj, "nbytes", None)  # torch.Tensor and np.ndarray
    return int(n) if isinstance(n, int) else 0
