# Install rules and the CMake package (find_package(poslsh)).
include(CMakePackageConfigHelpers)

install(TARGETS poslsh EXPORT poslshTargets)
if(TARGET poslsh_analysis)
  install(TARGETS poslsh_analysis EXPORT poslshTargets)
endif()
install(DIRECTORY include/poslsh DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT poslshTargets
  NAMESPACE poslsh::
  DESTINATION ${CMAKE_INSTALL_DATADIR}/cmake/poslsh)

configure_package_config_file(
  ${CMAKE_CURRENT_SOURCE_DIR}/cmake/poslshConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/poslshConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_DATADIR}/cmake/poslsh)
write_basic_package_version_file(
  ${CMAKE_CURRENT_BINARY_DIR}/poslshConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion
  ARCH_INDEPENDENT)
install(FILES
  ${CMAKE_CURRENT_BINARY_DIR}/poslshConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/poslshConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_DATADIR}/cmake/poslsh)
