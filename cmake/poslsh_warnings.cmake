# Warnings and machine flags for the project's own programs (tests, examples, benchmarks).
# Never applied to the poslsh target itself, so users' flags are left alone.
function(poslsh_project_target target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wconversion -Wshadow)
    if(POSLSH_WARNINGS_AS_ERRORS)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      # GCC 12 reports false positives inside its own AVX-512 intrinsics as Eigen inlines them.
      target_compile_options(${target} PRIVATE -Wno-maybe-uninitialized)
    endif()
    if(POSLSH_NATIVE)
      target_compile_options(${target} PRIVATE -march=native)
    endif()
  endif()
  target_link_libraries(${target} PRIVATE poslsh::poslsh)
endfunction()
