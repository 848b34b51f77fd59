"""Structured output's token masks against independent judges of the same languages.

Random walks through the tiny artifact's vocabulary, each step taking a token the mask
allows: every allowed token must keep the text a prefix of the language (the ``regex``
module's partial matching), some token must always be allowed until the sentence is
whole, and every finished walk must be a whole sentence of it (``json`` parses it). The
converse does not hold by design: where the continuation is forced, llguidance allows
only its canonical token ("ue" after '{"ok":tr', not "u").
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from service.artifact.text import TextCodec
from service.contract import io_spec as io
from service.engine.grammar import GrammarCompiler, GrammarError, GrammarState

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}


@pytest.fixture(scope="module")
def codec(artifact: Path) -> TextCodec:
    return TextCodec.from_file(artifact / io.TOKENIZER_FILE)


@pytest.fixture(scope="module")
def compiler(codec: TextCodec, artifact: Path) -> GrammarCompiler:
    config = io.ArtifactConfig.load(artifact)
    assert config.eos_token_id is not None
    return GrammarCompiler(codec.tokenizer.to_str(), config.vocab_size, config.eos_token_id)


def walk(state: GrammarState, codec: TextCodec, rnd: random.Random,
         prefix_ok: Callable[[str], bool], max_steps: int = 60) -> str:
    """Take random allowed tokens until only end-of-sequence is allowed; check every step's
    allowed tokens (a sample of ten) against ``prefix_ok``. Returns the text."""
    eos = state.eos_token_id
    ids: list[int] = []
    for _ in range(max_steps):
        allowed = state.allowed()  # (V,) bool
        choices = [int(t) for t in np.flatnonzero(allowed) if t != eos]
        if not choices:
            assert allowed[eos]
            return codec.decode(ids)
        for t in rnd.sample(choices, min(10, len(choices))):
            assert prefix_ok(codec.decode([*ids, t])), (ids, t)
        token = rnd.choice(choices)
        state.consume(token)
        ids.append(token)
    raise AssertionError(f"no end after {max_steps} tokens: {codec.decode(ids)!r}")


def test_regex_masks_allow_exactly_the_prefixes_of_the_pattern(
        compiler: GrammarCompiler, codec: TextCodec) -> None:
    regex = pytest.importorskip("regex")
    pattern = r"[0-9]{2}-(cat|dog)s?"
    grammar = compiler.compile("regex", pattern)
    rnd = random.Random(0)
    for _ in range(5):
        text = walk(grammar.new(), codec, rnd,
                    lambda s: regex.fullmatch(pattern, s, partial=True) is not None)
        assert regex.fullmatch(pattern, text), text


def test_json_schema_walks_end_in_documents_the_schema_accepts(
        compiler: GrammarCompiler, codec: TextCodec) -> None:
    regex = pytest.importorskip("regex")
    # The schema's language written out (no free whitespace, any key order): the judge.
    ok = r'"ok":(true|false)'
    color = r'"color":"(red|green)"'
    language = rf"\{{({ok},{color}|{color},{ok})\}}"
    grammar = compiler.compile("json_schema", SCHEMA)
    rnd = random.Random(1)
    for _ in range(5):
        text = walk(grammar.new(), codec, rnd,
                    lambda s: regex.fullmatch(language, s, partial=True) is not None)
        doc = json.loads(text)
        assert set(doc) == {"ok", "color"} and isinstance(doc["ok"], bool)
        assert doc["color"] in ("red", "green")


def test_each_sequence_gets_its_own_state(compiler: GrammarCompiler,
                                          codec: TextCodec) -> None:
    grammar = compiler.compile("regex", "ab|cd")
    first, second = grammar.new(), grammar.new()
    before = second.allowed().copy()
    (a,) = codec.encode("a", add_special_tokens=False)
    assert first.allowed()[a]
    first.consume(a)
    assert not first.allowed()[a]
    np.testing.assert_array_equal(second.allowed(), before)  # untouched by the first


@pytest.mark.parametrize(("kind", "value"), [("json_schema", "{not json"),
                                             ("regex", "(unclosed"),
                                             ("lark", "start: undefined_rule")])
def test_bad_grammars_are_refused_with_a_reason(compiler: GrammarCompiler, kind: str,
                                                value: str) -> None:
    with pytest.raises(GrammarError, match=kind.replace("_", " ")):
        compiler.compile(kind, value)  # type: ignore[arg-type]
