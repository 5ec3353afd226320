// poslsh internals: the detection idiom of the Library Fundamentals TS v2 (is_detected,
// detected_or_t), for the traits that ask whether a type provides a member: each trait names
// the expression it needs as an alias template Op and asks is_detected<Op, T...>.
//   is_detected<Op, T...>             std::true_type when Op<T...> is a valid type, else
//                                     std::false_type;
//   detected_or_t<Default, Op, T...>  Op<T...> when it is valid, else Default.
#pragma once

#include <type_traits>

namespace poslsh::detail {

template <typename Default, typename AlwaysVoid, template <typename...> class Op, typename... T>
struct detector {
  using value_t = std::false_type;
  using type = Default;
};
template <typename Default, template <typename...> class Op, typename... T>
struct detector<Default, std::void_t<Op<T...>>, Op, T...> {
  using value_t = std::true_type;
  using type = Op<T...>;
};

/// std::true_type when Op<T...> is a valid type, else std::false_type.
template <template <typename...> class Op, typename... T>
using is_detected = typename detector<void, void, Op, T...>::value_t;

/// Op<T...> when it is a valid type, else Default.
template <typename Default, template <typename...> class Op, typename... T>
using detected_or_t = typename detector<Default, void, Op, T...>::type;

}  // namespace poslsh::detail
