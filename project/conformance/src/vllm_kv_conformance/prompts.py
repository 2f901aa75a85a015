"""The prompts of one run, drawn from a seeded generator.

``runner.run_conformance`` makes one ``Prompts`` per run; a fresh seed per
run (the default) keeps a store that outlives the run from answering the
miss scenario with an earlier run's KV. Every prompt is three KV blocks less
four tokens long (two full blocks and a partial one, so a connector that
stores whole blocks can serve two of them), in the tiny model's vocabulary
without its three special tokens.

- ``reference`` (P): the prompt of the hit, the aborts, the preemption;
- ``control`` (C): P with its first half replaced, the same second half: a
  hit that loads P's KV for C (a key that does not cover the whole prefix)
  gives P's answer instead of C's (the correctness scenario; it checks at
  every run that the two recomputed answers differ);
- ``partial`` (Q): P's first two blocks and a new tail (a prefix hit);
- ``miss`` and one fresh prompt per failed-load policy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_TOKEN = 3  # <unk>, <s>, </s> come first in the tiny model's vocabulary.


@dataclass(frozen=True)
class Prompts:
    reference: list[int]
    control: list[int]
    partial: list[int]
    miss: list[int]
    failed_load: dict[str, list[int]]
    shared_prefix: int
    """Tokens ``partial`` shares with ``reference``."""


def make_prompts(seed: int, vocab_size: int, block_size: int) -> Prompts:
    rng = random.Random(seed)
    length = 3 * block_size - 4
    half = length // 2

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(n)]

    reference = tokens(length)
    control = tokens(half) + reference[half:]
    shared = 2 * block_size
    partial = reference[:shared] + tokens(length - shared)
    return Prompts(
        reference=reference,
        control=control,
        partial=partial,
        miss=tokens(length),
        failed_load={policy: tokens(length) for policy in ("recompute", "fail")},
        shared_prefix=shared,
    )
