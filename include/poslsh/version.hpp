// poslsh: Positional LSH for ALiBi attention.
// The single source of the library version; CMake reads these three lines.
#pragma once

#define POSLSH_VERSION_MAJOR 0
#define POSLSH_VERSION_MINOR 1
#define POSLSH_VERSION_PATCH 0

namespace poslsh {

/// Library version as "major.minor.patch".
inline constexpr const char* version_string = "0.1.0";

}  // namespace poslsh
