"""Prompt datasets: loading, the per-sample record (``DatumSpec``) and a resumable data loader.

- ``load_records(path)``: rows from a local JSONL / JSON file, a Parquet file (pyarrow), a directory
  of those, or a Hugging Face ``datasets`` dataset saved with ``save_to_disk``.
- ``PromptDataset``: records + tokenizer + ``DataProcessorConfig`` -> one ``DatumSpec`` per row.
  Every row is validated when the dataset is built, so a malformed row fails at start-up with its
  index and field named, not mid-training.
- ``StatefulDataLoader``: seeded shuffling per epoch, batches of ``DatumSpec``, and
  ``state_dict()`` / ``load_state_dict()`` that resume exactly where it stopped.

A ``DatumSpec``'s ``message_log`` is a list of messages ``{"role", "content", "token_ids"}``; the
concatenated ``token_ids`` are the model's input, and each message's ``content`` is the text its
tokens decode to (the chat-template rendering of that message, as NeMo-RL stores it).
"""

from __future__ import annotations

import json
import logging
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Mapping, Sequence, TypedDict

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from rollout.interfaces import Message


log = logging.getLogger(__name__)

#: Rows ``PromptDataset`` tokenizes at start-up to estimate how many prompts ``max_seq_length`` cuts.
_LENGTH_SAMPLE = 512


class DatasetError(ValueError):
    """A dataset row or file is malformed; the message names the row (or line) and the field."""


class DatumSpec(TypedDict):
    """One prompt, ready for rollout."""

    message_log: list[Message]  # {"role", "content", "token_ids": int64 tensor}; token_ids concatenate to the input
    length: int  # total number of prompt tokens (after truncation)
    extra_env_info: dict[str, Any]  # what the environment gets as metadata (e.g. ground_truth)
    loss_multiplier: float  # 0.0 when the prompt was longer than max_seq_length (then truncated)
    idx: int  # row index in the dataset
    task_name: str  # which environment scores it


class DataProcessorConfig(BaseModel):
    """How a dataset row becomes a ``DatumSpec``.

    The user message is, in order of precedence: the row's ``messages_key`` field (a list of
    ``{"role", "content"}`` messages), ``prompt_template.format(**row)``, or the row's
    ``prompt_key`` field. With ``use_chat_template`` the tokenizer's chat template renders the
    messages (with the assistant generation prompt); without it the prompt text is tokenized as is.
    ``extra_env_info`` gets ``ground_truth`` (from ``ground_truth_key``, stringified) and the fields
    in ``extra_env_keys``. ``task_name``: a fixed name, else the row's ``task_name`` field, else "default".
    """

    model_config = ConfigDict(extra="forbid")

    prompt_key: str = Field("prompt", description="Row field holding the prompt text.")
    prompt_template: str | None = Field(
        None, description=("Python format string over the row's fields for the user message (null: prompt_key's field)")
    )
    messages_key: str | None = Field(None, description="Row field holding a list of {role, content} messages (takes precedence)")
    system_prompt: str | None = Field(None, description="System message prepended to every conversation.")
    use_chat_template: bool = Field(True, description="Render messages with the tokenizer's chat template (else tokenize the prompt as is)")
    ground_truth_key: str | None = Field("ground_truth", description="Row field the environment scores against.")
    extra_env_keys: list[str] = Field(default_factory=list, description="More row fields passed to the environment.")
    max_seq_length: int = Field(
        default=1024, ge=1, description=("Prompt tokens at most (longer prompts are truncated and masked out of the loss)")
    )
    task_name: str | None = Field(None, description='Environment of every row (null: the row\'s task_name field, else "default")')


# ---------------------------------------------------------------------------------------- loading
def _read_text(path: Path) -> str:
    """The file as text: UTF-8 (a leading BOM is dropped); a bad byte is a ``DatasetError`` naming its line."""
    data = path.read_bytes()
    bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # written by some Windows tools
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        lineno = data[:at].count(b"\n") + 1
        raise DatasetError(
            f"{path}: line {lineno}: not UTF-8 text (byte 0x{data[at]:02x} at offset {at}); datasets must be UTF-8"
        ) from None


