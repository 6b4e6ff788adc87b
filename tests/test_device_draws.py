"""The device sampler's uniforms (runtime/sampling.uniforms, runtime/sampler.draw_uniforms) and the parameter
block it uploads (parameter_block): counter-based draws, one a sampled row and step, that depend on the
sequence's key and draw count only, so a seeded request draws the same whatever shares its batch."""
import warnings

import numpy as np
import pytest

from engc.runtime.sampler import draw_uniforms, parameter_block
from engc.runtime.sampling import SamplingParams, make_draw_key, uniforms
from engc.runtime.sequence import Sequence

# splitmix64's first outputs from state 0, as its reference implementation prints them
SPLITMIX64_FROM_0 = (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F)


def sequence(seed=None, temperature=0.8, **kw):
    return Sequence([1, 2], SamplingParams(temperature=temperature, seed=seed, **kw))


def test_a_draw_is_splitmix64s_output_at_the_count_its_top_24_bits():
    got = uniforms(np.zeros(3, dtype=np.uint64), np.arange(3, dtype=np.uint64))
    assert got.dtype == np.float32
    assert got.tolist() == [(x >> 40) / 2**24 for x in SPLITMIX64_FROM_0]


def test_draws_are_in_0_1_exact_and_even_without_a_numpy_warning():
    keys = np.repeat(np.arange(256, dtype=np.uint64) * np.uint64(2**56 + 12345), 256)
    counts = np.tile(np.arange(2**64 - 128, 2**64, dtype=np.uint64), 512)   # counters that wrap
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        u = uniforms(keys, counts)
        one = uniforms(np.array(2**64 - 1, dtype=np.uint64), np.array(2**64 - 1, dtype=np.uint64))   # 0-d
    assert one.shape == () and 0 <= one < 1
    assert u.min() >= 0 and u.max() < 1 and np.array_equal(u * 2**24, np.floor(u * 2**24))
    counts_per_tenth = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.abs(counts_per_tenth / len(u) - 0.1).max() < 0.01   # 65536 draws


@pytest.mark.parametrize("seed", [0, 7, -1, 2**64 + 3, 10**30])
def test_any_integer_seed_names_a_key_modulo_2_64(seed):
    assert make_draw_key(seed) == make_draw_key(seed % 2**64) == make_draw_key(seed + 2**64)
    assert 0 <= make_draw_key(seed) < 2**64 and make_draw_key(seed) != make_draw_key(seed + 1)


def test_an_unseeded_sequence_gets_a_random_key():
    keys = {sequence().draw_key for _ in range(8)}
    assert len(keys) == 8


def test_a_seeded_sequence_draws_the_same_alone_and_in_any_batch():
    """The same seed draws the same uniforms alone and among other rows (seeded, unseeded and greedy ones,
    before and after it, some joining and leaving); a greedy row draws nothing and counts nothing."""
    alone = sequence(seed=42)
    want = [draw_uniforms([alone])[0] for _ in range(5)]
    mine, greedy = sequence(seed=42), sequence(seed=42, temperature=0)
    others = [sequence(seed=i) for i in range(5)] + [sequence(), sequence(top_k=1)]
    batches = [others + [mine, greedy], [greedy, mine], [mine] + others[3:], others[::-1] + [mine], [mine]]
    got = []
    for batch in batches:
        u = draw_uniforms(batch)
        got.append(u[batch.index(mine)])
        assert all(u[i] == 0 for i, s in enumerate(batch) if s.params.greedy)
    assert got == want and mine.draws == alone.draws == 5
    assert draw_uniforms([greedy, others[-1]]).tolist() == [0, 0]
    assert greedy.draws == 0 and others[-1].draws == 0   # top_k 1 is greedy too
    assert len(set(want)) == 5 and all(0 <= u < 1 for u in want)


def test_different_seeds_draw_different_streams():
    rows = [sequence(seed=s) for s in range(64)]
    steps = np.stack([draw_uniforms(rows) for _ in range(4)])
    assert len({tuple(col) for col in steps.T.tolist()}) == 64


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8])
def test_the_parameter_block_is_the_kernels_layout(rows):
    """[5, rows padded to a multiple of 4] float32: temperature, top_k as int32 bits, top_p, the draw, min_p;
    the padding columns ask for nothing (temperature 1, top_k 0, top_p 1, no draw, min_p 0)."""
    seqs = [sequence(seed=i, temperature=0.5 + i, top_k=3 * i, top_p=1 - i / 100, min_p=i / 50) for i in range(rows)]
    seqs[0] = sequence(seed=0, temperature=0.7, top_k=2**40)   # any k over int32 is off, as any k >= vocab is
    twins = [sequence(seed=i) for i in range(rows)]
    block = parameter_block(seqs)
    padded = -(-rows // 4) * 4
    assert block.dtype == np.float32 and block.shape == (5, padded) and block.flags.c_contiguous
    assert block[0, :rows].tolist() == pytest.approx([0.7] + [0.5 + i for i in range(1, rows)])
    assert block[1].view(np.int32)[:rows].tolist() == [2**31 - 1] + [3 * i for i in range(1, rows)]
    assert block[2, :rows].tolist() == pytest.approx([1.0] + [1 - i / 100 for i in range(1, rows)])
    assert block[3, :rows].tolist() == draw_uniforms(twins).tolist()   # the draw depends on the seed only
    assert block[4, :rows].tolist() == pytest.approx([0.0] + [i / 50 for i in range(1, rows)])
    pad = block[:, rows:]
    assert (pad[[0, 2]] == 1).all() and (pad[1].view(np.int32) == 0).all() and (pad[[3, 4]] == 0).all()
