"""IncrementalDecoder's byte-level shortcut (a cached token text in place of two decodes) gives the stream the
two-decode path gives, token for token, on the tiny byte-level tokenizer and on SmolLM2's."""
from __future__ import annotations

import random

import pytest

from engc.runtime.tokenizer import IncrementalDecoder, Tokenizer
from tiny_models import CORPUS, make_tokenizer


def _streams(tok: Tokenizer, prompt: list[int], outputs: list[int]) -> tuple[list[str], list[str], int]:
    """The deltas of both paths a token at a time (then the flush), and how often the shortcut ran."""
    fast, slow = IncrementalDecoder(tok, prompt), IncrementalDecoder(tok, prompt)
    slow.piece = None
    assert fast.piece is not None, "a byte-level tokenizer should take the shortcut"
    calls = []
    real_decode = fast.decode
    fast.decode = lambda ids: calls.append(1) or real_decode(ids)
    a = [fast.step([t]) for t in outputs]
    used = len(outputs) - len(calls) // 2   # a step without the shortcut decodes twice
    a.append(fast.flush())
    b = [slow.step([t]) for t in outputs] + [slow.flush()]
    return a, b, used


def _cases(tok: Tokenizer, rng: random.Random):
    vocab = tok.vocab_size
    texts = CORPUS + ["naïve café — 東京 🙂🙃 ok", "a\u00a0b\u200bc \ufffd literal", "  spaced   out\n\ttabs"]
    encoded = [tok.encode(t, add_special_tokens=False) for t in texts]
    for ids in encoded:                                    # real text, split anywhere into prompt and output
        cut = rng.randrange(len(ids))
        yield ids[:cut], ids[cut:]
    for _ in range(40):                                    # any ids: special tokens, lone bytes of a character
        yield [rng.randrange(vocab) for _ in range(rng.randrange(8))], [rng.randrange(vocab) for _ in range(60)]
    mixed = [t for ids in encoded for t in ids]
    for _ in range(20):                                    # text tokens with random ones dropped in
        out = [t if rng.random() < 0.8 else rng.randrange(vocab) for t in rng.sample(mixed, 50)]
        yield [], out


def _check(tok: Tokenizer):
    rng, shortcuts = random.Random(0), 0
    for prompt, outputs in _cases(tok, rng):
        fast, slow, used = _streams(tok, prompt, outputs)
        assert fast == slow, (prompt, outputs)
        shortcuts += used
    assert shortcuts > 500   # the shortcut is what ran for most tokens


def test_shortcut_matches_two_decodes_on_a_tiny_byte_level_tokenizer(tmp_path):
    make_tokenizer(tmp_path)
    _check(Tokenizer(tmp_path))


def test_shortcut_matches_two_decodes_on_smollm2(default_bundle):
    _check(Tokenizer(default_bundle / "tokenizer"))


@pytest.mark.parametrize("decoder", ["sequence", "metaspace"])
def test_other_decoders_keep_two_decodes(tmp_path, decoder):
    """Only a bare ByteLevel decoder joins bytes as they are (a sentencepiece one strips a leading space)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders
    make_tokenizer(tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.decoder = decoders.Sequence([decoders.ByteLevel()]) if decoder == "sequence" else decoders.Metaspace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    assert not tok.joins_bytes and IncrementalDecoder(tok, []).piece is None


if __name__ == "__main__":
    pytest.main([__file__])
