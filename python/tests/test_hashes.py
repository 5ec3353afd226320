"""HashSet, rbf_hashes, fixed_blocks_hash, slopes, band widths and pair counts."""

import math

import numpy as np
import pytest

import poslsh
import reference
from conftest import masking_of


def test_rbf_hashes_fields_are_valid_and_deterministic():
    hashes = poslsh.rbf_hashes(16.0, 64, seed=7, stream=3)
    assert len(hashes) == 64
    widths, offsets = hashes.widths, hashes.offsets
    assert widths.dtype == np.float64 and widths.shape == (64,)
    assert np.all(widths > 0) and np.all(offsets >= 0) and np.all(offsets < widths)
    again = poslsh.rbf_hashes(16.0, 64, seed=7, stream=3)
    np.testing.assert_array_equal(again.widths, widths)
    np.testing.assert_array_equal(again.offsets, offsets)
    other = poslsh.rbf_hashes(16.0, 64, seed=7, stream=4)
    assert not np.array_equal(other.widths, widths)
    # Sample k depends only on (sigma, seed, stream, k): a prefix of a longer set.
    longer = poslsh.rbf_hashes(16.0, 100, seed=7, stream=3)
    np.testing.assert_array_equal(longer.widths[:64], widths)
    assert hashes[5] == (widths[5], offsets[5])
    assert hashes[-1] == (widths[63], offsets[63])
    with pytest.raises(IndexError):
        hashes[64]


def test_hashset_from_values_and_views():
    hashes = poslsh.HashSet([4.0, 2.5], [1.0, 0.0])
    np.testing.assert_array_equal(hashes.widths, [4.0, 2.5])
    np.testing.assert_array_equal(hashes.offsets, [1.0, 0.0])
    widths = hashes.widths
    assert not widths.flags.writeable
    assert widths.base is not None  # a view of the set, not a copy
    del hashes
    np.testing.assert_array_equal(widths, [4.0, 2.5])  # the view keeps the set alive
    from_numpy = poslsh.HashSet(np.array([3.0]), np.array([2.0]))
    assert len(from_numpy) == 1


@pytest.mark.parametrize(
    "widths, offsets, message",
    [
        ([4.0], [4.0], "poslsh: HashSet: argument 'hash.offset' = 4: must lie in [0, width)"),
        ([0.0], [0.0], "poslsh: HashSet: argument 'hash.width' = 0: must be finite and >= 2^-20"),
        ([], [], "poslsh: HashSet: argument 'hashes' = {}: must hold at least one hash (s >= 1)"),
        ([1.0, 2.0], [0.0], "poslsh: HashSet: argument 'offsets' has 1 entries"),
    ],
)
def test_hashset_rejects_bad_values(widths, offsets, message):
    with pytest.raises(ValueError) as error:
        poslsh.HashSet(widths, offsets)
    assert str(error.value).startswith(message)


def test_bad_sigma_is_value_error_with_the_library_message():
    with pytest.raises(ValueError) as error:
        poslsh.rbf_hashes(-1.0, 4, seed=0)
    assert str(error.value) == "poslsh: rbf_hashes: argument 'sigma' = -1: must be finite and > 0"
    with pytest.raises(ValueError, match=r"^poslsh: rbf_hashes: argument 'samples' = 0: must be >= 1$"):
        poslsh.rbf_hashes(4.0, 0, seed=0)
    with pytest.raises(ValueError, match="fixed_blocks_hash: argument 'sigma' = nan"):
        poslsh.fixed_blocks_hash(float("nan"))


def test_fixed_blocks_hash():
    hashes = poslsh.fixed_blocks_hash(16.0)
    assert len(hashes) == 1 and hashes[0] == (32.0, 0.0)


@pytest.mark.parametrize("heads", [1, 2, 6, 8, 12, 16])
def test_alibi_slopes_and_sigmas(heads):
    np.testing.assert_allclose(poslsh.alibi_slopes(heads), reference.alibi_slopes(heads), rtol=1e-15)
    np.testing.assert_allclose(poslsh.alibi_sigmas(heads), 1 / reference.alibi_slopes(heads), rtol=1e-15)


def test_alibi_slopes_six_heads_by_hand():
    np.testing.assert_array_equal(poslsh.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    with pytest.raises(ValueError, match="argument 'heads' = 0"):
        poslsh.alibi_slopes(0)


def test_band_for_bias_error():
    assert poslsh.band_for_bias_error(16.0, 1e-3) == math.ceil(16.0 * math.log(1e3))
    with pytest.raises(ValueError, match="argument 'eps' = 2: must be in \\(0, 1\\)"):
        poslsh.band_for_bias_error(16.0, 2.0)


@pytest.mark.parametrize("causal", [True, False])
def test_lsh_fused_pair_count(causal):
    n = 300
    hashes = poslsh.rbf_hashes(10.0, 5, seed=3)
    mask = reference.mean_mask(hashes.widths, hashes.offsets, n, causal)
    # The pairs with c_ij > 0 form one interval per query.
    expected = 0
    for row in mask:
        nonzero = np.flatnonzero(row > 0)
        expected += nonzero[-1] - nonzero[0] + 1
    assert poslsh.lsh_fused_pair_count(hashes, n, masking=masking_of(causal)) == expected
    assert poslsh.lsh_fused_pair_count(hashes, n, masking=masking_of(causal)) >= np.count_nonzero(mask)


def test_non_hashset_argument_is_type_error():
    with pytest.raises(TypeError, match="argument 'hashes' must be a poslsh.HashSet, got list"):
        poslsh.lsh_fused_pair_count([(1.0, 0.0)], 10)
