// The dense oracle of the LSH kernels: T~ = D~^-1 (A o M~) V from the mean mask, in double.
#pragma once

#include <cmath>
#include <poslsh/core/types.hpp>
#include <poslsh/reference/masks.hpp>

namespace poslsh_test {

template <typename Scalar>
poslsh::RowMatrix<double> lsh_dense_oracle(const poslsh::RowMatrix<Scalar>& q,
                                           const poslsh::RowMatrix<Scalar>& k,
                                           const poslsh::RowMatrix<Scalar>& v,
                                           const poslsh::HashSet& hashes, poslsh::Masking masking,
                                           double tau) {
  const auto mean = poslsh::mean_mask_dense<double>(hashes, q.rows(), masking);
  poslsh::RowMatrix<double> scores =
      tau * q.template cast<double>() * k.template cast<double>().transpose();
  // Subtract each row's maximum over its non-zero mask entries (as any stable softmax would).
  for (Eigen::Index i = 0; i < scores.rows(); ++i) {
    double row_max = -INFINITY;
    for (Eigen::Index j = 0; j < scores.cols(); ++j)
      if (mean(i, j) > 0) row_max = std::max(row_max, scores(i, j));
    scores.row(i).array() -= row_max;
  }
  const poslsh::RowMatrix<double> weighted =
      (mean.array() > 0).select(scores.array().exp() * mean.array(), 0.0);
  const Eigen::VectorXd row_sums = weighted.rowwise().sum();
  return row_sums.cwiseInverse().asDiagonal() * weighted * v.template cast<double>();
}

}  // namespace poslsh_test
