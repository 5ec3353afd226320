// The LSH kernels on stored partitions (attention/partition.hpp): bitwise the hash-set kernels
// on partition_set(hashes, n), the dense count-weighted formula on Poisson cuts, the same
// output for any thread count, the pair count, and named argument errors.
#include <cmath>
#include <poslsh/attention/fused.hpp>
#include <poslsh/attention/partition.hpp>
#include <poslsh/interop/block_kernel.hpp>
#include <poslsh/lsh/samplers.hpp>
#include <vector>

#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using poslsh::PartitionSet;

namespace {

// c_ij of the partitions, counted position by position from the edges.
Eigen::MatrixXd partition_attention_counts(const PartitionSet& set) {
  const Index n = set.n;
  Eigen::MatrixXd counts = Eigen::MatrixXd::Zero(n, n);
  for (Index k = 0; k < set.samples(); ++k) {
    std::vector<Index> block(static_cast<std::size_t>(n));
    Index id = 0;
    for (const Index* edge = set.begin(k); edge + 1 < set.end(k); ++edge, ++id)
      for (Index i = edge[0]; i < edge[1]; ++i) block[static_cast<std::size_t>(i)] = id;
    for (Index i = 0; i < n; ++i)
      for (Index j = 0; j < n; ++j)
        if (block[static_cast<std::size_t>(i)] == block[static_cast<std::size_t>(j)])
          counts(i, j) += 1.0;
  }
  return counts;
}

// out_i = sum_j c_ij e^{tau q_i.k_j} v_j / sum_j c_ij e^{tau q_i.k_j} (causal: j <= i), in
// double, rows p0 .. p0 + m - 1 for q holding those rows.
Eigen::MatrixXd partition_attention_dense(const RowMatrix<float>& q, const RowMatrix<float>& k,
                                          const RowMatrix<float>& v, const PartitionSet& set,
                                          Masking masking, Index p0 = 0) {
  const Eigen::MatrixXd counts = partition_attention_counts(set);
  const double tau = 1.0 / std::sqrt(static_cast<double>(q.cols()));
  const Eigen::MatrixXd scores = tau * q.cast<double>() * k.cast<double>().transpose();  // m x n
  Eigen::MatrixXd out = Eigen::MatrixXd::Zero(q.rows(), v.cols());
  for (Index r = 0; r < q.rows(); ++r) {
    const Index i = p0 + r;
    double top = -1e300;
    for (Index j = 0; j < k.rows(); ++j)
      if (counts(i, j) > 0 && (masking == Masking::bidirectional || j <= i))
        top = std::max(top, scores(r, j));
    double total = 0.0;
    for (Index j = 0; j < k.rows(); ++j) {
      if (counts(i, j) == 0 || (masking == Masking::causal && j > i)) continue;
      const double weight = counts(i, j) * std::exp(scores(r, j) - top);
      total += weight;
      out.row(r) += weight * v.row(j).cast<double>();
    }
    out.row(r) /= total;
  }
  return out;
}

double partition_attention_max_error(const RowMatrix<float>& approx, const Eigen::MatrixXd& exact) {
  return (approx.cast<double>() - exact).cwiseAbs().maxCoeff();
}

RowMatrix<float> partition_attention_blocks(const RowMatrix<float>& q, const RowMatrix<float>& k,
                                            const RowMatrix<float>& v, const PartitionSet& set,
                                            Masking masking) {
  RowMatrix<float> out(q.rows(), v.cols());
  poslsh::lsh_attention_by_blocks<float>(q, k, v, set, out, with_masking(masking));
  return out;
}

}  // namespace

