"""The data of a fine-tune, ready to batch: read, checked, tokenized, split.

Everything here runs before torch is imported and before anything is written, so a bad
line is refused in a second with its line number and an empty output.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from model.checkpoint import TOKENIZER_FILE, CheckpointMeta, read_meta
from model.finetune.examples import Example, load_examples
from model.finetune.options import MIN_EVAL_EXAMPLES, FinetuneOptions
from model.finetune.supervision import (
    Supervised,
    SupervisionCounts,
    checkpoint_template,
    stop_ids_of,
    supervise,
)
from service.contract.chat_template import ChatTemplate

DEFAULT_EVAL_FRACTION = 0.1


@dataclass
class Prepared:
    meta: CheckpointMeta
    tokenizer: Tokenizer
    train: list[Supervised]
    eval: list[Supervised]
    counts: SupervisionCounts
    eval_counts: SupervisionCounts | None
    data_sha256: str
    max_length: int
    template: ChatTemplate
    stop_ids: frozenset[int]
    eos_id: int | None
    chat: bool  # the training data is conversations (what rehearsal adds to)
    asked: frozenset[str]  # the user turns of the training data

    @property
    def pad_id(self) -> int:
        """What fills a batch's short rows (never scored): pad, else eos, else 0."""
        tok = self.meta.tokenizer
        for key in ("pad_token_id", "eos_token_id"):
            if isinstance(tok.get(key), int):
                return int(tok[key])
        return 0


def file_sha256(*paths: str | None) -> str:
    digest = hashlib.sha256()
    for path in paths:
        if path is not None:
            digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def prepare(opts: FinetuneOptions) -> Prepared:
    """Read, check and tokenize the data set(s) against the checkpoint's tokenizer and chat
    template; hold out the evaluation split (DataError / ValueError, one line)."""
    ckpt = Path(opts.ckpt)
    meta = read_meta(ckpt)
    tokenizer = Tokenizer.from_file(str(ckpt / TOKENIZER_FILE))
    template = checkpoint_template(ckpt, tokenizer, meta.tokenizer)
    eos = meta.tokenizer.get("eos_token_id")
    stops = stop_ids_of(ckpt, eos if isinstance(eos, int) else None)
    max_length = min(opts.max_length, meta.model.max_seq_len)

    eos_id = eos if isinstance(eos, int) else None

    def tokenized(examples: list[Example]) -> tuple[list[Supervised], SupervisionCounts]:
        return supervise(examples, tokenizer, template, stops, eos_id, max_length)

    examples = load_examples(opts.data)
    chat = all(e.kind == "messages" for e in examples)  # one format a file
    train, counts = tokenized(examples)
    evaluated, eval_counts = ([], None) if opts.eval_data is None else tokenized(
        load_examples(opts.eval_data))
    if opts.eval_data is None and opts.show_masks is None:
        fraction = opts.eval_fraction
        if fraction is None:
            fraction = DEFAULT_EVAL_FRACTION if len(train) >= MIN_EVAL_EXAMPLES else 0.0
        train, evaluated = split(train, fraction, opts.seed)
    if not train and opts.show_masks is None:
        raise ValueError(f"{opts.data}: no example has a supervised token to train on "
                         f"({counts.summary()})")
    return Prepared(meta, tokenizer, train, evaluated, counts, eval_counts,
                    file_sha256(opts.data, opts.eval_data), max_length, template, stops,
                    eos_id, chat, frozenset(m.content.strip() for e in examples
                                            for m in e.messages if m.role == "user"))


def split(examples: list[Supervised], fraction: float,
          seed: int) -> tuple[list[Supervised], list[Supervised]]:
    """(train, held out): ``fraction`` of the examples (at least one when > 0), chosen by
    the seed, in file order."""
    if fraction <= 0 or len(examples) < 2:
        return examples, []
    count = min(len(examples) - 1, max(1, round(len(examples) * fraction)))
    held = set(random.Random(f"eval/{seed}").sample(range(len(examples)), count))
    return ([e for i, e in enumerate(examples) if i not in held],
            [e for i, e in enumerate(examples) if i in held])

