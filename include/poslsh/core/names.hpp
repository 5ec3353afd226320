/// \file
/// \brief One name table per enum: `enum_name(value)` and `enum_from_name<E>(name)` read the
/// table `EnumNames<E>::table` that the header declaring E specializes, so every enum's names
/// (in C++ messages, in plan printouts and in the Python bindings) come from one place.
///
/// Adding an enum: name its enumerators next to its declaration, in declaration order,
///   enum class MyEnum { a, b };
///   POSLSH_ENUM_NAMES(MyEnum, a, b);
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

/// POSLSH_ENUM_NAMES(Enum, a, b, ...) at namespace poslsh scope, for 1 to 10 enumerators:
/// specializes EnumNames<Enum> with the table {{Enum::a, "a"}, {Enum::b, "b"}, ...}, each
/// enumerator named as it is spelled (a name cannot drift from its enumerator, and a misspelt
/// enumerator does not compile).
#define POSLSH_ENUM_NAMES(Enum, ...)                                                    \
  template <>                                                                           \
  struct EnumNames<Enum> {                                                              \
    static constexpr EnumName<Enum> table[] = {POSLSH_ENUM_ENTRIES(Enum, __VA_ARGS__)}; \
  }

// POSLSH_ENUM_ENTRIES(E, a, b, ...): {E::a, "a"}, {E::b, "b"}, ... for 1 to 10 names, by the
// count of names picking the expansion POSLSH_NAMES_<count>, which peels one name off.
// clang-format off
#define POSLSH_NAME_OF(E, name) EnumName<E>{E::name, #name}
#define POSLSH_NAMES_1(E, a) POSLSH_NAME_OF(E, a)
#define POSLSH_NAMES_2(E, a, ...) POSLSH_NAME_OF(E, a), POSLSH_NAMES_1(E, __VA_ARGS__)
#define POSLSH_NAMES_3(E, a, ...) POSLSH_NAME_OF(E, a), POSLSH_NAMES_2(E, __VA_ARGS__)
#define POSLSH_NAMES_4(E, a, ...) POSLSH_NAME_OF(E, a), POSLSH_NAMES_3(E, __VA_ARGS__)
#define POSLSH_NAMES_5(E, a, ...) POSLSH_NAME_OF(E, a), POSLSH_NAMES_4(E, __VA_ARGS__)
#define POSLSH_NAMES_6(E, a, ...) POSLSH_NAME_OF(E, a), POSLSH_NAMES_5(E, __VA_ARGS__)
#define POSLSH_NAMES_7(E, a, ...) POSLSH_NAME_OF(E, a), POSLSH_NAMES_6(E, __VA_ARGS__)
#define POSLSH_NAMES_8(E, a, ...) POSLSH_NAME_OF(E, a), POSLSH_NAMES_7(E, __VA_ARGS__)
#define POSLSH_NAMES_9(E, a, ...) POSLSH_NAME_OF(E, a), POSLSH_NAMES_8(E, __VA_ARGS__)
#define POSLSH_NAMES_10(E, a, ...) POSLSH_NAME_OF(E, a), POSLSH_NAMES_9(E, __VA_ARGS__)
#define POSLSH_ENUM_COUNT(...) POSLSH_ENUM_COUNT_(__VA_ARGS__, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define POSLSH_ENUM_COUNT_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, count, ...) count
#define POSLSH_ENUM_CONCAT(a, b) POSLSH_ENUM_CONCAT_(a, b)
#define POSLSH_ENUM_CONCAT_(a, b) a##b
#define POSLSH_ENUM_ENTRIES(E, ...) \
  POSLSH_ENUM_CONCAT(POSLSH_NAMES_, POSLSH_ENUM_COUNT(__VA_ARGS__))(E, __VA_ARGS__)
// clang-format on

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

/// The names of the enumerators of an enum's table for which keep(value) holds, in declaration
/// order, joined as "a, b or c" (for messages).
template <typename Enum, typename Keep>
std::string enum_name_list(Keep keep) {
  std::string list;
  std::size_t listed = 0, count = 0;
  for (const EnumName<Enum>& entry : EnumNames<Enum>::table) count += keep(entry.value) ? 1 : 0;
  for (const EnumName<Enum>& entry : EnumNames<Enum>::table) {
    if (!keep(entry.value)) continue;
    if (listed > 0) list += listed + 1 == count ? " or " : ", ";
    list += entry.name;
    ++listed;
  }
  return list;
}

/// The names of an enum's table, joined as "a, b or c" (for messages).
template <typename Enum>
std::string enum_name_list() {
  return enum_name_list<Enum>([](Enum) { return true; });
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
