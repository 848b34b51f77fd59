"""One engine step as data: what each row feeds this step, and what the runner returns.

The scheduler describes every step the same way (vLLM v1's ``SchedulerOutput``): the
running rows' decode tokens, the newcomers' whole prompts, the next chunk of one long
prompt, and the rows that verify drafted tokens, any of them absent. The runner executes
any such plan in one call (``ModelRunner.run``) and chooses the passes itself: on
engine_mixed.onnx a chunk or the newcomers' prompts ride in the decode step's pass, on a
one-group graph each part is a pass of its own. What comes back is only numbers; turning
them into tokens and events is ``apply_step``'s (service/engine/step.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from service.engine.device import SampledRows
from service.engine.kv_pool import Slot

# What a decode pass hands back per row: its logits, or its next token chosen beside them
# (the argmax, or a draw from ``SampledRows``: runners that sample on the device only).
Pick = Literal["logits", "argmax", "sampled"]
# The passes a runner may time: a decode pass alone, one that also carried prompts or a
# chunk, the newcomers' prompts alone, a chunk alone. Verification passes are per row.
PassKind = Literal["decode", "mixed", "prompts", "chunk"]


@dataclass(frozen=True)
class DecodeWork:
    """One token per row, after each row's cache."""

    slots: Sequence[Slot]
    tokens: np.ndarray  # (B,) each row's newest token
    pick: Pick = "logits"
    sampled: SampledRows | None = None  # each row's draw, for pick "sampled"


@dataclass(frozen=True)
class PromptWork:
    """Newcomers' whole prompts into empty slots (a cached prefix is reused where one is)."""

    slots: Sequence[Slot]
    prompts: Sequence[np.ndarray]  # (T_i,) each
    all_logits: bool = False  # every prompt position's logits (prompt logprobs), else the last


@dataclass(frozen=True)
class ChunkWork:
    """The next part of one row's prompt, after what its slot holds; the last token's
    logits come back (they give the first token when the chunk ends the prompt)."""

    slot: Slot
    tokens: np.ndarray  # (T,)


@dataclass(frozen=True)
class VerifyWork:
    """A row's newest token and the drafts that follow it, with every position's logits."""

    slot: Slot
    tokens: np.ndarray  # (k + 1,)


@dataclass(frozen=True)
class StepPlan:
    decode: DecodeWork | None = None
    prompts: PromptWork | None = None
    chunk: ChunkWork | None = None
    verify: tuple[VerifyWork, ...] = ()

    def prompt_tokens(self) -> list[np.ndarray]:
        """The prompt tokens this step feeds, one array per prompt or chunk."""
        fed = list(self.prompts.prompts) if self.prompts is not None else []
        return fed + ([self.chunk.tokens] if self.chunk is not None else [])


@dataclass
class StepResult:
    """What one plan's passes returned, part by part, and what each pass took."""

    decode_logits: np.ndarray | None = None  # (B, V) for pick "logits"
    decode_ids: np.ndarray | None = None  # (B,) int64 for pick "argmax" and "sampled"
    prompts: list[np.ndarray] = field(default_factory=list)  # (T_i or 1, V) per newcomer
    chunk: np.ndarray | None = None  # (1, V) the chunk's last token
    verify: list[np.ndarray] = field(default_factory=list)  # (k + 1, V) per verified row
    seconds: dict[PassKind, float] = field(default_factory=dict)
    verify_seconds: list[float] = field(default_factory=list)  # per verified row
