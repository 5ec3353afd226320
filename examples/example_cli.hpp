// Command-line helpers shared by the example programs: the error exit, number, list and enum
// parsing, and the flag loop with --help. Every error names the program and exits with 2.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <poslsh/core/names.hpp>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace poslsh_examples {

/// Prints "<program>: <message> (see --help)" to stderr and exits with status 2.
[[noreturn]] inline void fail(const char* program, const std::string& message) {
  std::fprintf(stderr, "%s: %s (see --help)\n", program, message.c_str());
  std::exit(2);
}

/// The whole of `text` as a finite number (strtod); fails with "bad value for <flag>".
inline double parse_number(const char* program, const char* text, const std::string& flag) {
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(value)) fail(program, "bad value for " + flag);
  return value;
}

/// Comma-separated positive values such as "4,16,64" (a trailing comma is ignored): integers
/// (strtoll) for an integral T, finite reals (strtod) otherwise. Fails with "<flag> needs
/// positive integers|numbers separated by commas", or "<flag> is empty" for an empty text.
template <typename T>
std::vector<T> parse_positive_list(const char* program, const char* text, const std::string& flag) {
  const std::string bad =
      flag + (std::is_integral<T>::value ? " needs positive integers" : " needs positive numbers") +
      " separated by commas";
  std::vector<T> values;
  for (const char* p = text; *p != '\0';) {
    char* end = nullptr;
    bool positive = false;
    if constexpr (std::is_integral<T>::value) {
      const long long value = std::strtoll(p, &end, 10);
      positive = value >= 1;
      values.push_back(static_cast<T>(value));
    } else {
      const double value = std::strtod(p, &end);
      positive = value > 0.0 && std::isfinite(value);
      values.push_back(static_cast<T>(value));
    }
    if (end == p || !positive || (*end != ',' && *end != '\0')) fail(program, bad);
    p = *end == ',' ? end + 1 : end;
  }
  if (values.empty()) fail(program, flag + " is empty");
  return values;
}

/// The file of a --csv option: nullptr for an empty path, else `path` opened for writing with
/// `header` (the first line, newline included) written; fails with "cannot write <path>".
inline std::FILE* open_csv(const char* program, const std::string& path, const char* header) {
  if (path.empty()) return nullptr;
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) fail(program, "cannot write " + path);
  std::fputs(header, file);
  return file;
}

/// The flag loop of an example program, one argument at a time. Each option reader returns
/// false unless the current argument is its name; then it reads the option and returns true:
///   for (Args args(program, usage, argc, argv); args.next();) {
///     if (!(args.number("--n", n) || args.text("--csv", csv) || ...)) args.unknown();
///   }
class Args {
 public:
  Args(const char* program, const char* usage, int argc, char** argv)
      : program_(program), usage_(usage), argc_(argc), argv_(argv) {}

  /// Moves to the next argument; false after the last. --help or -h prints the usage text to
  /// stdout and exits with 0.
  bool next() {
    if (++index_ >= argc_) return false;
    flag_ = argv_[index_];
    if (flag_ == "--help" || flag_ == "-h") {
      std::fputs(usage_, stdout);
      std::exit(0);
    }
    return true;
  }

  /// The current argument.
  const std::string& flag() const { return flag_; }

  /// Takes the argument after the flag as its value; fails with "<flag> needs a value".
  const char* value() {
    if (index_ + 1 >= argc_) fail(program_, flag_ + " needs a value");
    return argv_[++index_];
  }

  /// `name VALUE`: target = static_cast<T>(parse_number(VALUE)), without a range check.
  template <typename T>
  bool number(const char* name, T& target) {
    if (flag_ != name) return false;
    target = static_cast<T>(parse_number(program_, value(), flag_));
    return true;
  }

  /// `name LIST`: target = parse_positive_list<T>(LIST).
  template <typename T>
  bool positive_list(const char* name, std::vector<T>& target) {
    if (flag_ != name) return false;
    target = parse_positive_list<T>(program_, value(), flag_);
    return true;
  }

  /// `name TEXT`: target = TEXT.
  bool text(const char* name, std::string& target) {
    if (flag_ != name) return false;
    target = value();
    return true;
  }

  /// `name NAME`: target = the enumerator of T called NAME (poslsh::enum_from_name); fails with
  /// "unknown <what>" for a name T does not have.
  template <typename T>
  bool enumerator(const char* name, T& target, const char* what) {
    if (flag_ != name) return false;
    const char* text = value();
    try {
      target = poslsh::enum_from_name<T>(text);
    } catch (const std::invalid_argument&) {
      fail(program_, std::string("unknown ") + what);
    }
    return true;
  }

  /// `name` alone (a switch): target = setting.
  template <typename T>
  bool set(const char* name, T& target, T setting) {
    if (flag_ != name) return false;
    target = setting;
    return true;
  }

  /// Fails with "unknown option <flag>".
  [[noreturn]] void unknown() const { fail(program_, "unknown option " + flag_); }

 private:
  const char* program_;
  const char* usage_;
  int argc_;
  char** argv_;
  int index_ = 0;
  std::string flag_;
};

}  // namespace poslsh_examples
