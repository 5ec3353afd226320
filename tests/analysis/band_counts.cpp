// The union-band count representation of M~ (BandCountOperator): its entries are the dense
// mean mask's, its products agree with the block-sum operator and the dense matrix, its
// max-norm error is max_error's bit for bit, and kernel_error_metrics gives the same errors in
// both representations; Poisson partitions through partition_error_metrics against the dense
// formula.
#include <poslsh/analysis.hpp>
#include <poslsh/analysis/band_counts.hpp>
#include <poslsh/attention/fused.hpp>
#include <poslsh/lsh/samplers.hpp>
#include <poslsh/reference/masks.hpp>

#include "analysis_instantiations.hpp"
#include "test_support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>

using poslsh::PartitionSet;
using poslsh::Sampler;

namespace {

/// (1/s) #{k : i, j in one block of partition k} (causal: j <= i), brute force.
RowMatrix<double> dense_mean(const PartitionSet& set, Masking masking) {
  const Index n = set.n;
  RowMatrix<double> counts = RowMatrix<double>::Zero(n, n);
  for (Index k = 0; k < set.samples(); ++k) {
    for (const Index* edge = set.begin(k); edge + 1 != set.end(k); ++edge) {
      for (Index i = edge[0]; i < edge[1]; ++i)
        for (Index j = edge[0]; j < edge[1]; ++j)
          if (masking == Masking::bidirectional || j <= i) counts(i, j) += 1.0;
    }
  }
  return counts / static_cast<double>(set.samples());
}

Eigen::VectorXd test_vector(Index n, std::uint64_t seed) {
  return poslsh_test::random_matrix<double>(n, 1, seed);
}

}  // namespace

TEST_CASE("band counts hold the dense mean mask and multiply like it", "[band_counts]") {
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    for (Index n : {Index{1}, Index{57}, Index{150}}) {
      for (double sigma : {0.7, 12.0}) {
        for (Index s : {Index{1}, Index{9}, Index{60}}) {
          INFO("n " << n << ", sigma " << sigma << ", s " << s);
          const HashSet hashes = poslsh::rbf_hashes(sigma, s, 3, 1);
          const poslsh::BandCountOperator band(hashes, n, masking);
          const poslsh::MeanMaskOperator blocks(hashes, n, masking);
          const RowMatrix<double> dense = poslsh::mean_mask_dense<double>(hashes, n, masking);
          double worst_entry = 0.0;
          for (Index i = 0; i < n; ++i)
            for (Index j = 0; j < n; ++j)
              worst_entry = std::max(worst_entry, std::abs(band.entry(i, j) - dense(i, j)));
          CHECK(worst_entry == 0.0);
          const Eigen::VectorXd x = test_vector(n, 17);
          Eigen::VectorXd y(n), z(n);
          band.apply<double>(x, y);
          blocks.apply<double>(x, z);
          const Eigen::VectorXd expected = dense * x;
          CHECK((y - expected).cwiseAbs().maxCoeff() <= 1e-12 * (1.0 + expected.norm()));
          CHECK((y - z).cwiseAbs().maxCoeff() <= 1e-12 * (1.0 + expected.norm()));
          band.apply_transpose<double>(x, y);
          const Eigen::VectorXd expected_t = dense.transpose() * x;
          CHECK((y - expected_t).cwiseAbs().maxCoeff() <= 1e-12 * (1.0 + expected_t.norm()));
          const PartitionSet set = poslsh::partition_set(hashes, n);
          CHECK(poslsh::partition_pair_count(set, masking) ==
                poslsh::lsh_fused_pair_count(hashes, n, masking));
          long long nonzero = 0;
          for (Index i = 0; i < n; ++i)
            for (Index j = 0; j < n; ++j) nonzero += dense(i, j) > 0.0 ? 1 : 0;
          CHECK(poslsh::partition_pair_count(set, masking) == nonzero);
          const poslsh::MaxError a = band.max_error(sigma);
          const poslsh::MaxError b = poslsh::max_error(hashes, n, sigma, masking);
          CHECK(a.value == b.value);
          CHECK(a.row == b.row);
          CHECK(a.col == b.col);
        }
      }
    }
  }
}

