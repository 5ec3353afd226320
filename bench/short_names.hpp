// poslsh benchmarks: a reporter that prints rows under their registered names only.
#pragma once

#include <benchmark/benchmark.h>

#include <memory>
#include <vector>

namespace poslsh::bench {

/// Forwards every report to `inner` with the run-option suffixes that Google Benchmark appends
/// to a name ("/min_time:0.500", "/iterations:1", "/real_time") removed, so rows read
/// `<method>/<n>` as registered, and peak_share (a rate counter: FLOPs over the row's time over
/// the peak) printed as the plain share it is. Filters (--benchmark_filter) still match the full
/// names. The stream set on this reporter (stdout, or the --benchmark_out file) is the inner one's.
class ShortNameReporter : public benchmark::BenchmarkReporter {
 public:
  /// `inner` is not owned (e.g. benchmark::CreateDefaultDisplayReporter()).
  explicit ShortNameReporter(benchmark::BenchmarkReporter* inner) : inner_(inner) {}
  /// Owns `inner`.
  explicit ShortNameReporter(std::unique_ptr<benchmark::BenchmarkReporter> inner)
      : owned_(std::move(inner)), inner_(owned_.get()) {}

  bool ReportContext(const Context& context) override {
    inner_->SetOutputStream(&GetOutputStream());
    inner_->SetErrorStream(&GetErrorStream());
    return inner_->ReportContext(context);
  }

  void ReportRuns(const std::vector<Run>& reports) override {
    std::vector<Run> renamed = reports;
    for (Run& run : renamed) {
      run.run_name.min_time.clear();
      run.run_name.min_warmup_time.clear();
      run.run_name.iterations.clear();
      run.run_name.time_type.clear();
      // A share, computed as a rate over the row's time: printed as a plain number.
      const auto share = run.counters.find("peak_share");
      if (share != run.counters.end()) {
        share->second.flags = static_cast<benchmark::Counter::Flags>(share->second.flags &
                                                                     ~benchmark::Counter::kIsRate);
      }
    }
    inner_->ReportRuns(renamed);
  }

  void Finalize() override { inner_->Finalize(); }

 private:
  std::unique_ptr<benchmark::BenchmarkReporter> owned_;
  benchmark::BenchmarkReporter* inner_;
};

}  // namespace poslsh::bench