def _read_jsonl(path: Path, text: str | None = None) -> list[Any]:
    rows = []
    # split on "\n" only: str.splitlines would also split on U+2028 etc., which JSON allows inside strings
    for lineno, line in enumerate((_read_text(path) if text is None else text).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: line {lineno}: invalid JSON ({exc.msg})") from None
    return rows


def _read_json(path: Path) -> list[Any]:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path, text)  # many ".json" datasets are JSON lines
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON array of rows (or JSON lines), got {type(data).__name__}")
    return data


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:  # not Parquet, truncated, or corrupt
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        why = why.split(f"{path}': ", 1)[-1]  # pyarrow repeats the path the message already names
        raise DatasetError(f"{path}: not a readable Parquet file ({why})") from None


_READERS: dict[str, Callable[[Path], list[Any]]] = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def load_records(path: str | Path, *, split: str | None = None) -> list[dict[str, Any]]:
    """All rows of a local dataset as dicts.

    ``path`` is a ``.jsonl`` / ``.json`` / ``.parquet`` file, a directory written by
    ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``, then ``split`` picks one;
    default "train"), or a directory of ``.jsonl`` / ``.parquet`` files read in name order.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"dataset path does not exist: {p}")
    hf = p.is_dir() and any((p / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))
    if split is not None and not hf:  # it would be ignored: every row read, whatever split was asked for
        raise DatasetError(f"{p}: split={split!r} picks a split of a datasets save_to_disk directory; this is a plain file or folder")
    if hf:
        return _load_hf_from_disk(p, split)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in (".jsonl", ".parquet"))
        if not files:
            raise DatasetError(f"{p}: no .jsonl or .parquet files, and not a datasets save_to_disk directory")
        rows: list[Any] = []
        for f in files:
            rows += _READERS[f.suffix](f)
        return rows
    reader = _READERS.get(p.suffix)
    if reader is None:
        raise DatasetError(f"{p}: unsupported dataset file type {p.suffix!r} (use .jsonl, .json or .parquet)")
    return reader(p)


def _load_hf_from_disk(path: Path, split: str | None) -> list[dict[str, Any]]:
    try:
        from datasets import Dataset, DatasetDict, load_from_disk
    except ImportError as exc:
        raise ImportError(f"{path} is a Hugging Face datasets directory: pip install datasets") from exc
    ds = load_from_disk(str(path))
    if isinstance(ds, DatasetDict):
        name = split or "train"
        if name not in ds:
            raise DatasetError(f"{path}: no split {name!r}; available: {sorted(ds)}")
        ds = ds[name]
    elif split is not None:
        raise DatasetError(f"{path}: a single dataset has no splits, but split={split!r} was asked")
    assert isinstance(ds, Dataset)
    return ds.to_list()


# ---------------------------------------------------------------------------------------- processing
def _template_fields(template: str) -> list[str]:
    """Top-level field names a ``str.format`` template uses (``{a.b}`` / ``{a[0]}`` -> ``a``)."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        if field == "" or field.isdigit():
            raise ValueError(f"prompt_template must use named fields, got {{{field}}} in {template!r}")
        names.append(field.split(".")[0].split("[")[0])
    return names


def _check_scalar(row: Mapping[str, Any], key: str, idx: int, why: str) -> None:
    if key not in row or row[key] is None:
        raise DatasetError(f"row {idx}: field {key!r} ({why}) is missing")
    if isinstance(row[key], bool) or not isinstance(row[key], (str, int, float)):
        raise DatasetError(f"row {idx}: field {key!r} ({why}) must be a string or number, got {type(row[key]).__name__}")


def validate_record(row: Any, idx: int, config: DataProcessorConfig) -> None:
    """Raise ``DatasetError`` naming row ``idx`` and the field if ``row`` cannot be processed."""
    if not isinstance(row, Mapping):
        raise DatasetError(f"row {idx}: expected a mapping of fields, got {type(row).__name__}")
    if config.messages_key is not None:
        msgs = row.get(config.messages_key)
        if not isinstance(msgs, list) or not msgs:
            raise DatasetError(f"row {idx}: field {config.messages_key!r} (messages) must be a non-empty list, got {type(msgs).__name__}")
        for j, m in enumerate(msgs):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DatasetError(f"row {idx}: field {config.messages_key!r} (messages): message {j} needs string 'role' and 'content'")
    elif config.prompt_template is not None:
        for name in _template_fields(config.prompt_template):
            _check_scalar(row, name, idx, "used by prompt_template")
    else:
        if not isinstance(row.get(config.prompt_key), str):
            if config.prompt_key not in row or row[config.prompt_key] is None:
                raise DatasetError(f"row {idx}: field {config.prompt_key!r} (prompt) is missing")
            raise DatasetError(
                f"row {idx}: field {config.prompt_key!r} (prompt) must be a string, got {type(row[config.prompt_key]).__name__}"
            )
        if not row[config.prompt_key].strip():
            raise DatasetError(f"row {idx}: field {config.prompt_key!r} (prompt) is empty")
    if config.ground_truth_key is not None:
        _check_scalar(row, config.ground_truth_key, idx, "ground truth")
    for key in config.extra_env_keys:
        if key not in row:
            raise DatasetError(f"row {idx}: field {key!r} (extra_env_keys) is missing")
    if config.task_name is None and "task_name" in row and not isinstance(row["task_name"], str):
        raise DatasetError(f"row {idx}: field 'task_name' must be a string, got {type(row['task_name']).__name__}")