TEST_CASE("partition kernels are bitwise the hash-set kernels on partition_set(hashes, n)",
          "[partition_attention]") {
  const Index d = 16, dv = 12;
  for (Index n : {Index{1}, Index{63}, Index{300}, Index{520}}) {
    const auto [q, k, v] = random_qkv<float>(n, d, dv, 11);
    for (Masking masking : {Masking::causal, Masking::bidirectional}) {
      for (poslsh::Sampler sampler : {poslsh::Sampler::independent, poslsh::Sampler::antithetic,
                                      poslsh::Sampler::stratified, poslsh::Sampler::rqmc}) {
        for (double sigma : {0.7, 6.0, 90.0}) {
          for (Index s : {Index{1}, Index{7}}) {
            const poslsh::HashSet hashes = poslsh::sample_hashes(sigma, s, 5, 2, sampler);
            const PartitionSet set = poslsh::partition_set(hashes, n);
            INFO("n " << n << ", " << poslsh_test::masking_name(masking) << ", "
                      << poslsh::enum_name(sampler) << ", sigma " << sigma << ", s " << s);
            const RowMatrix<float> fused =
                poslsh::lsh_attention_fused<float>(q, k, v, hashes, with_masking(masking));
            CHECK(poslsh::lsh_attention_fused<float>(q, k, v, set, with_masking(masking)) == fused);
            RowMatrix<float> blocks(n, dv);
            poslsh::lsh_attention_by_blocks<float>(q, k, v, hashes, blocks, with_masking(masking));
            CHECK(partition_attention_blocks(q, k, v, set, masking) == blocks);
            CHECK(poslsh::lsh_fused_pair_count(set, masking) ==
                  poslsh::lsh_fused_pair_count(hashes, n, masking));
            // Queries at an offset: rows [p0, n) over all n keys.
            if (n > 40) {
              const Index p0 = n - 40;
              poslsh::AttentionOptions offset = with_masking(masking);
              offset.query_offset = p0;
              const RowMatrix<float> tail = q.bottomRows(40);
              CHECK(poslsh::lsh_attention_fused<float>(tail, k, v, set, offset) ==
                    poslsh::lsh_attention_fused<float>(tail, k, v, hashes, offset));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("partition kernels compute the count-weighted formula on Poisson cuts",
          "[partition_attention]") {
  const Index n = 350, d = 16, dv = 8;
  const auto [q, k, v] = random_qkv<float>(n, d, dv, 21);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (double sigma : {0.8, 5.0, 60.0}) {
      for (Index s : {Index{1}, Index{6}}) {
        const PartitionSet set =
            poslsh::sample_partition_set(sigma, s, n, 9, 1, poslsh::Sampler::poisson);
        const Eigen::MatrixXd exact = partition_attention_dense(q, k, v, set, masking);
        const RowMatrix<float> fused =
            poslsh::lsh_attention_fused<float>(q, k, v, set, with_masking(masking));
        const RowMatrix<float> blocks = partition_attention_blocks(q, k, v, set, masking);
        INFO(poslsh_test::masking_name(masking) << ", sigma " << sigma << ", s " << s);
        CHECK(partition_attention_max_error(fused, exact) < 2e-5);
        CHECK(partition_attention_max_error(blocks, exact) < 2e-5);
        // The pairs with c_ij > 0 (causal: j <= i) of the dense counts; one interval per row.
        const Eigen::MatrixXd counts = partition_attention_counts(set);
        long long pairs = 0;
        for (Index i = 0; i < n; ++i)
          for (Index j = 0; j < n; ++j)
            pairs += counts(i, j) > 0 && (masking == Masking::bidirectional || j <= i) ? 1 : 0;
        CHECK(poslsh::lsh_fused_pair_count(set, masking) == pairs);
        // Queries at an offset and in double.
        const Index p0 = 200;
        poslsh::AttentionOptions offset = with_masking(masking);
        offset.query_offset = p0;
        const RowMatrix<float> tail = q.bottomRows(n - p0);
        CHECK(partition_attention_max_error(
                  poslsh::lsh_attention_fused<float>(tail, k, v, set, offset),
                  partition_attention_dense(tail, k, v, set, masking, p0)) < 2e-5);
        const RowMatrix<double> fused_double = poslsh::lsh_attention_fused<double>(
            q.cast<double>(), k.cast<double>(), v.cast<double>(), set, with_masking(masking));
        CHECK((fused_double - exact).cwiseAbs().maxCoeff() < 1e-12);
      }
    }
  }
}

TEST_CASE("partition kernels give the same output for any thread count", "[partition_attention]") {
  const Index n = 700, d = 16;
  const auto [q, k, v] = random_qkv<float>(n, d, d, 31);
  const PartitionSet set = poslsh::sample_partition_set(12.0, 9, n, 4, 0, poslsh::Sampler::poisson);
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
#ifdef _OPENMP
    const int restore = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
    const RowMatrix<float> fused =
        poslsh::lsh_attention_fused<float>(q, k, v, set, with_masking(masking));
    const RowMatrix<float> blocks = partition_attention_blocks(q, k, v, set, masking);
#ifdef _OPENMP
    for (int threads : {2, 3, 5}) {
      omp_set_num_threads(threads);
      INFO(poslsh_test::masking_name(masking) << ", " << threads << " threads against 1");
      CHECK(poslsh::lsh_attention_fused<float>(q, k, v, set, with_masking(masking)) == fused);
      CHECK(partition_attention_blocks(q, k, v, set, masking) == blocks);
    }
    omp_set_num_threads(restore);
#else
    CHECK(poslsh::lsh_attention_fused<float>(q, k, v, set, with_masking(masking)) == fused);
    WARN("built without OpenMP: only repeated runs are compared");
#endif
  }
}

TEST_CASE("partition kernels name bad arguments", "[partition_attention]") {
  const Index n = 50, d = 8;
  const RowMatrix<float> q = random_matrix<float>(n, d, 41);
  const RowMatrix<float> k = random_matrix<float>(n, d, 42);
  const RowMatrix<float> v = random_matrix<float>(n, d, 43);
  const PartitionSet set = poslsh::sample_partition_set(4.0, 3, n, 1, 0, poslsh::Sampler::poisson);
  RowMatrix<float> out(n, d);
  const auto fused = [&](const PartitionSet& partitions) {
    poslsh::lsh_attention_fused<float>(q, k, v, partitions, out);
  };
  const auto blocks = [&](const PartitionSet& partitions) {
    poslsh::lsh_attention_by_blocks<float>(q, k, v, partitions, out);
  };
  PartitionSet other_length =
      poslsh::sample_partition_set(4.0, 3, n + 1, 1, 0, poslsh::Sampler::poisson);
  require_invalid_argument([&] { fused(other_length); }, "partitions.n");
  require_invalid_argument([&] { blocks(other_length); }, "partitions.n");
  PartitionSet unordered = set;
  std::swap(unordered.edges[1], unordered.edges[2]);
  require_invalid_argument([&] { fused(unordered); }, "partitions.edges");
  require_invalid_argument([&] { blocks(unordered); }, "partitions.edges");
  require_invalid_argument([&] { poslsh::lsh_fused_pair_count(unordered, Masking::causal); },
                           "partitions.edges");
  PartitionSet empty;
  empty.n = n;
  require_invalid_argument([&] { fused(empty); }, "partitions.offsets");
  RowMatrix<float> wrong(n - 1, d);
  require_invalid_argument([&] { poslsh::lsh_attention_fused<float>(q, k, v, set, wrong); }, "out");
  require_invalid_argument([&] { poslsh::lsh_attention_by_blocks<float>(q, k, v, set, wrong); },
                           "out");
}
