"""Positional LSH for ALiBi attention.

Random binning of token positions (width ``w ~ Gamma(2, sigma)``, offset ``xi ~ U[0, w)``,
bin ``floor((i - xi) / w)``) puts two positions in one block with probability
``exp(-|i-j| / sigma)``, so the ALiBi kernel ``L*`` is the mean of random block masks and ALiBi
attention ``softmax(tau Q K^T - |i-j| / sigma) V`` is approximated by

    T~ = D~^-1 (A o M~) V,   A_ij = exp(tau q_i . k_j),   M~ = mean of s block masks.

Every function takes numpy arrays (float32 or float64, never converted), ``[n, d]`` per head
with a contiguous last axis and any row stride, and returns numpy arrays (or writes ``out=``).
The prefill kernels (except alibi_attention_reference), the decoders, multihead_attention and
multihead_attention_varlen also take float16 arrays and bfloat16 bit patterns
(``BFloat16Bits``), with float32 accumulation and softmax. Their ``precision=`` keyword
("matrix_units", the default, or "float_products") decides whether bfloat16 tiles go to the
CPU's matrix unit (AMX or AVX512-BF16 where present; float16 tiles to AMX-FP16);
``matrix_units()`` lists this CPU's units and ``matrix_unit(q_dtype, kv_dtype, precision=...)``
names the one a call uses.
See python/README.md for the rules and the API table. ``poslsh.torch`` (with PyTorch >= 2.13
installed) has the same computations as differentiable torch operators.
"""

from ._core import (  # noqa: F401
    BFloat16Bits,
    BlockPlan,
    BoundedKVCache,
    ContextParallelPlan,
    ContextParallelRank,
    HashSet,
    HeadPlan,
    LseMerger,
    RingBackward,
    RingForward,
    __version__,
    alibi_attention_banded,
    alibi_attention_banded_backward,
    alibi_attention_banded_with_lse,
    alibi_attention_decode_exact,
    alibi_attention_reference,
    alibi_attention_tiled,
    alibi_attention_tiled_backward,
    alibi_attention_tiled_paged,
    alibi_attention_tiled_with_lse,
    alibi_sigmas,
    alibi_slopes,
    band_for_bias_error,
    block_plans,
    context_parallel_plan,
    fixed_blocks_attention,
    fixed_blocks_attention_backward,
    fixed_blocks_attention_with_lse,
    fixed_blocks_hash,
    format_plan,
    has_openmp,
    has_spectra,
    lattice_group_starts,
    lsh_attention_decode,
    lsh_attention_fused,
    lsh_attention_fused_backward,
    lsh_attention_fused_paged,
    lsh_attention_fused_with_lse,
    lsh_attention_mean_of_outputs,
    lsh_attention_mean_of_outputs_backward,
    lsh_attention_per_sample,
    lsh_attention_per_sample_backward,
    lsh_attention_per_sample_with_lse,
    lsh_fused_pair_count,
    matrix_unit,
    matrix_unit_available,
    matrix_unit_names,
    matrix_units,
    max_threads,
    method_has_lse,
    method_names,
    method_traits,
    multihead_attention,
    multihead_attention_backward,
    multihead_attention_paged,
    multihead_attention_paged_with_lse,
    multihead_attention_varlen,
    multihead_attention_with_lse,
    plan_heads,
    plan_seconds,
    plan_single_method,
    precision_names,
    rbf_hashes,
    sample_hashes,
    sampler_names,
    shard_ranges,
)

if has_spectra:
    from ._core import (  # noqa: F401
        KernelErrorMetrics,
        OutputErrorMetrics,
        PaperMetrics,
        SpectralNorm,
        UnnormalizedOutputError,
        alibi_kernel_norm,
        kernel_error_metrics,
        max_error,
        output_error_metrics,
        paper_metrics,
        spectral_error,
    )