def _user_messages(row: Mapping[str, Any], config: DataProcessorConfig) -> list[dict[str, str]]:
    if config.messages_key is not None:
        msgs = [{"role": m["role"], "content": m["content"]} for m in row[config.messages_key]]
    elif config.prompt_template is not None:
        msgs = [{"role": "user", "content": config.prompt_template.format(**row)}]
    else:
        msgs = [{"role": "user", "content": row[config.prompt_key]}]
    if config.system_prompt is not None and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": config.system_prompt})
    return msgs


def render_chat_messages(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Each message's share of the chat-template rendering (with the generation prompt at the end).

    Rendered incrementally: message ``k`` gets the text that rendering ``messages[:k+1]`` adds to
    rendering ``messages[:k]``, so the pieces concatenate to exactly the full rendering (templates
    that insert a default system prompt attribute it to the first message).
    """
    pieces, prev = [], ""
    for k in range(len(messages)):
        last = k == len(messages) - 1
        full = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False, add_generation_prompt=last)
        if not full.startswith(prev):
            raise DatasetError("the chat template does not render messages as a growing prefix; use a message list of one user turn")
        pieces.append(full[len(prev) :])
        prev = full
    return pieces


def task_of(row: Mapping[str, Any], config: DataProcessorConfig) -> str:
    """The task (environment name) of a validated row: ``config.task_name``, else the row's
    ``task_name`` field, else "default"."""
    return config.task_name or (row.get("task_name") if isinstance(row.get("task_name"), str) else None) or "default"


def _tokenize_prompt(
    row: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase, config: DataProcessorConfig
) -> tuple[list[dict[str, str]], list[str], list[list[int]]]:
    """A row's messages, each message's rendered text and its token ids (not truncated)."""
    messages = _user_messages(row, config)
    if config.use_chat_template:
        texts = render_chat_messages(messages, tokenizer)
        return messages, texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    # No template: one prompt string, with the tokenizer's own special tokens (e.g. BOS).
    texts = ["".join(m["content"] for m in messages)]
    return [{"role": "user", "content": texts[0]}], texts, [tokenizer(texts[0], add_special_tokens=True)["input_ids"]]


def process_record(row: Mapping[str, Any], idx: int, tokenizer: PreTrainedTokenizerBase, config: DataProcessorConfig) -> DatumSpec:
    """Turn one validated row into a ``DatumSpec`` (truncating and masking an over-long prompt)."""
    messages, texts, token_lists = _tokenize_prompt(row, tokenizer, config)
    total = sum(len(t) for t in token_lists)
    loss_multiplier = 1.0
    if total > config.max_seq_length:
        # Too long: keep the first max_seq_length tokens (so shapes stay bounded downstream) and
        # drop the sample from the loss.
        loss_multiplier, budget = 0.0, config.max_seq_length
        for k, ids in enumerate(token_lists):
            token_lists[k] = ids[:budget]
            budget -= len(token_lists[k])
            texts[k] = tokenizer.decode(token_lists[k], skip_special_tokens=False)
    message_log: list[Message] = [
        {"role": m["role"], "content": text, "token_ids": torch.tensor(ids, dtype=torch.int64)}
        for m, text, ids in zip(messages, texts, token_lists)
    ]
    extra: dict[str, Any] = {}
    if config.ground_truth_key is not None:
        extra["ground_truth"] = str(row[config.ground_truth_key])
    for key in config.extra_env_keys:
        extra[key] = row[key]
    return DatumSpec(
        message_log=message_log,
        length=sum(len(t) for t in token_lists),
        extra_env_info=extra,
        loss_multiplier=loss_multiplier,
        idx=idx,
        task_name=task_of(row, config),
    )


class PromptDataset(Sequence[DatumSpec]):
    """Rows processed into ``DatumSpec`` on access; all rows validated up front.

    Also refused up front: a ``max_seq_length`` shorter than every prompt, and (given
    ``known_tasks``, the run's environment names) a row whose task has no environment. A
    ``max_seq_length`` that cuts most prompts is logged as a warning.
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        config: DataProcessorConfig | None = None,
        *,
        known_tasks: Collection[str] | None = None,
    ) -> None:
        self.records = list(records)
        self.tokenizer = tokenizer
        self.config = config or DataProcessorConfig()
        if self.config.prompt_template is not None:
            _template_fields(self.config.prompt_template)  # reject positional templates early
        for i, row in enumerate(self.records):
            validate_record(row, i, self.config)
        if known_tasks is not None:
            self.check_task_names(known_tasks)
        self._check_prompt_lengths()

    def _check_prompt_lengths(self) -> None:
        """Refuse a ``max_seq_length`` no prompt fits in (every sample would be masked out of the loss:
        a run that trains nothing), and warn when most prompts are cut.

        Tokenizing every row would cost seconds at start-up on a large dataset, so the warning's
        fraction is estimated on up to ``_LENGTH_SAMPLE`` evenly spaced rows; only when none of them
        fits are the other rows scanned, stopping at the first that fits.
        """
        n, limit = len(self.records), self.config.max_seq_length
        if n == 0:
            return
        sample = np.unique(np.linspace(0, n - 1, min(n, _LENGTH_SAMPLE)).round().astype(np.int64))
        lengths = {int(i): self._prompt_length(int(i)) for i in sample}
        too_long = sum(v > limit for v in lengths.values())
        if too_long == len(lengths):
            for i in range(n):
                if i not in lengths:
                    lengths[i] = self._prompt_length(i)
                    if lengths[i] <= limit:
                        break
            else:
                shortest = min(lengths, key=lengths.__getitem__)
                raise DatasetError(
                    f"data.processor.max_seq_length={limit} is shorter than every prompt (the shortest, row {shortest}, has "
                    f"{lengths[shortest]} tokens): every sample would be truncated and masked out of the loss; raise it to at "
                    f"least {lengths[shortest]}"
                )
        if too_long * 2 > len(lengths):
            of = f"{too_long} of {len(lengths)}" + (" sampled rows" if len(lengths) < n else " prompts")
            log.warning(
                "%s are longer than data.processor.max_seq_length=%d tokens (longest %d): they are truncated and masked "
                "out of the loss, so most of the dataset trains nothing",
                of,
                limit,
                max(lengths.values()),
            )

    def _prompt_length(self, idx: int) -> int:
        """Tokens of row ``idx``'s prompt before truncation."""
        return sum(len(ids) for ids in _tokenize_prompt(self.records[idx], self.tokenizer, self.config)[2])

    def check_task_names(self, known: Collection[str]) -> None:
        """Raise ``DatasetError`` naming the first row whose task has no environment in ``known``.

        The trainer calls it at start-up with its environments' names, so a misspelt ``task_name``
        fails before anything starts instead of when a rollout first draws that row (maybe epochs in).
        """
        known = set(known)
        fix = f"data.processor.task_name={next(iter(known))}" if len(known) == 1 else "data.processor.task_name"
        if self.config.task_name is not None:
            if self.config.task_name not in known:
                raise DatasetError(
                    f"data.processor.task_name={self.config.task_name!r} names no environment of this run "
                    f"(environments: {sorted(known)}); set {fix}"
                )
            return
        for i, row in enumerate(self.records):
            task = task_of(row, self.config)
            if task in known:
                continue
            if isinstance(row.get("task_name"), str) and row["task_name"]:
                why = f"task_name {task!r}"
            else:
                why = "task 'default' (the row has no task_name field and data.processor.task_name is null)"
            raise DatasetError(
                f"row {i}: {why} names no environment of this run (environments: {sorted(known)}); set {fix} "
                "or fix the row's task_name field"
            )

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        config: DataProcessorConfig | None = None,
        *,
        split: str | None = None,
        known_tasks: Collection[str] | None = None,
    ) -> "PromptDataset":
        """Load ``path`` (see ``load_records``) and validate every row (see ``PromptDataset``)."""
        return cls(load_records(path, split=split), tokenizer, config, known_tasks=known_tasks)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, idx: int) -> DatumSpec:  # type: ignore[override]
        if not -len(self) <= idx < len(self):
            raise IndexError(f"index {idx} out of range for a dataset of {len(self)} rows")
        idx %= len(self)
        return process_record(self.records[idx], idx, self.tokenizer, self.config)