TEST_CASE("the stored block edges are block_boundaries'", "[band_counts]") {
  for (double sigma : {0.2, 1.0, 3.0, 50.0, 1e7}) {
    const HashSet hashes = poslsh::rbf_hashes(sigma, 40, 12, 0);
    for (Index n : {Index{0}, Index{1}, Index{2}, Index{777}}) {
      const PartitionSet set = poslsh::partition_set(hashes, n);
      for (Index k = 0; k < set.samples(); ++k) {
        const std::vector<Index> expected =
            poslsh::block_boundaries(hashes[static_cast<std::size_t>(k)], n);
        const std::vector<Index> got(set.begin(k), set.end(k));
        INFO("sigma " << sigma << ", n " << n << ", k " << k);
        REQUIRE(got == expected);
      }
    }
  }
}

TEST_CASE("band-count products do not depend on the thread count", "[band_counts]") {
  const Index n = 5000;
  const HashSet hashes = poslsh::rbf_hashes(8.0, 300, 4, 0);
  const poslsh::BandCountOperator band(hashes, n, Masking::causal);
  const Eigen::VectorXd x = test_vector(n, 5);
  Eigen::VectorXd one(n), two(n);
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  band.apply<double>(x, one);
  omp_set_num_threads(2);
  band.apply<double>(x, two);
  omp_set_num_threads(threads);
#else
  band.apply<double>(x, one);
  band.apply<double>(x, two);
#endif
  CHECK(one == two);
}

TEST_CASE("kernel_error_metrics agrees in both representations", "[band_counts][analysis]") {
  const Index n = 600;
  const double sigma = 6.0;
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const HashSet hashes = poslsh::rbf_hashes(sigma, 1000, 2, 0);
    poslsh::MetricOptions blocks, band;
    blocks.representation = poslsh::MaskRepresentation::block_sums;
    band.representation = poslsh::MaskRepresentation::band_counts;
    const poslsh::KernelErrorMetrics a =
        poslsh::kernel_error_metrics(hashes, n, sigma, masking, blocks);
    const poslsh::KernelErrorMetrics b =
        poslsh::kernel_error_metrics(hashes, n, sigma, masking, band);
    INFO("spectral " << a.spectral << " vs " << b.spectral);
    CHECK(std::abs(a.spectral - b.spectral) <= 1e-8 * a.spectral);
    CHECK(a.max == b.max);
    CHECK(a.kernel_norm == b.kernel_norm);
    // about s n / (2 sigma) = 50000 blocks against n (2 b + 1): automatic takes the band counts
    // here.
    CHECK(poslsh::choose_mask_representation(poslsh::partition_set(hashes, n)) ==
          poslsh::MaskRepresentation::band_counts);
  }
}

TEST_CASE("partition_error_metrics of Poisson cuts matches the dense formula",
          "[band_counts][analysis]") {
  for (Masking masking : {Masking::causal, Masking::bidirectional}) {
    const Index n = 120;
    const double sigma = 4.0;
    const PartitionSet set = poslsh::sample_partition_set(sigma, 30, n, 8, 2, Sampler::poisson);
    const RowMatrix<double> error =
        poslsh::alibi_kernel_dense<double>(n, sigma, masking) - dense_mean(set, masking);
    const double dense_max = error.cwiseAbs().maxCoeff();
    const Eigen::JacobiSVD<RowMatrix<double>> svd(error);
    const double dense_spectral = svd.singularValues()(0);
    for (auto representation :
         {poslsh::MaskRepresentation::block_sums, poslsh::MaskRepresentation::band_counts}) {
      poslsh::MetricOptions options;
      options.representation = representation;
      options.spectral.method = poslsh::SpectralMethod::lanczos;
      const poslsh::KernelErrorMetrics m =
          poslsh::partition_error_metrics(set, sigma, masking, options);
      CHECK(m.max == dense_max);
      CHECK(std::abs(m.spectral - dense_spectral) <= 1e-8 * dense_spectral);
    }
    const poslsh::BandCountOperator band(set, masking);
    const Eigen::VectorXd x = test_vector(n, 9);
    Eigen::VectorXd y(n);
    band.apply<double>(x, y);
    CHECK((y - dense_mean(set, masking) * x).cwiseAbs().maxCoeff() <= 1e-12 * x.norm());
  }
  PartitionSet bad = poslsh::sample_partition_set(4.0, 2, 50, 1, 0, Sampler::poisson);
  bad.edges.back() = 49;
  poslsh_test::require_invalid_argument(
      [&] { poslsh::partition_error_metrics(bad, 4.0, Masking::causal); }, "partitions.edges");
}
