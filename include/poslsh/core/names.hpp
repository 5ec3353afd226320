/// \file
/// \brief One name table per enum: `enum_name(value)` and `enum_from_name<E>(name)` read the
/// table `EnumNames<E>::table` that the header declaring E specializes, so every enum's names
/// (in C++ messages, in plan printouts and in the Python bindings) come from one place.
///
/// Adding an enum: specialize EnumNames next to its declaration,
///   template <> struct EnumNames<MyEnum> {
///     static constexpr EnumName<MyEnum> table[] = {{MyEnum::a, "a"}, {MyEnum::b, "b"}};
///   };
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

#include "poslsh/detail/checks/require.hpp"

namespace poslsh {

/// One enumerator and its name.
template <typename Enum>
struct EnumName {
  Enum value;
  const char* name;
};

/// The name table of an enum: specialized for each enum with a static constexpr array `table`
/// of EnumName<Enum>, every enumerator once, in declaration order.
template <typename Enum>
struct EnumNames;

/// The name of `value` in its enum's table ("unknown" for a value outside the enumerators).
template <typename Enum>
constexpr const char* enum_name(Enum value) {
  for (const EnumName<Enum>& entry : EnumNames<Enum>::table) {
    if (entry.value == value) return entry.name;
  }
  return "unknown";
}

/// Whether `value` is one of the enumerators of its enum's table.
template <typename Enum>
constexpr bool enum_is_valid(Enum value) {
  for (const EnumName<Enum>& entry : EnumNames<Enum>::table) {
    if (entry.value == value) return true;
  }
  return false;
}

/// The enumerators of an enum's table, in declaration order (a std::array, for sweeps).
template <typename Enum>
constexpr auto enum_values() {
  constexpr std::size_t count = std::size(EnumNames<Enum>::table);
  std::array<Enum, count> values{};
  for (std::size_t e = 0; e < count; ++e) values[e] = EnumNames<Enum>::table[e].value;
  return values;
}

/// The names of an enum's table, joined as "a, b or c" (for messages).
template <typename Enum>
std::string enum_name_list() {
  std::string list;
  constexpr std::size_t count = std::size(EnumNames<Enum>::table);
  for (std::size_t e = 0; e < count; ++e) {
    if (e > 0) list += e + 1 == count ? " or " : ", ";
    list += EnumNames<Enum>::table[e].name;
  }
  return list;
}

/// The enumerator called `name`. Throws std::invalid_argument naming `argument` of `function`
/// and listing the valid names for a name outside the table.
template <typename Enum>
Enum enum_from_name(std::string_view name, const char* function = "enum_from_name",
                    const char* argument = "name") {
  for (const EnumName<Enum>& entry : EnumNames<Enum>::table) {
    if (name == entry.name) return entry.value;
  }
  detail::throw_invalid(function, argument, std::string(name), "must be " + enum_name_list<Enum>());
}

}  // namespace poslsh