def collate_datums(batch: Sequence[DatumSpec]) -> dict[str, Any]:
    """A batch of ``DatumSpec`` as columns: lists, plus ``length`` / ``loss_multiplier`` / ``idx`` tensors."""
    return {
        "message_log": [d["message_log"] for d in batch],
        "length": torch.tensor([d["length"] for d in batch], dtype=torch.int64),
        "extra_env_info": [d["extra_env_info"] for d in batch],
        "loss_multiplier": torch.tensor([d["loss_multiplier"] for d in batch], dtype=torch.float32),
        "idx": torch.tensor([d["idx"] for d in batch], dtype=torch.int64),
        "task_name": [d["task_name"] for d in batch],
    }


# ---------------------------------------------------------------------------------------- loader
class StatefulDataLoader:
    """Batches over a dataset with seeded per-epoch shuffling and an exact, resumable position.

    Epoch ``e`` visits the rows in ``permutation(seed, e)`` (or in order without shuffling), so the
    order depends only on ``(seed, epoch)``, and the state is just ``(epoch, batch_in_epoch)``:
    a loader restored from ``state_dict()`` yields exactly the batches the original would have.
    ``for batch in loader`` yields the rest of the current epoch, then moves to the next epoch;
    ``next_batch()`` crosses epoch boundaries by itself (for step-based training loops).
    """

    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        if len(self) == 0:
            raise DatasetError(
                f"a dataset of {len(dataset)} rows gives no batch of {batch_size}" + (" with drop_last" if drop_last else "")
            )
        self.epoch = 0
        self.batch_in_epoch = 0
        self._cached_order: tuple[tuple[int, int], np.ndarray] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        key = (epoch, self.seed)
        if self._cached_order is None or self._cached_order[0] != key:
            n = len(self.dataset)
            order = np.random.default_rng([self.seed & 0xFFFFFFFF, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._cached_order = (key, order)
        return self._cached_order[1]

    def epoch_indices(self, epoch: int) -> list[int]:
        """The dataset rows epoch ``epoch`` visits, in order (``drop_last`` leaves the tail of its
        permutation out): what "every prompt once per epoch" is checked against."""
        return [int(i) for i in self._order(epoch)[: len(self) * self.batch_size]]

    def _batch(self, order: np.ndarray, b: int) -> Any:
        items = [self.dataset[int(i)] for i in order[b * self.batch_size : (b + 1) * self.batch_size]]
        return self.collate_fn(items) if self.collate_fn else items

    def __iter__(self) -> Iterator[Any]:
        if self.batch_in_epoch >= len(self):  # restored at the end of an epoch: the next one is due
            self.epoch += 1
            self.batch_in_epoch = 0
        order = self._order(self.epoch)
        while self.batch_in_epoch < len(self):
            batch = self._batch(order, self.batch_in_epoch)
            self.batch_in_epoch += 1  # counted before yielding: a checkpoint taken now resumes after it
            yield batch
        self.epoch += 1
        self.batch_in_epoch = 0

    def next_batch(self) -> Any:
        """The next batch, moving to the next epoch when this one is exhausted."""
        if self.batch_in_epoch >= len(self):
            self.epoch += 1
            self.batch_in_epoch = 0
        batch = self._batch(self._order(self.epoch), self.batch_in_epoch)
        self.batch_in_epoch += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position (plus the settings it is only valid with); plain ints/bools, JSON-serialisable."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``; refuses a state taken with another dataset size or batching."""
        for key in ("batch_size", "drop_last", "dataset_len", "shuffle"):
            mine = len(self.dataset) if key == "dataset_len" else getattr(self, key)
            if key in state and state[key] != mine:
                raise ValueError(f"loader state has {key}={state[key]!r}, this loader has {mine!r}")
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
